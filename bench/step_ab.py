"""Two checkouts of this project side by side on the model's two hot paths (CPU): the serving
step (`paged_step`: 32 decode rows, then one 256-token prefill chunk beside them, on the demo
model in its serving layout) and the training step's forward + backward (`apply_model` with the
MTP head, cross-entropy, [8, 256] rows). For a refactor of the model code: same work, same
options, only the code differs.

    python bench/step_ab.py --before /tmp/old-checkout --after . [--rounds 4]

Each side runs in its own process (PYTHONPATH = its checkout), built and compiled once; then the
sides take turns round by round (before first in even rounds, after first in odd ones: these
shared machines drift within minutes), each timing --iters calls per figure. Reports the median
per-call milliseconds per side and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r'''
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
import glm5_jax
from glm5_jax.config_files import load_model_config
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.model.paged_decode import StepBatch, init_paged_cache, paged_step, serving_layout

config = load_model_config("configs/demo.py")
options = ExecutionOptions(scan_unroll=8, moe_impl="blocked", causal_block_size=64)
params = glm5_jax.init_params(config, 0, options=options)
serving = serving_layout(config, params, options)
page, width, rows, chunk = 16, 32, 32, 256  # 512-position tables, block_pages 8
cache = init_paged_cache(config, rows * width + 1, page, options.compute_dtype)
tables = np.arange(1, rows * width + 1, dtype=np.int32).reshape(rows, width)
rng = np.random.default_rng(0)
context = 300
decode = StepBatch(rng.integers(0, config.vocab_size, rows).astype(np.int32),
                   np.full(rows, context, np.int32), np.zeros((0, 0), np.int32), np.zeros((0, 0), np.int32),
                   tables)
mixed = StepBatch(decode.decode_tokens, decode.decode_positions,
                  rng.integers(0, config.vocab_size, (1, chunk)).astype(np.int32),
                  np.arange(chunk, dtype=np.int32)[None], np.concatenate([tables, tables[:1]]))
rows_decode, rows_mixed = np.arange(rows, dtype=np.int32), np.arange(rows + 1, dtype=np.int32)

def serve(batch, sample):
    global cache
    logits, cache = paged_step(config, serving, cache, batch, sample, options=options, block_pages=8)
    return logits

ids = jnp.asarray(rng.integers(0, config.vocab_size, (8, 257)), jnp.int32)

@jax.jit
def train(params):
    def loss(params):
        out = glm5_jax.apply_model(config, params, ids[:, :-1], with_mtp=True, options=options)
        logp = jax.nn.log_softmax(out["logits"])
        main = -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))
        # The MTP head runs forward only (weight 0 in the loss), as when docs/benchmarks.md's
        # figures were measured.
        return main + 0.0 * jnp.mean(out["mtp_logits"])
    return jax.value_and_grad(loss)(params)

work = {"decode32": lambda: serve(decode, rows_decode), "mixed32+256": lambda: serve(mixed, rows_mixed),
        "train_fwd_bwd": lambda: train(params)}
for fn in work.values():
    jax.block_until_ready(fn())
print("ready", flush=True)
for line in sys.stdin:
    name, iters = line.split()
    fn = work[name]
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(int(iters)):
        out = fn()
    jax.block_until_ready(out)
    print(json.dumps({name: (time.perf_counter() - start) / int(iters) * 1e3}), flush=True)
'''


def start(checkout: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(checkout), "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen([sys.executable, "-c", WORKER], cwd=checkout, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if line.strip() != "ready":
        raise SystemExit(f"{checkout}: worker failed to start ({line!r})")
    return process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=Path)
    parser.add_argument("--after", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    sides = {"before": start(args.before.resolve()), "after": start(args.after.resolve())}
    figures = {side: {} for side in sides}
    names = ("decode32", "mixed32+256", "train_fwd_bwd")
    for round_index in range(args.rounds):
        order = ("before", "after") if round_index % 2 == 0 else ("after", "before")
        for name in names:
            iters = max(2, args.iters // 5) if name == "train_fwd_bwd" else args.iters
            for side in order:
                process = sides[side]
                process.stdin.write(f"{name} {iters}\n")
                process.stdin.flush()
                figures[side].setdefault(name, []).extend(json.loads(process.stdout.readline()).values())
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print("| work | before ms | after ms | after / before |\n|---|---|---|---|")
    for name in names:
        before, after = (statistics.median(figures[side][name]) for side in ("before", "after"))
        print(f"| {name} | {before:.2f} | {after:.2f} | {after / before:.3f} |")
    for process in sides.values():
        process.stdin.close()
        process.wait()


if __name__ == "__main__":
    main()
