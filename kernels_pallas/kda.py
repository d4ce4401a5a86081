"""Chunked Kimi Delta Attention (KDA: the gated delta rule with a per-channel forget gate) in
Pallas, forward and backward, for training and prefill.

Per (batch, head), with state S [H, P] and for each position t (q already scaled by H^-1/2 and
q, k L2-normalised by the caller, as glm5_jax/model/kda.py prepares them):

    S <- 0 where starts[t] (a packed document begins at t), then S <- diag(exp(g_t)) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T ;   o_t = S^T q_t

Chunked form, per chunk of C positions (G: g cumulated from the chunk's start; a document
index per position counts the starts in the chunk up to it, 0 = the document the entering
state belongs to; `carry` = index 0, `in_last` = the last position's document):

    D[i, j, h] = exp(G_ih - G_jh) for j <= i in one document, else 0
    A[i, j]    = -beta_i sum_h k_ih k_jh D[i, j, h] (j < i),   T = (I - A)^-1
    W  = T (beta v - (beta k e^G carry) S)       each position's write, the state's part removed
    O  = (q e^G carry) S + Sc W,                 Sc[i, j] = sum_h q_ih k_jh D[i, j, h] (j <= i)
    S' = diag(e^G_last carry_last) S + (k e^(G_last - G) in_last)^T W

Exactness over speed inside a chunk: D is never split as e^G_i e^-G_j (e^-G overflows float32
once a chunk's decay passes ~e^-88, as an unbounded softplus gate can); Sc and A are built one
key column j at a time from exact exponents G_i - G_j <= 0 (C [C, H] exps per chunk), so small
chunks (16) are the default. T = (I + A)(I + A^2)(I + A^4)... (A is nilpotent): matmuls only,
no inverse or substitution in the kernel. Everything is float32; dots use Precision.HIGHEST.

Kernel layout: heads first ([B, N, T, width], time padded to whole chunks, the state carried
transposed, [P, H], so the decay scales rows by a [1, H] row). On Triton and in the interpreter
a program owns one (batch, head, value block) and loops over chunks (whole-sequence slabs read
a chunk at a time); on Mosaic the chunks are the grid's last, sequential axis (blocks pipelined
into VMEM) and the state lives in VMEM scratch. Value blocks split P (the key side, A and T, is
recomputed per block); their partial dq, dk, dg, dbeta are summed outside.

Backward (custom_vjp, all Pallas): the forward saves the state entering every chunk
([B, N, T/C, P, H] float32); a kernel walks the chunks in reverse carrying dS, recomputes a
chunk's A, T, Sc and W, and writes dq, dk, dv, dG, dbeta; dg is dG's reverse cumulative sum
within each chunk (jnp). Gradients reach query, key, value, g, beta and the initial state.

Einsum letters as in glm5_jax/model/kda.py: B batch, T positions, N heads, H key/query head dim,
P value head dim, U chunks, C a chunk's positions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.common import KernelCase, call_options, resolve_backend
from kernels_pallas.flash_attention import dot_nn, dot_nt, triton_dim


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """chunk: positions per chunk (Triton: a power of two >= 16; else a multiple of 8).
    block_value: value channels per program (None: all; Mosaic: a multiple of 128 or all)."""

    chunk: int
    block_value: int | None


DEFAULT_BLOCK_SIZES = {  # untuned: no GPU/TPU has timed them yet
    "interpret": BlockSizes(16, None),
    "triton": BlockSizes(16, 64),  # a [64, 128] float32 state per program: half the registers of [128, 128]
    "mosaic_tpu": BlockSizes(32, None),
}


def dot_tn(a, b):
    """a [k, m]^T . b [k, n] -> float32 [m, n]."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- one chunk


def _iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _chunk_tiles(refs, base, doc_row, chunk):
    """A chunk's operands from refs (q, k, v, G, beta, doc column) at rows [base, base + C)."""
    q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref = refs
    rows = lambda ref: ref[pl.ds(base, chunk), :]  # noqa: E731
    last = lambda ref: ref[pl.ds(base + chunk - 1, 1), :]  # noqa: E731
    doc, doc_last = rows(doc_ref), last(doc_ref)  # [C, 1], [1, 1]
    return dict(q=rows(q_ref), k=rows(k_ref), v=rows(v_ref), g=rows(g_ref), beta=rows(beta_ref),
                g_last=last(g_ref),  # [1, H]
                same=doc == doc_row,  # [C, C]: positions i, j in one document
                carry=(doc == 0).astype(jnp.float32),  # [C, 1]: reached by the entering state
                carry_last=(doc_last == 0).astype(jnp.float32),  # [1, 1]
                in_last=(doc == doc_last).astype(jnp.float32),  # [C, 1]: in the last position's document
                key_row=lambda j: (k_ref[pl.ds(base + j, 1), :], g_ref[pl.ds(base + j, 1), :]))


