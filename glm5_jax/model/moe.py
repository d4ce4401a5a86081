"""Mixture of experts: sigmoid router with selection bias and group-limited top-k, routed
experts run as a grouped (ragged) matmul over expert-sorted tokens, plus the shared expert.

    sigma = sigmoid(u Wg)          (float32 gate)
    b     = sigma + e_bias         (selection only)
    keep the topk_group groups with the largest sum of their top-2 b; others -inf
    idx   = topk(b, K); w = sigma[idx]; w /= sum(w) + 1e-20 (optional); w *= routed_scaling
    y     = sum_k w_k expert_{idx_k}(u) + shared(u)
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from glm5_jax.model import kernel_calls
from glm5_jax.model.layers import (
    WeightSpec,
    WeightTable,
    batched_matmul,
    mlp_weights,
    normal_init,
    swiglu,
    swiglu_mlp,
)
from glm5_jax.parallel import constrain
from glm5_jax.parallel.expert import expert_mesh, routed_experts_sharded
from glm5_jax.quant.formats import is_quantized
from glm5_jax.quant.matmul import expert_linear


@dataclasses.dataclass(frozen=True)
class MoESpec:
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    num_expert_groups: int
    num_selected_groups: int
    normalize_topk_weights: bool
    routed_scaling_factor: float
    initializer_range: float
    impl: str = "ragged"  # "ragged" (ragged_dot), "blocked" (padded blocks) or "dense" (all experts)
    # Expert parallelism (active when the context mesh has an `expert` axis > 1).
    dispatch: str = "all_to_all"
    capacity_factor: float = 0.0  # 0 = dropless
    # How the gathered path multiplies by "fp8" expert weights (glm5_jax.quant.matmul.IMPLS).
    quantized_matmul: str = "dequantize"
    # GLM-5.3-Flash clamps every SwiGLU's inputs (routed and shared experts): see layers.swiglu.
    swiglu_limit: float = 0.0  # 0 = no clamp (GLM-5)


def route(x: jax.Array, router: jax.Array, selection_bias: jax.Array, spec: MoESpec):
    """Chooses experts per token.

    x: [T, D]; router: [D, E] (float32); selection_bias: [E].
    Returns (weights [T, K] float32, expert indices [T, K] int32, scores [T, E] float32).
    """
    scores = jax.nn.sigmoid(jnp.einsum("TD,DE->TE", x.astype(jnp.float32),
                                       router.astype(jnp.float32)))
    choice = scores + selection_bias.astype(jnp.float32)
    groups = spec.num_expert_groups
    if groups > 1:
        grouped = choice.reshape(choice.shape[0], groups, -1)  # [T, G, E/G]
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
        kept_groups = jax.lax.top_k(group_scores, spec.num_selected_groups)[1]
        group_kept = jnp.zeros_like(group_scores, dtype=bool)
        group_kept = jnp.put_along_axis(group_kept, kept_groups, True, axis=-1, inplace=False)
        choice = jnp.where(group_kept[:, :, None], grouped, -jnp.inf).reshape(choice.shape)
    experts = jax.lax.top_k(jax.lax.stop_gradient(choice), spec.num_experts_per_token)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if spec.normalize_topk_weights:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * spec.routed_scaling_factor, experts.astype(jnp.int32), scores


def sequence_balance_loss(scores: jax.Array, experts: jax.Array, num_experts: int) -> jax.Array:
    """Sequence-wise auxiliary balance loss (DeepSeek-V3), averaged over sequences.

    scores: [B, T, E] router sigmoids; experts: [B, T, K] chosen experts. Per sequence:
    sum_e f_e * P_e with f_e = E / (K T) * (tokens routed to e) and P_e the mean normalised
    score of e. Equals 1 for perfectly uniform routing.
    """
    _, length, top_k = experts.shape
    counts = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(axis=(1, 2))  # [B, E]
    fraction = counts * num_experts / (top_k * length)
    probability = (scores / scores.sum(-1, keepdims=True)).mean(axis=1)  # [B, E]
    return jnp.mean(jnp.sum(fraction * probability, axis=-1))


@struct.dataclass
class InputMajorExperts:
    """Routed-expert weights [E, I, O] held input-major, as [I, E, O] (the serving layout of the
    dense path, `paged_decode.serving_layout`). Multiplying every expert at once contracts I:
    XLA:CPU copied an [E, I, O] stack into [I, E * O] at every use (a third of a 32-row decode
    step's expert time), and reads this layout in place. Casting keeps the layout; indexing by
    expert ids gathers those experts' [I, O] matrices, as indexing the stack does."""

    by_input: jax.Array  # [..., I, E, O] (a scan over layers slices the leading axes)

    @property
    def shape(self) -> tuple[int, ...]:
        *leading, inputs, num_experts, outputs = self.by_input.shape
        return (*leading, num_experts, inputs, outputs)

    @property
    def dtype(self):
        return self.by_input.dtype

    def astype(self, dtype) -> InputMajorExperts:
        return InputMajorExperts(self.by_input.astype(dtype))

    def __getitem__(self, experts: jax.Array) -> jax.Array:
        """experts [T, K] int -> their matrices [T, K, I, O] (one layer's weights, [I, E, O])."""
        return jnp.moveaxis(self.by_input[:, experts], 0, 2)

    def expert_major(self) -> jax.Array:
        """The [..., E, I, O] stack (a copy), for the paths that take one."""
        return jnp.swapaxes(self.by_input, -3, -2)


def input_major_experts(stack: jax.Array) -> InputMajorExperts:
    """[..., E, I, O] -> the same weights held input-major (one copy, when serving starts)."""
    return InputMajorExperts(jnp.swapaxes(stack, -3, -2))


def _every_expert(x: jax.Array, weight) -> jax.Array:
    """x [T, I] through every expert's matrix (weight [E, I, O], or held input-major) -> [T, E, O]."""
    if isinstance(weight, InputMajorExperts):
        return jnp.einsum("TD,DEF->TEF", x, weight.by_input.astype(x.dtype))
    return jnp.einsum("TD,EDF->TEF", x, weight.astype(x.dtype))


def routed_experts_dense(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array,
                         up_proj: jax.Array, down_proj: jax.Array, swiglu_limit: float = 0.0) -> jax.Array:
    """Every expert on every token, combined with zero weight for the unchosen ones.

    Same shapes and result as `routed_experts_ragged`; num_experts / top-k times the FLOPs, but
    plain batched matmuls, which is faster on CPUs and for small expert counts. gate_proj and
    up_proj may be `InputMajorExperts`.
    """
    num_experts = gate_proj.shape[0]
    dtype = x.dtype
    combine = jnp.zeros((x.shape[0], num_experts), jnp.float32)
    combine = jnp.put_along_axis(combine, experts, weights, axis=-1, inplace=False)  # [T, E]
    gate = _every_expert(x, gate_proj)
    up = _every_expert(x, up_proj)
    hidden = swiglu(gate, up, swiglu_limit) * combine.astype(dtype)[..., None]
    return jnp.einsum("TEF,EFD->TD", hidden, down_proj.astype(dtype))


def routed_experts_blocked(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array,
                           up_proj: jax.Array, down_proj: jax.Array, block_rows: int = 128,
                           swiglu_limit: float = 0.0) -> jax.Array:
    """Dropless grouped matmul from plain batched matmuls (fast where ragged_dot is not, e.g. CPU).

    Same shapes and result as `routed_experts_ragged`. Token copies are sorted by expert and
    each expert's rows padded to a multiple of `block_rows`, so every block of rows belongs to
    one expert; the padded total is bounded statically by T*K + E*(block_rows - 1). Each block
    multiplies with its expert's weights (gathered per block): about T*K rows of work instead
    of the dense path's T*E.
    """
    num_tokens, top_k = experts.shape
    num_experts, hidden = gate_proj.shape[0], x.shape[-1]
    # Few tokens (decode): smaller blocks, so padding does not dominate the work.
    average_rows = -(-num_tokens * top_k // num_experts)
    block_rows = min(block_rows, max(8, 1 << (average_rows - 1).bit_length()))
    dtype = x.dtype
    flat_experts = experts.reshape(-1)  # [T*K]
    order = jnp.argsort(flat_experts, stable=True)
    sorted_experts = flat_experts[order]
    token_of_row = order // top_k
    group_sizes = jnp.bincount(flat_experts, length=num_experts)
    padded_sizes = (group_sizes + block_rows - 1) // block_rows * block_rows
    padded_ends = jnp.cumsum(padded_sizes)
    rank_in_group = jnp.arange(order.shape[0]) - (jnp.cumsum(group_sizes) - group_sizes)[sorted_experts]
    slot = padded_ends[sorted_experts] - padded_sizes[sorted_experts] + rank_in_group  # [T*K]
    capacity = -(-(num_tokens * top_k + num_experts * (block_rows - 1)) // block_rows) * block_rows
    num_blocks = capacity // block_rows
    buffer = jnp.zeros((capacity, hidden), dtype).at[slot].set(x[token_of_row])
    blocks = buffer.reshape(num_blocks, block_rows, hidden)  # [G, C, D]: G blocks of C rows
    block_expert = jnp.minimum(
        jnp.searchsorted(padded_ends, jnp.arange(num_blocks) * block_rows, side="right"), num_experts - 1)
    gate = batched_matmul(blocks, gate_proj.astype(dtype)[block_expert])  # [G, C, F]
    up = batched_matmul(blocks, up_proj.astype(dtype)[block_expert])
    out = batched_matmul(swiglu(gate, up, swiglu_limit), down_proj.astype(dtype)[block_expert])  # [G, C, D]
    out = out.reshape(capacity, hidden)[slot] * weights.reshape(-1)[order][:, None].astype(dtype)
    return jnp.zeros((num_tokens, hidden), dtype).at[token_of_row].add(out)


def routed_experts_ragged(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array,
                          up_proj: jax.Array, down_proj: jax.Array, swiglu_limit: float = 0.0) -> jax.Array:
    """Runs each token through its chosen experts, dropless.

    x: [T, D]; weights, experts: [T, K]; gate/up: [E, D, F]; down: [E, F, D]. Returns [T, D].
    swiglu_limit (every routed-experts path takes it): clamps the SwiGLU inputs, `layers.swiglu`.
    Token copies are sorted by expert so each expert's rows are contiguous; a grouped matmul
    (`ragged_dot`) then applies every expert to its own rows.
    """
    num_tokens, top_k = experts.shape
    num_experts = gate_proj.shape[0]
    dtype = x.dtype
    flat_experts = experts.reshape(-1)  # [T*K]
    order = jnp.argsort(flat_experts, stable=True)
    token_of_row = order // top_k  # [T*K] source token of each sorted row
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
    rows = x[token_of_row]  # [T*K, D]
    gate = jax.lax.ragged_dot(rows, gate_proj.astype(dtype), group_sizes)
    up = jax.lax.ragged_dot(rows, up_proj.astype(dtype), group_sizes)
    out = jax.lax.ragged_dot(swiglu(gate, up, swiglu_limit), down_proj.astype(dtype), group_sizes)
    out = out * weights.reshape(-1)[order][:, None].astype(dtype)
    return jnp.zeros((num_tokens, x.shape[-1]), dtype).at[token_of_row].add(out)


def routed_experts_gathered(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array,
                            up_proj: jax.Array, down_proj: jax.Array, impl: str = "dequantize",
                            swiglu_limit: float = 0.0) -> jax.Array:
    """Each token through its own K experts, their weights gathered per token.

    Same shapes and result as `routed_experts_ragged`. Reads T*K expert matrices: the cheapest
    path when that is below the expert count (decoding a few sequences), where the others read
    (or copy) every expert's weights. impl (glm5_jax.quant.matmul): with "native" or "pallas"
    "fp8" expert stacks are read for the chosen experts only (values and block scales), never
    dequantized whole; "dequantize" dequantizes every expert first.
    """
    dtype = x.dtype
    gate = expert_linear(x[:, None], gate_proj, experts, impl, dtype)  # [T, K, F]
    up = expert_linear(x[:, None], up_proj, experts, impl, dtype)
    out = expert_linear(swiglu(gate, up, swiglu_limit), down_proj, experts, impl, dtype)  # [T, K, D]
    return jnp.einsum("TK,TKD->TD", weights.astype(dtype), out)


# ExecutionOptions.moe_impl -> the routed-expert computation (all give the same result).
ROUTED_EXPERTS = {"dense": routed_experts_dense, "blocked": routed_experts_blocked,
                  "ragged": routed_experts_ragged, "pallas": kernel_calls.routed_experts}


def routed_experts(tokens: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array,
                   up_proj: jax.Array, down_proj: jax.Array,
                   spec: MoESpec) -> tuple[jax.Array, jax.Array | None]:
    """The one routed-experts dispatcher (training, forward and the serving step).

    tokens: [T, D]; weights, experts: [T, K]. Returns (y [T, D], dropped token copies or None).
    Expert-parallel when a mesh with an expert axis is active; else, with at most E token copies
    (T * K <= E: decoding a few sequences) the gathered path; else `spec.impl`. The gathered and
    dense paths read `InputMajorExperts` as they are; the others get the expert-major stack.
    """
    mesh = expert_mesh()
    local_impl = functools.partial(ROUTED_EXPERTS[spec.impl], swiglu_limit=spec.swiglu_limit)
    if spec.impl != "dense" or mesh is not None:
        gate_proj, up_proj = (w.expert_major() if isinstance(w, InputMajorExperts) else w
                              for w in (gate_proj, up_proj))
    if mesh is not None:
        # shard_map hands each device its slice, but a QuantizedTensor's static shapes are
        # global: dequantize first (per layer, as every path does; GSPMD keeps it split).
        gate_proj, up_proj, down_proj = (w.astype(tokens.dtype) if is_quantized(w) else w
                                         for w in (gate_proj, up_proj, down_proj))
        return routed_experts_sharded(tokens, weights, experts, gate_proj, up_proj, down_proj, mesh=mesh,
                                      local_impl=local_impl,
                                      capacity_factor=spec.capacity_factor, dispatch=spec.dispatch)
    if experts.shape[0] * experts.shape[1] <= gate_proj.shape[0]:
        return routed_experts_gathered(tokens, weights, experts, gate_proj, up_proj, down_proj,
                                       spec.quantized_matmul, spec.swiglu_limit), None
    if spec.impl == "pallas":  # per device on its own tokens, whole experts
        return kernel_calls.routed_experts_local(tokens, weights, experts, gate_proj, up_proj,
                                                 down_proj, spec.swiglu_limit), None
    return local_impl(tokens, weights, experts, gate_proj, up_proj, down_proj), None


def moe_weights(spec: MoESpec, param_dtype) -> WeightTable:
    """One MoE layer's weights (checkpoint names under moe/)."""
    init = normal_init(spec.initializer_range)
    num_experts, hidden, inner = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    expert_in = (num_experts, hidden, inner)
    table = {
        # Router weight and selection bias stay float32 (the reference keeps them so).
        "router": WeightSpec((hidden, num_experts), ("embed", "experts"), jnp.float32, init),
        "router_bias": WeightSpec((num_experts,), ("experts",), jnp.float32, nn.initializers.zeros),
        "gate_proj": WeightSpec(expert_in, ("experts", "embed", "mlp"), param_dtype, init),
        "up_proj": WeightSpec(expert_in, ("experts", "embed", "mlp"), param_dtype, init),
        "down_proj": WeightSpec((num_experts, inner, hidden), ("experts", "mlp", "embed"), param_dtype, init),
    }
    if spec.num_shared_experts:
        table["shared_experts"] = mlp_weights(hidden, inner * spec.num_shared_experts, spec.initializer_range,
                                              param_dtype)
    return table


def moe_block(spec: MoESpec, weights, x: jax.Array, with_stats: bool = False, constrain_output: bool = False):
    """The MoE feed-forward. x: [B, T, D] normalised -> (y [B, T, D], {diagnostic: value}).

    with_stats: also per-expert token counts ("expert_load" [E]), the sequence-wise balance loss
    and, when expert parallelism drops copies, "dropped_tokens" (training sows them).
    constrain_output: constrain y to the training activations' sharding."""
    batch, length, hidden = x.shape
    tokens = x.reshape(batch * length, hidden)
    routing_weights, experts, scores = route(tokens, weights["router"], weights["router_bias"], spec)
    stats = {}
    if with_stats:
        stats["expert_load"] = jnp.bincount(experts.reshape(-1), length=spec.num_experts)
        stats["balance_loss"] = sequence_balance_loss(scores.reshape(batch, length, spec.num_experts),
                                                      experts.reshape(batch, length, -1), spec.num_experts)
    y, dropped = routed_experts(tokens, routing_weights, experts, weights["gate_proj"], weights["up_proj"],
                                weights["down_proj"], spec)
    if dropped is not None and with_stats:
        stats["dropped_tokens"] = dropped
    y = y.reshape(x.shape)
    if constrain_output:
        y = constrain(y, ("batch", "length", "embed"))
    if spec.num_shared_experts:
        y = y + swiglu_mlp(x, weights["shared_experts"], spec.quantized_matmul, spec.swiglu_limit)
    return y, stats
