"""DSA attention on CPU: gathered top-k (XLA) against the dense-mask formulation, side by side.

    python bench/dsa_cpu.py                      (S=4096, k=256, 16 heads, latent 256 + rope 64)
    python bench/dsa_cpu.py --length 1024 --repeats 2

Both run the absorbed-MLA (MQA-like) attention of a DSA layer: every head attends over the shared
latent rows (values = the latent). "dense" is what the HF reference and MaxText do: [T, S] logits
for every head, masked to causal & selected keys, softmax over all S. "gathered" is
kernels_pallas.sparse_attention.sparse_attention_reference: gather each query's k rows, softmax
over k. Same inputs and selection; prints the max difference and a Markdown table of median times.
"""

import argparse
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# ----------------------------------------------------------------------------- formulations


def dense_masked_attention(q_latent, q_rope, latent, k_rope, indices, positions, scale):
    """[B, T, S] mask from the selection (causal & selected), full [B, N, T, S] logits."""
    selected = jnp.zeros(indices.shape[:2] + (latent.shape[1],), bool)
    selected = jnp.put_along_axis(selected, indices, True, axis=-1, inplace=False)
    allowed = selected & (positions[:, :, None] >= positions[:, None, :])
    logits = (jnp.einsum("BTNR,BSR->BNTS", q_latent, latent)
              + jnp.einsum("BTNH,BSH->BNTS", q_rope, k_rope)) * scale
    logits = jnp.where(allowed[:, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("BNTS,BSR->BTNR", probs, latent)


def gathered_attention(q_latent, q_rope, latent, k_rope, indices, positions, scale):
    from kernels_pallas.sparse_attention import sparse_attention_reference

    segments = jnp.zeros_like(positions)
    return sparse_attention_reference(q_latent, q_rope, latent, k_rope, indices, positions, positions,
                                      segments, segments, scale=scale)


# ----------------------------------------------------------------------------- inputs


def make_inputs(length, heads, rank, rope_dim, topk, seed=0):
    """Random inputs and a causal top-k selection (k distinct keys at or before each query, the
    query itself always included; early queries have fewer than k keys and repeat themselves as
    masked fill, as select_topk does)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q_latent, q_rope = normal(1, length, heads, rank), normal(1, length, heads, rope_dim)
    latent, k_rope = normal(1, length, rank), normal(1, length, rope_dim)
    rows = []
    for t in range(length):
        earlier = rng.permutation(t)[:topk - 1]
        fill = np.arange(t + 1, t + 1 + topk - 1 - len(earlier)) % length  # future keys: masked
        rows.append(np.concatenate([[t], earlier, fill]))
    indices = jnp.asarray(np.stack(rows)[None], jnp.int32)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    return q_latent, q_rope, latent, k_rope, indices, positions


# ----------------------------------------------------------------------------- timing


def timed(fn, args, repeats):
    """Median wall time of `fn(*args)` after one compile-and-run call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="S = T, tokens in the sequence")
    parser.add_argument("--topk", type=int, default=256, help="selected keys per query")
    parser.add_argument("--heads", type=int, default=16, help="attention heads")
    parser.add_argument("--rank", type=int, default=256, help="latent width (values and nope keys)")
    parser.add_argument("--rope-dim", type=int, default=64, help="rope width of queries and keys")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--no-backward", action="store_true", help="skip forward+backward timing")
    args = parser.parse_args()

    inputs = make_inputs(args.length, args.heads, args.rank, args.rope_dim, args.topk)
    scale = (args.rank + args.rope_dim) ** -0.5
    forwards = {name: jax.jit(lambda *a, fn=fn: fn(*a, scale)) for name, fn in
                (("dense", dense_masked_attention), ("gathered", gathered_attention))}
    difference = float(jnp.max(jnp.abs(forwards["dense"](*inputs) - forwards["gathered"](*inputs))))

    def with_backward(fn):
        def loss(q_latent, q_rope, latent, k_rope, indices, positions):
            return jnp.sum(fn(q_latent, q_rope, latent, k_rope, indices, positions, scale))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

    rows = [("forward", {name: timed(fn, inputs, args.repeats) for name, fn in forwards.items()})]
    if not args.no_backward:
        rows.append(("forward+backward", {
            name: timed(with_backward(fn), inputs, args.repeats)
            for name, fn in (("dense", dense_masked_attention), ("gathered", gathered_attention))}))

    print(f"command: python {shlex.join(['bench/dsa_cpu.py'] + sys.argv[1:])}")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, float32; B=1, S=T={args.length}, "
          f"k={args.topk}, N={args.heads}, latent {args.rank} + rope {args.rope_dim}; "
          f"max |dense - gathered| = {difference:.2e}\n")
    print("| pass | dense mask (ms) | gathered top-k (ms) | dense / gathered |")
    print("|---|---|---|---|")
    for name, times in rows:
        print(f"| {name} | {times['dense'] * 1e3:.0f} | {times['gathered'] * 1e3:.0f} | "
              f"{times['dense'] / times['gathered']:.2f}x |")


if __name__ == "__main__":
    main()