def _decay_column(t, j):
    """D[:, j, :] [C, H] (rows i < j hold 1, masked by the caller): exact, exponents <= 0."""
    k_j, g_j = t["key_row"](j)
    rows = _iota(t["g"].shape, 0)
    return jnp.exp(jnp.where(rows >= j, t["g"] - g_j, 0.0)), k_j


def _pair_scores(t):
    """(Sc [C, C] = q.D.k for j <= i, K [C, C] = k.D.k for j < i), within documents."""
    chunk = t["q"].shape[0]
    cols = _iota((chunk, chunk), 1)

    def body(j, carry):
        qk, kk = carry
        decay, k_j = _decay_column(t, j)
        weighted = decay * k_j  # [C, H]
        qk = jnp.where(cols == j, jnp.sum(t["q"] * weighted, axis=1, keepdims=True), qk)
        kk = jnp.where(cols == j, jnp.sum(t["k"] * weighted, axis=1, keepdims=True), kk)
        return qk, kk

    zeros = jnp.zeros((chunk, chunk), jnp.float32)
    qk, kk = jax.lax.fori_loop(0, chunk, body, (zeros, zeros))
    rows = _iota((chunk, chunk), 0)
    lower = (rows >= cols) & t["same"]
    return jnp.where(lower, qk, 0.0), jnp.where(lower & (rows > cols), kk, 0.0)


def _unit_lower_inverse(a):
    """(I - a)^-1 for strictly lower triangular a [C, C]: (I + a)(I + a^2)(I + a^4)... (a^C = 0)."""
    chunk = a.shape[0]
    inverse = jnp.where(_iota(a.shape, 0) == _iota(a.shape, 1), 1.0, 0.0) + a
    power, span = a, 2
    while span < chunk:
        power = dot_nn(power, power)
        inverse = inverse + dot_nn(inverse, power)
        span *= 2
    return inverse


def _chunk_common(t, state_t):
    """What both directions compute for a chunk given the entering state^T [Pb, H]."""
    qk, kk = _pair_scores(t)
    beta = t["beta"]
    solve = _unit_lower_inverse(-beta * kk)  # T = (I - A)^-1
    decay_in = jnp.exp(t["g"]) * t["carry"]  # [C, H]: the entering state's decay to each row
    keys_in = beta * t["k"] * decay_in
    written = dot_nn(solve, beta * t["v"] - dot_nt(keys_in, state_t))  # W [C, Pb]
    decay_out = jnp.exp(t["g_last"] - t["g"]) * t["in_last"]  # [C, H]: each row's decay to the end
    keep = jnp.exp(t["g_last"]) * t["carry_last"]  # [1, H]: the entering state's decay to the end
    return dict(qk=qk, kk=kk, solve=solve, decay_in=decay_in, keys_in=keys_in, written=written,
                decay_out=decay_out, keep=keep)


def _chunk_forward(t, state_t):
    """-> (out [C, Pb], state^T after the chunk [Pb, H])."""
    c = _chunk_common(t, state_t)
    out = dot_nt(t["q"] * c["decay_in"], state_t) + dot_nn(c["qk"], c["written"])
    state_t = state_t * c["keep"] + dot_tn(c["written"], t["k"] * c["decay_out"])
    return out, state_t


