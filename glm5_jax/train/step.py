"""The jitted train and eval steps.

One train step: gradients accumulated over microbatches (lax.scan), an AdamW update, the
aux-loss-free router balancing (selection bias += rate * sign(mean load - expert load), outside
the gradient), and a NaN/Inf guard that keeps the previous state when the loss or the gradient
norm is not finite.

Gradient reduction: by default XLA sums each weight's gradient over the batch's devices where the
gradient is computed (in every microbatch, in the dtype of the weight-gradient matmul).
settings.grad_reduce_dtype ("float32" or "bfloat16") instead computes one gradient per replica of
the mesh's `data` axis (jax.vmap with spmd_axis_name: each device holds its replica's gradient
only), accumulates it locally over the microbatches, and sums the replicas once per step in that
dtype: "bfloat16" halves the bytes of that all-reduce. Like microbatches, replicas weigh equally.
Refused with a pipeline axis or Pallas kernels under the mesh (their shard_maps do not lower
under the vmap). docs/scaling.md, "Communication share", has the measurements.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.model.transformer import apply_model, param_logical_axes, param_shapes, sown_values
from glm5_jax.parallel import sharding
from glm5_jax.parallel.logical import mesh_axes
from glm5_jax.train.dpo import dpo_loss
from glm5_jax.train.grpo import grpo_loss
from glm5_jax.train.loss import expert_loads, language_model_losses, shifted_targets, token_cross_entropy
from glm5_jax.train.settings import TrainSettings

Batch = dict[str, jax.Array]  # input_ids, segment_ids, positions[, loss_mask]: [B, T] int32


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps attempted (skipped ones included)
    params: Any
    opt_state: Any


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    """Step 0 and fresh optimizer moments for `params`, every array placed where the params live.

    Weights that were loaded (orbax restores, device_put into shardings: fine-tuning's init_from)
    are committed to their devices, and so is everything a train step returns, while the fresh
    counters (the step, optax's counts) would not be: jit keys its cache on committedness, so
    such a mix made the first step compile a program of its own and step 2 compile the real one.
    Committed params: the uncommitted leaves go to the params' device, or replicated over their
    mesh (as `train_state_shardings` puts them). Uncommitted params (a run from scratch) and
    traced ones (under jit or eval_shape) are left as they are.
    """
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
    placed = _fresh_leaf_sharding(params)
    if placed is None:
        return state
    return jax.tree.map(lambda x: x if x.committed else jax.device_put(x, placed), state)


def _fresh_leaf_sharding(params):
    """Where a new scalar beside committed `params` belongs (None: leave it uncommitted)."""
    leaves = jax.tree.leaves(params)
    if not leaves or not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                             and x.committed for x in leaves):
        return None
    where = leaves[0].sharding
    if isinstance(where, NamedSharding):
        return NamedSharding(where.mesh, PartitionSpec())
    if len(where.device_set) == 1:
        return jax.sharding.SingleDeviceSharding(next(iter(where.device_set)))
    return None


def update_router_bias(params, loads: dict[str, jax.Array], rate: float):
    """Aux-loss-free balancing: raise the selection bias of under-loaded experts, lower it for
    over-loaded ones. loads: {MoE layer stack: [L, E], "mtp": [E]} token counts (a stack as
    named by decoder.layer_stacks: "moe_layers", or a hybrid model's "layers_4_to_6")."""
    if rate == 0.0:
        return params
    params = dict(params)
    for name, load in loads.items():
        path = ("mtp", "layer", "moe") if name == "mtp" else (name, "moe")
        node = params
        parents = []
        for key in path:
            parents.append(node)
            node = node[key]
        load = load.astype(jnp.float32)
        bias = node["router_bias"] + rate * jnp.sign(load.mean(-1, keepdims=True) - load)
        updated = {**node, "router_bias": bias}
        for parent, key in zip(reversed(parents), reversed(path), strict=True):
            updated = {**parent, key: updated}
        params = updated
    return params


def _split_microbatches(batch: Batch, count: int) -> Batch:
    """[B, T] -> [count, B / count, T] for every field."""
    return jax.tree.map(lambda x: x.reshape((count, x.shape[0] // count) + x.shape[1:]), batch)


REPLICA_AXIS = "data"
SUMMED_METRICS = ("target_tokens", "dropped_tokens")  # counts; the other metrics are means


def _without_axis(rules, axis: str):
    """`rules` with mesh axis `axis` removed from every target (it becomes the vmapped replica axis)."""
    kept = []
    for name, target in rules:
        targets = mesh_axes(target)
        targets = tuple(t for t in targets if t != axis)
        kept.append((name, targets if len(targets) > 1 else (targets[0] if targets else None)))
    return tuple(kept)


def _per_replica_grad_fn(grad_fn, replicas: int, rules):
    """grad_fn(params, micro) -> same outputs, but grads [replicas, ...]: one per data replica.

    The microbatch's rows split into `replicas` contiguous groups (the `data` axis is the batch
    rule's outermost mesh axis, so each group lies on one replica's devices) and the gradient is
    vmapped over them with spmd_axis_name="data": no cross-replica sum happens inside. Metrics
    come back averaged over replicas (counts summed), expert loads summed."""
    inner_rules = _without_axis(rules, REPLICA_AXIS)

    def one(params, rows):
        with nn.logical_axis_rules(inner_rules):  # inside, `data` is the vmapped axis
            return grad_fn(params, rows)

    def replica_grads(params, micro: Batch):
        rows = jax.tree.map(lambda x: x.reshape((replicas, x.shape[0] // replicas) + x.shape[1:]), micro)
        (loss, (metrics, loads)), grads = jax.vmap(one, in_axes=(None, 0), spmd_axis_name=REPLICA_AXIS)(
            params, rows)
        metrics = {k: (v.sum(0) if k in SUMMED_METRICS else v.mean(0)) for k, v in metrics.items()}
        return (loss.mean(0), (metrics, jax.tree.map(lambda x: x.sum(0), loads))), grads

    return replica_grads


def _reduce_replicas(grads, dtype: str, stacked: bool):
    """Per-replica gradients [R, ...] (stacked) or one gradient -> their sum, added in `dtype`
    (under a mesh: the all-reduce over `data`), returned in float32. lax.reduce, not jnp.sum:
    jnp.sum would add bfloat16 in float32."""
    dtype = jnp.dtype(dtype)

    def reduce(g):
        g = g.astype(dtype)
        if stacked:
            g = jax.lax.reduce(g, jnp.zeros((), dtype), jax.lax.add, (0,))
        return g.astype(jnp.float32)

    return jax.tree.map(reduce, grads)


def train_state_shardings(config: ModelConfig, optimizer: optax.GradientTransformation, mesh,
                          rules=sharding.DEFAULT_RULES, *,
                          options: ExecutionOptions | None = None) -> TrainState:
    """Where every part of the train state lives on `mesh`: params by their logical axes,
    optimizer moments like their params, the step counter replicated."""
    params = sharding.param_shardings(param_logical_axes(config), mesh, rules)
    abstract = param_shapes(config, options=options)
    return TrainState(step=sharding.replicated(mesh), params=params,
                      opt_state=sharding.optimizer_state_shardings(optimizer, abstract, params, mesh))


def make_loss_fn(config: ModelConfig, settings: TrainSettings, options: ExecutionOptions | None = None):
    """loss_fn(params, batch) -> (loss, (metrics, expert loads)) for one (micro)batch."""
    options = options or ExecutionOptions()
    if options.dsa_stage != settings.dsa_stage:  # the model runs the stage's attention and sows the KL
        options = options.replace(dsa_stage=settings.dsa_stage)

    def loss_fn(params, micro: Batch):
        dpo, grpo = settings.objective == "dpo", settings.objective == "grpo"
        with_mtp = bool(config.num_mtp_layers) and not dpo and not (grpo and not settings.mtp_loss_weight)
        outputs = apply_model(config, params, micro["input_ids"], micro["positions"],
                              micro["segment_ids"], with_mtp=with_mtp,
                              collect_intermediates=True, options=options)
        if dpo:  # pairs against the frozen reference's log-probs, which travel in the batch
            loss, metrics = dpo_loss(outputs["logits"], micro, settings.dpo_beta)
            return loss, (metrics, expert_loads(outputs["intermediates"]))
        if grpo:  # rollouts: the engine's log-probs, advantages and token weights travel in the batch
            loss, metrics = grpo_loss(outputs, micro, settings.grpo, settings.mtp_loss_weight)
            return loss, (metrics, expert_loads(outputs["intermediates"]))
        loss, metrics = language_model_losses(
            outputs, micro["input_ids"], micro["segment_ids"],
            z_loss_weight=settings.z_loss_weight, mtp_loss_weight=settings.mtp_loss_weight,
            balance_loss_weight=settings.balance_loss_weight, loss_mask=micro.get("loss_mask"),
            indexer_kl_weight=settings.indexer_kl_weight)
        dropped = [value for _, value in sown_values(outputs["intermediates"], "dropped_tokens")]
        if dropped:
            metrics["dropped_tokens"] = sum(jnp.sum(d) for d in dropped).astype(jnp.float32)
        return loss, (metrics, expert_loads(outputs["intermediates"]))

    return loss_fn


def make_train_step(config: ModelConfig, settings: TrainSettings,
                    optimizer: optax.GradientTransformation, mesh=None, rules=sharding.DEFAULT_RULES, *,
                    options: ExecutionOptions | None = None):
    """Returns train_step(state, batch) -> (state, metrics), jitted (state donated).

    With a mesh: explicit in/out shardings (train_state_shardings, batch rows over the batch
    axes), traced with the mesh and rules in context so activation constraints and the
    expert-parallel MoE apply. The state must already be placed (`place_train_state`).
    options: ExecutionOptions (dtypes, remat, kernels, MoE dispatch; None = defaults).
    """

    loss_fn = make_loss_fn(config, settings, options)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    replicas, replica_spec = 1, None
    if settings.grad_reduce_dtype and mesh is not None and mesh.shape.get(REPLICA_AXIS, 1) > 1:
        replicas = mesh.shape[REPLICA_AXIS]
        replica_spec = _check_replicas(config, settings, mesh, rules, replicas, options or ExecutionOptions())
        grad_fn = _per_replica_grad_fn(grad_fn, replicas, rules)

    def train_step(state: TrainState, batch: Batch):
        micro = _split_microbatches(batch, settings.grad_accum_steps)

        def accumulate(totals, one):
            (_, (metrics, loads)), grads = grad_fn(state.params, one)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)  # accumulate in f32
            return jax.tree.map(jnp.add, totals, (grads, metrics, loads)), None

        first = jax.tree.map(lambda x: x[0], micro)
        if settings.grad_accum_steps == 1:  # no scan: one trace of the model instead of two
            (_, (metrics, loads)), grads = grad_fn(state.params, first)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        else:
            _, (metric_shapes, load_shapes) = jax.eval_shape(loss_fn, state.params, first)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (metric_shapes, load_shapes))
            if replica_spec is None:
                grad_zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            else:  # one replica's accumulator per device: [R, ...] split over `data`
                grad_zeros = jax.tree.map(
                    lambda p, spec: jax.lax.with_sharding_constraint(
                        jnp.zeros((replicas,) + p.shape, jnp.float32), spec), state.params, replica_spec)
            (grads, metrics, loads), _ = jax.lax.scan(accumulate, (grad_zeros, *zeros), micro)
        if settings.grad_reduce_dtype:
            grads = _reduce_replicas(grads, settings.grad_reduce_dtype, stacked=replicas > 1)
        scale = 1.0 / settings.grad_accum_steps
        grads = jax.tree.map(lambda g: g * (scale / replicas), grads)
        metrics = {k: (v if k == "target_tokens" else v * scale) for k, v in metrics.items()}

        grad_norm = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # The dense warm-up changes the indexer only, so no router bias update either.
        rate = 0.0 if settings.dsa_stage == "dense_warmup" else settings.router_bias_update_rate
        params = update_router_bias(params, loads, rate)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        new_state = TrainState(step=state.step + 1, params=keep(params, state.params),
                               opt_state=keep(opt_state, state.opt_state))
        metrics = {**metrics, "grad_norm": grad_norm, "finite": finite,
                   **{f"expert_load/{k}": v for k, v in loads.items()}}
        return new_state, metrics

    if mesh is None:
        return jax.jit(train_step, donate_argnums=0)
    state_sharding = train_state_shardings(config, optimizer, mesh, rules, options=options)
    jitted = jax.jit(train_step, donate_argnums=0,
                     in_shardings=(state_sharding, sharding.batch_sharding(mesh, rules)),
                     out_shardings=(state_sharding, sharding.replicated(mesh)))

    def sharded_step(state: TrainState, batch: Batch):
        with sharding.activate(mesh, rules):
            return jitted(state, batch)

    sharded_step.jitted = jitted  # for .trace/.lower (call inside sharding.activate)
    return sharded_step


def _check_replicas(config: ModelConfig, settings: TrainSettings, mesh, rules, replicas: int,
                    options: ExecutionOptions):
    """Raises ValueError when gradients cannot be split per `data` replica; returns the
    NamedShardings of the [R, ...] per-replica gradient accumulators."""
    kernels = [f"{field}=pallas" for field in ("attention_impl", "indexer_impl", "moe_impl")
               if getattr(options, field) == "pallas"]
    if mesh.shape.get("pipeline", 1) > 1 or kernels:
        raise ValueError("grad_reduce_dtype cannot vmap over data replicas with "
                         + (", ".join(kernels) or "pipeline > 1") + " (their shard_maps do not lower under "
                         "jax.vmap(spmd_axis_name='data')); leave it '' to let XLA reduce the gradients")
    rows = settings.batch_size // settings.grad_accum_steps
    if rows % replicas or (settings.objective == "dpo" and (rows // replicas) % 2):
        raise ValueError(f"grad_reduce_dtype: the {rows} rows of a microbatch do not split into {replicas} "
                         "data replicas" + (" of whole pairs" if settings.objective == "dpo" else ""))
    params = sharding.param_shardings(param_logical_axes(config), mesh, rules)
    specs = []
    for named in jax.tree.leaves(params):
        axes = {a for entry in named.spec for a in ((entry,) if isinstance(entry, str) else (entry or ()))}
        if REPLICA_AXIS in axes:
            raise ValueError(f"grad_reduce_dtype: a parameter is split over `{REPLICA_AXIS}` ({named.spec}); "
                             "the per-replica gradients need it whole on each replica")
        specs.append(NamedSharding(mesh, PartitionSpec(REPLICA_AXIS, *named.spec)))
    return jax.tree.unflatten(jax.tree.structure(params), specs)


def place_train_state(state: TrainState, config: ModelConfig, optimizer: optax.GradientTransformation,
                      mesh, rules=sharding.DEFAULT_RULES, *,
                      options: ExecutionOptions | None = None) -> TrainState:
    """Moves a (host or single-device) train state onto `mesh` with its shardings."""
    return jax.device_put(state, train_state_shardings(config, optimizer, mesh, rules, options=options))


def make_eval_step(config: ModelConfig, token_bytes: jax.Array, options: ExecutionOptions | None = None):
    """Returns eval_step(params, batch) -> {"nats", "tokens", "bytes"} sums (jitted).

    token_bytes: [vocab] UTF-8 bytes per token id, for bits per byte.
    """

    @jax.jit
    def eval_step(params, batch: Batch):
        logits = apply_model(config, params, batch["input_ids"], batch["positions"],
                             batch["segment_ids"], options=options)["logits"]
        targets, weights = shifted_targets(batch["input_ids"], batch["segment_ids"], 1,
                                           batch.get("loss_mask"))
        nats, _ = token_cross_entropy(logits[:, :-1], targets)
        return {"nats": jnp.sum(nats * weights), "tokens": jnp.sum(weights),
                "bytes": jnp.sum(token_bytes[targets] * weights)}

    return eval_step