def _pair_scores_backward(t, d_qk, d_kk):
    """dq, dk, dG [C, H] through Sc and K, one key column j at a time (as _pair_scores)."""
    chunk = t["q"].shape[0]
    cols = _iota((chunk, chunk), 1)
    rows = _iota(t["q"].shape, 0)

    def body(j, carry):
        dq, dk, dg = carry
        decay, k_j = _decay_column(t, j)
        a = jnp.sum(jnp.where(cols == j, d_qk, 0.0), axis=1, keepdims=True)  # [C, 1]: dSc[:, j]
        b = jnp.sum(jnp.where(cols == j, d_kk, 0.0), axis=1, keepdims=True)  # dK[:, j]
        mixed = (a * t["q"] + b * t["k"]) * decay  # [C, H]
        term = mixed * k_j  # d score / d G_i per row i (and minus it for G_j)
        weighted = decay * k_j
        dq = dq + a * weighted
        dk = dk + b * weighted + jnp.where(rows == j, jnp.sum(mixed, axis=0, keepdims=True), 0.0)
        dg = dg + term - jnp.where(rows == j, jnp.sum(term, axis=0, keepdims=True), 0.0)
        return dq, dk, dg

    zeros = jnp.zeros(t["q"].shape, jnp.float32)
    return jax.lax.fori_loop(0, chunk, body, (zeros, zeros, zeros))


def _chunk_backward(t, state_t, d_out, d_state_t):
    """Adjoint of _chunk_forward. -> dict of dq, dk, dg (d G), dv, dbeta, d_state (before the chunk)."""
    c = _chunk_common(t, state_t)
    chunk = t["q"].shape[0]
    rows, cols = _iota((chunk, chunk), 0), _iota((chunk, chunk), 1)
    beta, written, q_in = t["beta"], c["written"], t["q"] * c["decay_in"]
    keys_out = t["k"] * c["decay_out"]
    d_q_in = dot_nn(d_out, state_t)  # [C, H]
    d_keys_out = dot_nn(written, d_state_t)  # [C, H]
    d_written = dot_tn(c["qk"], d_out) + dot_nt(keys_out, d_state_t)  # [C, Pb]
    d_qk = jnp.where((rows >= cols) & t["same"], dot_nt(d_out, written), 0.0)
    d_rhs = dot_tn(c["solve"], d_written)  # T^T dW: d(beta v - keys_in S)
    d_a = jnp.where((rows > cols) & t["same"], dot_nt(d_rhs, written), 0.0)  # dA = T^T dW W^T
    d_keys_in = -dot_nn(d_rhs, state_t)
    dq, dk, dg = _pair_scores_backward(t, d_qk, -beta * d_a)
    dq = dq + d_q_in * c["decay_in"]
    dk = dk + d_keys_in * beta * c["decay_in"] + d_keys_out * c["decay_out"]
    dg = dg + d_keys_in * c["keys_in"] + d_q_in * q_in - d_keys_out * keys_out
    d_keep = jnp.sum(state_t * d_state_t, axis=0, keepdims=True)  # [1, H]
    last_row = jnp.sum(d_keys_out * keys_out, axis=0, keepdims=True) + d_keep * c["keep"]
    dg = dg + jnp.where(_iota(dg.shape, 0) == chunk - 1, last_row, 0.0)
    d_beta = (jnp.sum(t["v"] * d_rhs, axis=1, keepdims=True)
              + jnp.sum(d_keys_in * t["k"] * c["decay_in"], axis=1, keepdims=True)
              - jnp.sum(d_a * c["kk"], axis=1, keepdims=True))
    d_state = d_state_t * c["keep"] + dot_tn(d_out, q_in) - dot_tn(d_rhs, c["keys_in"])
    return dict(dq=dq, dk=dk, dg=dg, dv=beta * d_rhs, dbeta=d_beta, d_state=d_state)


# ----------------------------------------------------------------------------- kernels
# Triton / interpreter ("slab"): grid (B, N, value blocks); refs hold a program's whole sequence.
# Mosaic ("grid"): grid (B, N, value blocks, chunks); refs hold one chunk, the state in scratch.


def _forward_slab_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, doc_row_ref, state_ref,
                         out_ref, final_ref, *states_ref, chunk, num_chunks, block_value):
    inputs = (q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref)

    def step(u, state_t):
        base = pl.multiple_of(u * chunk, chunk)
        if states_ref:
            states_ref[0][pl.ds(u * block_value, block_value), :] = state_t
        out, state_t = _chunk_forward(_chunk_tiles(inputs, base, doc_row_ref[pl.ds(u, 1), :], chunk), state_t)
        out_ref[pl.ds(base, chunk), :] = out
        return state_t

    final_ref[...] = jax.lax.fori_loop(0, num_chunks, step, state_ref[...])


def _forward_grid_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, doc_row_ref, state_ref,
                         out_ref, final_ref, *rest, chunk, num_chunks):
    *states_ref, scratch = rest
    u = pl.program_id(3)

    @pl.when(u == 0)
    def _():
        scratch[...] = state_ref[...]

    state_t = scratch[...]
    if states_ref:
        states_ref[0][...] = state_t
    tiles = _chunk_tiles((q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref), 0, doc_row_ref[...], chunk)
    out, state_t = _chunk_forward(tiles, state_t)
    out_ref[...] = out
    scratch[...] = state_t

    @pl.when(u == num_chunks - 1)
    def _():
        final_ref[...] = state_t


def _write_grads(refs, grads, rows):
    for name, ref in zip(("dq", "dk", "dg", "dbeta", "dv"), refs, strict=True):
        ref[rows] = grads[name]


def _backward_slab_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, doc_row_ref, states_ref,
                          d_out_ref, d_final_ref, *outputs, chunk, num_chunks, block_value):
    *grad_refs, d_state_ref = outputs
    inputs = (q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref)

    def step(i, d_state_t):
        u = num_chunks - 1 - i
        base = pl.multiple_of(u * chunk, chunk)
        state_t = states_ref[pl.ds(u * block_value, block_value), :]
        tiles = _chunk_tiles(inputs, base, doc_row_ref[pl.ds(u, 1), :], chunk)
        grads = _chunk_backward(tiles, state_t, d_out_ref[pl.ds(base, chunk), :], d_state_t)
        _write_grads(grad_refs, grads, pl.ds(base, chunk))
        return grads["d_state"]

    d_state_ref[...] = jax.lax.fori_loop(0, num_chunks, step, d_final_ref[...])


def _backward_grid_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, doc_row_ref, states_ref,
                          d_out_ref, d_final_ref, *outputs, chunk, num_chunks):
    *grad_refs, d_state_ref, scratch = outputs
    step = pl.program_id(3)  # chunk num_chunks - 1 - step (the index maps reverse the order)

    @pl.when(step == 0)
    def _():
        scratch[...] = d_final_ref[...]

    tiles = _chunk_tiles((q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref), 0, doc_row_ref[...], chunk)
    grads = _chunk_backward(tiles, states_ref[...], d_out_ref[...], scratch[...])
    _write_grads(grad_refs, grads, slice(None))
    scratch[...] = grads["d_state"]

    @pl.when(step == num_chunks - 1)
    def _():
        d_state_ref[...] = grads["d_state"]


# ----------------------------------------------------------------------------- calls


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts of one call."""

    backend: str
    chunk: int
    block_value: int
    head_pad: int  # H, padded for Triton
    value_pad: int  # P, padded for Triton (a multiple of block_value)


def _specs(plan: _Plan, num_chunks: int, reverse: bool):
    """BlockSpec makers by operand kind: time(width, by_value) for [B, N, Tp, width]; parts(width)
    for [value blocks, B, N, Tp, width] gradient parts; state() for [B, N, Pp, Hp]; states() for
    [B, N, value blocks, U * Pb, Hp]; doc() for the document index [B, Tp, 1]; doc_row() for it as
    rows ([B, U, C] slab, [B, U, 1, C] chunks). Slab: grid (B, N, p), one program's whole
    sequence; Mosaic: grid (B, N, p, u), chunk u (reversed for the backward)."""
    chunk, pb, hp = plan.chunk, plan.block_value, plan.head_pad
    spec = pl.BlockSpec
    if plan.backend == "mosaic_tpu":
        at = (lambda u: num_chunks - 1 - u) if reverse else (lambda u: u)  # noqa: E731
        return dict(
            time=lambda w, by_value=False: spec((None, None, chunk, w),
                                                lambda b, n, p, u: (b, n, at(u), p if by_value else 0)),
            parts=lambda w: spec((None, None, None, chunk, w), lambda b, n, p, u: (p, b, n, at(u), 0)),
            state=lambda: spec((None, None, pb, hp), lambda b, n, p, u: (b, n, p, 0)),
            states=lambda: spec((None, None, None, pb, hp), lambda b, n, p, u: (b, n, p, at(u), 0)),
            doc=lambda: spec((None, chunk, 1), lambda b, n, p, u: (b, at(u), 0)),
            doc_row=lambda: spec((None, None, 1, chunk), lambda b, n, p, u: (b, at(u), 0, 0)))
    length = num_chunks * chunk
    return dict(
        time=lambda w, by_value=False: spec((None, None, length, w),
                                            lambda b, n, p: (b, n, 0, p if by_value else 0)),
        parts=lambda w: spec((None, None, None, length, w), lambda b, n, p: (p, b, n, 0, 0)),
        state=lambda: spec((None, None, pb, hp), lambda b, n, p: (b, n, p, 0)),
        states=lambda: spec((None, None, None, num_chunks * pb, hp), lambda b, n, p: (b, n, p, 0, 0)),
        doc=lambda: spec((None, length, 1), lambda b, n, p: (b, 0, 0)),
        doc_row=lambda: spec((None, num_chunks, chunk), lambda b, n, p: (b, 0, 0)))


def _prepare(plan: _Plan, query, key, value, g, beta, state, starts):
    """Pads and lays out the inputs -> dict of kernel operands (state transposed, [B, N, Pp, Hp])."""
    batch, length, _, _ = query.shape
    chunk = plan.chunk
    num_chunks = -(-length // chunk)
    t_pad = num_chunks * chunk

    def heads_first(x, width):  # [B, T, N, w] -> [B, N, Tp, width], zero padded
        pad = ((0, 0), (0, t_pad - length), (0, 0), (0, width - x.shape[3]))
        return jnp.pad(x, pad).transpose(0, 2, 1, 3)

    g = heads_first(g, plan.head_pad)
    g = jnp.cumsum(g.reshape(g.shape[:2] + (num_chunks, chunk, -1)), axis=3).reshape(g.shape)
    doc = jnp.cumsum(jnp.pad(starts, ((0, 0), (0, t_pad - length))).reshape(batch, num_chunks, chunk),
                     axis=-1).astype(jnp.float32)  # [B, U, C]: starts so far in the chunk
    doc_row = doc[:, :, None, :] if plan.backend == "mosaic_tpu" else doc
    return {"inputs": (heads_first(query, plan.head_pad), heads_first(key, plan.head_pad),
                       heads_first(value, plan.value_pad), g, heads_first(beta[..., None], 1),
                       doc.reshape(batch, t_pad, 1), doc_row),
            "state_t": _transposed_state(plan, state), "num_chunks": num_chunks}


def _transposed_state(plan: _Plan, state):
    """[B, N, H, P] -> [B, N, Pp, Hp] zero padded."""
    pad = ((0, 0), (0, 0), (0, plan.value_pad - state.shape[3]), (0, plan.head_pad - state.shape[2]))
    return jnp.pad(state.transpose(0, 1, 3, 2), pad)


def _call(plan: _Plan, ops, kernels, extra_in, out, name, reverse=False):
    """pallas_call of kernels = (slab kernel, grid kernel) on ops' inputs + extra_in (arrays and
    spec kinds), out = [(ShapeDtypeStruct, spec kind)]; Mosaic carries the state in [Pb, Hp] scratch."""
    num_chunks = ops["num_chunks"]
    batch, heads = ops["state_t"].shape[:2]
    specs = _specs(plan, num_chunks, reverse)
    grid = (batch, heads, plan.value_pad // plan.block_value)
    hp, pb = plan.head_pad, plan.block_value
    in_specs = [specs["time"](hp), specs["time"](hp), specs["time"](pb, True), specs["time"](hp),
                specs["time"](1), specs["doc"](), specs["doc_row"]()]
    in_specs += [specs[kind](*args) for _, (kind, *args) in extra_in]
    out_specs = [specs[kind](*args) for _, (kind, *args) in out]
    if plan.backend == "mosaic_tpu":
        kernel = functools.partial(kernels[1], chunk=plan.chunk, num_chunks=num_chunks)
        grid += (num_chunks,)
        options = call_options(plan.backend, dimension_semantics=("parallel",) * 3 + ("arbitrary",))
        scratch = [pltpu.VMEM((pb, hp), jnp.float32)]
    else:
        kernel = functools.partial(kernels[0], chunk=plan.chunk, num_chunks=num_chunks, block_value=pb)
        options, scratch = call_options(plan.backend, num_warps=4, num_stages=1), []
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=[shape for shape, _ in out], scratch_shapes=scratch, name=name,
                          **options)(*ops["inputs"], *(array for array, _ in extra_in))


def _forward(plan: _Plan, ops, save_states: bool):
    """-> [out [B, N, Tp, Pp], final state^T [B, N, Pp, Hp], (chunk states^T, if saved)]."""
    batch, heads, t_pad, _ = ops["inputs"][0].shape
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    out = [(f32(batch, heads, t_pad, plan.value_pad), ("time", plan.block_value, True)),
           (f32(*ops["state_t"].shape), ("state",))]
    if save_states:
        blocks, rows = plan.value_pad // plan.block_value, ops["num_chunks"] * plan.block_value
        out.append((f32(batch, heads, blocks, rows, plan.head_pad), ("states",)))
    return _call(plan, ops, (_forward_slab_kernel, _forward_grid_kernel), [(ops["state_t"], ("state",))],
                 out, "kda_forward")


def _backward(plan: _Plan, ops, states, d_out, d_final_t):
    """-> [dq, dk, dG partial sums [value blocks, B, N, Tp, Hp], dbeta parts [.., 1],
    dv [B, N, Tp, Pp], d initial state^T [B, N, Pp, Hp]]."""
    batch, heads, t_pad, _ = ops["inputs"][0].shape
    hp, pb = plan.head_pad, plan.block_value
    parts = lambda w: (jax.ShapeDtypeStruct((plan.value_pad // pb, batch, heads, t_pad, w), jnp.float32),  # noqa: E731
                       ("parts", w))
    out = [parts(hp), parts(hp), parts(hp), parts(1),
           (jax.ShapeDtypeStruct(d_out.shape, jnp.float32), ("time", pb, True)),
           (jax.ShapeDtypeStruct(d_final_t.shape, jnp.float32), ("state",))]
    extra = [(states, ("states",)), (d_out, ("time", pb, True)), (d_final_t, ("state",))]
    return _call(plan, ops, (_backward_slab_kernel, _backward_grid_kernel), extra, out, "kda_backward",
                 reverse=True)


# ----------------------------------------------------------------------------- custom_vjp


def _time_major(x, length, width):
    """[B, N, Tp, Wp] -> [B, length, N, width]."""
    return x[:, :, :length, :width].transpose(0, 2, 1, 3)


def _results(query, value, out, final_t):
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    return (_time_major(out, query.shape[1], value_dim),
            final_t[:, :, :value_dim, :head_dim].transpose(0, 1, 3, 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(plan, query, key, value, g, beta, state, starts):
    out, final_t = _forward(plan, _prepare(plan, query, key, value, g, beta, state, starts), False)
    return _results(query, value, out, final_t)


def _kda_fwd(plan, query, key, value, g, beta, state, starts):
    out, final_t, states = _forward(plan, _prepare(plan, query, key, value, g, beta, state, starts), True)
    return _results(query, value, out, final_t), (query, key, value, g, beta, state, starts, states)


def _kda_bwd(plan, residuals, cotangents):
    query, key, value, g, beta, state, starts, states = residuals
    d_out, d_final = cotangents
    ops = _prepare(plan, query, key, value, g, beta, state, starts)
    t_pad = ops["num_chunks"] * plan.chunk
    d_out = jnp.pad(d_out, ((0, 0), (0, t_pad - d_out.shape[1]), (0, 0),
                            (0, plan.value_pad - d_out.shape[-1]))).transpose(0, 2, 1, 3)
    d_final_t = _transposed_state(plan, d_final)
    dq, dk, d_cum, d_beta, dv, d_state_t = _backward(plan, ops, states, d_out, d_final_t)
    dq, dk, d_cum, d_beta = (x.sum(0) for x in (dq, dk, d_cum, d_beta))
    # G = cumsum(g) within each chunk, so dg = the reverse cumulative sum of dG within each chunk.
    chunked = d_cum.reshape(d_cum.shape[:2] + (ops["num_chunks"], plan.chunk, -1))
    dg = jnp.flip(jnp.cumsum(jnp.flip(chunked, 3), axis=3), 3).reshape(d_cum.shape)
    length, head_dim = query.shape[1], query.shape[-1]
    return (_time_major(dq, length, head_dim), _time_major(dk, length, head_dim),
            _time_major(dv, length, value.shape[-1]), _time_major(dg, length, head_dim),
            _time_major(d_beta, length, 1)[..., 0],
            d_state_t[:, :, :value.shape[-1], :head_dim].transpose(0, 1, 3, 2), None)


_kda.defvjp(_kda_fwd, _kda_bwd)


# ----------------------------------------------------------------------------- public API


def _check_inputs(query, key, value, g, beta, initial_state, starts):
    if query.ndim != 4 or value.ndim != 4:
        raise ValueError(f"query, value must be [B, T, N, H], [B, T, N, P]; got {query.shape}, {value.shape}")
    batch, length, heads, head_dim = query.shape
    for name, array in (("key", key), ("g", g)):
        if array.shape != query.shape:
            raise ValueError(f"{name} {array.shape} must be [B, T, N, H] = {query.shape}")
    if value.shape[:3] != query.shape[:3]:
        raise ValueError(f"value {value.shape} must be [B, T, N] = {query.shape[:3]} + [P]")
    if beta.shape != query.shape[:3]:
        raise ValueError(f"beta {beta.shape} must be [B, T, N] = {query.shape[:3]}")
    for name, array in (("query", query), ("key", key), ("value", value), ("g", g), ("beta", beta)):
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {array.dtype}")
    state_shape = (batch, heads, head_dim, value.shape[-1])
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state {initial_state.shape} must be [B, N, H, P] = {state_shape}")
    if starts is not None and (starts.shape != (batch, length) or starts.dtype != jnp.bool_):
        raise ValueError(f"starts must be bool [B, T] = {(batch, length)}, got {starts.dtype} {starts.shape}")


def _choose_plan(backend: str, chunk_size, block_value, head_dim: int, value_dim: int) -> _Plan:
    default = DEFAULT_BLOCK_SIZES[backend]
    chunk = default.chunk if chunk_size is None else chunk_size
    if backend == "triton" and (chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"chunk_size {chunk} must be a power of two >= 16 on triton")
    if backend != "triton" and (chunk <= 0 or chunk % 8):
        raise ValueError(f"chunk_size {chunk} must be a positive multiple of 8 on {backend}")
    pad = triton_dim if backend == "triton" else (lambda d: d)  # Triton loads power-of-two widths
    head_pad, value_pad = pad(head_dim), pad(value_dim)
    block = block_value or default.block_value or value_pad
    block = min(block, value_pad)
    if value_pad % block or (backend == "triton" and block < 16) or (
            backend == "mosaic_tpu" and block != value_pad and block % 128):
        raise ValueError(f"block_value {block} must divide the value dim {value_pad} (triton: >= 16; "
                         "mosaic_tpu: a multiple of 128 or all of it)")
    return _Plan(backend, chunk, block, head_pad, value_pad)


def kda(query, key, value, g, beta, initial_state=None, starts=None, *, chunk_size: int | None = None,
        block_value: int | None = None, backend: str | None = None):
    """Chunked KDA on prepared inputs (q scaled by H^-1/2, q and k L2-normalised if the model
    does so). query, key: [B, T, N, H]; value: [B, T, N, P]; g: [B, T, N, H] log decay (<= 0);
    beta: [B, T, N]; initial_state: [B, N, H, P] or None (zeros); starts: bool [B, T] or None (a
    document begins at t: the state is zeroed before t's decay). All computed in float32.
    Returns (out [B, T, N, P] in query's dtype, final state [B, N, H, P] float32);
    differentiable in query, key, value, g, beta and initial_state."""
    _check_inputs(query, key, value, g, beta, initial_state, starts)
    backend = resolve_backend(backend)
    plan = _choose_plan(backend, chunk_size, block_value, query.shape[-1], value.shape[-1])
    batch, length, heads, head_dim = query.shape
    if initial_state is None:
        initial_state = jnp.zeros((batch, heads, head_dim, value.shape[-1]), jnp.float32)
    if starts is None:
        starts = jnp.zeros((batch, length), bool)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    out, state = _kda(plan, f32(query), f32(key), f32(value), f32(g), f32(beta), f32(initial_state), starts)
    return out.astype(query.dtype), state


def kda_reference(query, key, value, g, beta, initial_state=None, starts=None, *,
                  chunk_size: int | None = None, block_value: int | None = None, backend: str | None = None):
    """The recurrence, position by position in a lax.scan (same signature and results as `kda`;
    chunk_size, block_value and backend are ignored)."""
    del chunk_size, block_value, backend
    _check_inputs(query, key, value, g, beta, initial_state, starts)
    batch, length, heads, head_dim = query.shape
    state = (jnp.zeros((batch, heads, head_dim, value.shape[-1]), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))
    starts = jnp.zeros((batch, length), bool) if starts is None else starts

    def step(state, inputs):
        q, k, v, decay, rate, start = inputs  # [B, N, H] x2, [B, N, P], [B, N, H], [B, N], [B]
        state = jnp.where(start[:, None, None, None], 0.0, state) * jnp.exp(decay)[..., None]
        remembered = jnp.einsum("BNHP,BNH->BNP", state, k, precision="highest")
        state = state + jnp.einsum("BNH,BNP->BNHP", k, (v - remembered) * rate[..., None])
        return state, jnp.einsum("BNHP,BNH->BNP", state, q, precision="highest")

    inputs = [jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (query, key, value, g, beta)]
    state, out = jax.lax.scan(step, state, (*inputs, jnp.moveaxis(starts, 1, 0)))
    return jnp.moveaxis(out, 0, 1).astype(query.dtype), state


# ----------------------------------------------------------------------------- benchmarks


def _kda_problem(key, *, batch, length, heads, head_dim, packed):
    """Prepared inputs as the model makes them: q, k L2-normalised (q scaled), g in (-5, 0) as
    GLM-5.3-Flash's bounded gate, beta a sigmoid; documents of 1024 positions when packed."""
    kq, kk, kv, kg, kb = jax.random.split(key, 5)
    shape = (batch, length, heads, head_dim)
    unit = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)  # noqa: E731
    query = unit(jax.random.normal(kq, shape)) * head_dim ** -0.5
    keys = unit(jax.random.normal(kk, shape))
    value = jax.random.normal(kv, shape)
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(kg, shape) - 4.0)
    beta = jax.nn.sigmoid(jax.random.normal(kb, shape[:3]))
    starts = jnp.broadcast_to(jnp.arange(length) % 1024 == 0, (batch, length)) if packed else None
    return query, keys, value, g, beta, None, starts


def _with_gradients(fn):
    """(inputs) -> gradients of sum(out) + sum(final state) in q, k, v, g, beta."""
    def run(query, key, value, g, beta, state, starts):
        def loss(*args):
            out, final = fn(*args, state, starts)
            return out.sum() + final.sum()
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(query, key, value, g, beta)
    return run


def benchmark_cases(small: bool = False) -> list[KernelCase]:
    """GLM-5.3-Flash-shaped KDA (N = 64 linear heads, H = P = 128, float32) at T = 4096 against
    `kda_reference`, the jnp recurrence (a lax.scan over positions: the model's chunked jnp form
    lives in glm5_jax, which kernels do not import): forward, forward + backward, and forward
    with packed documents. FLOPs count the chunked form per position (matmuls 6 H P + 4 C P, the
    pair scores 4 C H); the backward as 2.5x the forward. small: tiny shapes for the interpreter."""
    if small:
        problems = [("kda small", 1, 40, 2, 16, False), ("kda small packed", 1, 40, 2, 16, True)]
    else:
        problems = [("kda N=64", 1, 4096, 64, 128, False), ("kda N=64 packed", 1, 4096, 64, 128, True)]
    chunk = DEFAULT_BLOCK_SIZES["triton"].chunk
    cases = []
    for name, batch, length, heads, head_dim, packed in problems:
        make = functools.partial(_kda_problem, batch=batch, length=length, heads=heads, head_dim=head_dim,
                                 packed=packed)
        flops = batch * heads * length * (6.0 * head_dim * head_dim + 8.0 * chunk * head_dim)
        bytes_moved = 4.0 * batch * length * heads * (4 * head_dim + 1)
        label = f"{name} B={batch} T={length} H=P={head_dim}"
        cases.append(KernelCase(label + " fwd", make, kda_reference, kda, flops, bytes_moved,
                                atol=1e-3, rtol=1e-3))
        if not packed:
            cases.append(KernelCase(label + " fwd+bwd", make, _with_gradients(kda_reference),
                                    _with_gradients(kda), 3.5 * flops, 3 * bytes_moved, atol=1e-2, rtol=1e-2))
    return cases
