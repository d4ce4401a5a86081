"""Training throughput: our jitted train step vs transformers + torch on the same architecture
and batch (CPU), measured in one run and reported as a ratio and as a fraction of this CPU's
measured matmul rate.

    python bench/train_step.py [--models demo,moe16] [--steps 5] [--batch-size 8] [--dtype bfloat16]

Models: "demo" is configs/demo.py (seq 256) without the MTP head (transformers has none);
"moe16" is the issue's larger shape: the demo with 6 layers, 16 experts top-4, a 16,384-token
vocabulary and seq 512 (26.7M parameters). Both sides: AdamW, float32 (or, with `--dtype
bfloat16`, bfloat16 compute over float32 weights: ours via execution.dtype, torch under autocast),
the same random token batch; the first (compiling / warm-up) step is excluded; each side runs
blocks of `--steps` steps (one untimed step first), two rounds; the figure is the median step time.
Both sides run under train.py's host malloc policy (glm5_jax/host_memory.py; off with
--no-reuse-host-memory).

Model FLOPs per step = 3 x (2 x active matmul parameters x tokens + the attention and indexer
score matmuls counted dense over the whole [T, S]), the indexer forward only (it gets no
gradient); with `execution.causal_block_size` giving n > 1 query blocks the attention computes
about (n + 1) / 2n of its [T, S] part. The roofline is the best rate of a 2048^3 matmul in the
run's dtype (float32 accumulation) measured in this run.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from reference import hf_config  # noqa: E402

import glm5_jax  # noqa: E402
from glm5_jax.config_files import load_config_file  # noqa: E402
from glm5_jax.host_memory import reuse_freed_memory  # noqa: E402
from glm5_jax.model import ModelConfig  # noqa: E402
from glm5_jax.model.options import ExecutionOptions  # noqa: E402
from glm5_jax.train.optimizer import make_optimizer  # noqa: E402
from glm5_jax.train.settings import TrainSettings  # noqa: E402
from glm5_jax.train.step import init_train_state, make_train_step  # noqa: E402

MODELS = {
    "demo": ({}, None),
    "moe16": (dict(num_layers=6, num_experts=16, num_experts_per_token=4, vocab_size=16384), 512),
}


def ours(config, options, settings):
    """A step closure for our jitted train step (compiled on its first call)."""
    optimizer = make_optimizer(settings)
    holder = {"state": init_train_state(glm5_jax.init_params(config, 0, options=options), optimizer)}
    step = make_train_step(config, settings, optimizer, options=options)

    def one_step(batch):
        holder["state"], metrics = step(holder["state"], batch)
        return float(metrics["loss"])

    return one_step


def transformers_step(config, settings, dtype: str = "float32"):
    """A step closure for transformers' model with torch AdamW (eager, sdpa attention); dtype
    "bfloat16": the forward and backward under torch.autocast (float32 weights and optimizer)."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM._from_config(hf_config(config), attn_implementation="sdpa").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate,
                                  betas=(settings.adam_b1, settings.adam_b2),
                                  weight_decay=settings.weight_decay)

    def one_step(batch):
        ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return one_step


def model_flops(config: ModelConfig, batch_size: int, seq_len: int) -> float:
    """Matmul FLOPs of one training step (forward + backward), as the docstring defines them."""
    tokens = batch_size * seq_len
    pairs = batch_size * seq_len * seq_len
    attention = 2 * pairs * config.num_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim
                                                + config.v_head_dim)
    indexer = 2 * pairs * config.index_num_heads * config.index_head_dim
    active = glm5_jax.count_params(config)["active"]
    return 3 * (2 * active * tokens + config.num_layers * attention) + config.num_layers * indexer


def matmul_roofline(dtype: str, size: int = 2048, repeats: int = 10) -> float:
    """Best FLOP/s of one [size, size] x [size, size] jitted matmul in dtype on this machine."""
    a = jnp.ones((size, size), dtype)
    # float32 accumulation: XLA:CPU runs a bfloat16 -> bfloat16 dot in float32 (no AMX).
    matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    matmul(a, a).block_until_ready()
    best = min(_timed(lambda: matmul(a, a).block_until_ready()) for _ in range(repeats))
    return 2 * size**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(name: str, run_config, args, roofline: float) -> list[str]:
    overrides, seq_len = MODELS[name]
    seq_len = seq_len or run_config.data.seq_len
    base = TrainSettings.from_config(run_config)
    settings = base.__class__(**{**base.__dict__, "batch_size": args.batch_size, "grad_accum_steps": 1})
    config = ModelConfig.from_dict({**run_config.model.to_dict(), **overrides, "num_mtp_layers": 0})
    options = ExecutionOptions.from_dict(run_config.get("execution")).replace(dtype=args.dtype)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch_size, seq_len))
    batch = dict(input_ids=ids.astype(np.int32), segment_ids=np.ones_like(ids, np.int32),
                 positions=np.broadcast_to(np.arange(seq_len), ids.shape).astype(np.int32))
    tokens = args.batch_size * seq_len
    flops = model_flops(config, args.batch_size, seq_len)
    millions = glm5_jax.count_params(config)["total"] / 1e6
    print(f"\n{name}: {millions:.1f}M parameters, batch {args.batch_size} x {seq_len}, "
          f"{flops / 1e9:.1f} GFLOP per step; {options.dtype=}, {options.moe_impl=}, {options.scan_unroll=}, "
          f"{options.causal_block_size=}",
          flush=True)
    steps = {"transformers": transformers_step(config, settings, args.dtype),
             "glm5_jax": ours(config, options, settings)}
    times = {label: [] for label in steps}
    for one_step in steps.values():
        one_step(batch)  # compile / warm up
    for _ in range(2):  # two rounds, so a change in machine load hits both sides
        for label, one_step in steps.items():
            # A block of steps per side: torch's OpenMP threads spin-wait after each op, so a
            # step of one side right after the other's would share the cores with them.
            one_step(batch)
            times[label] += [_timed(lambda: one_step(batch)) for _ in range(args.steps)]  # noqa: B023
    reference = statistics.median(times["transformers"])
    lines = []
    for label, seconds in times.items():
        seconds = statistics.median(seconds)
        lines.append(f"| {name} | {label} | {seconds:.3f} | {tokens / seconds:,.0f} | "
                     f"{reference / seconds:.2f}x | {flops / seconds / roofline:.0%} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.py", help="training config file (the base model)")
    parser.add_argument("--models", default="demo,moe16", help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block (two blocks per side)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="compute dtype of both sides (bfloat16: ours with execution.dtype, torch under "
                             "autocast; weights and optimizer float32 on both)")
    parser.add_argument("--reuse-host-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="glm5_jax.host_memory's malloc policy (as train.py applies it) for this "
                             "process, so for both sides (default: on)")
    args = parser.parse_args()
    if args.reuse_host_memory:  # before JAX and torch start their threads
        reuse_freed_memory()
    run_config = load_config_file(args.config)
    roofline = matmul_roofline(args.dtype)
    print(f"jax {jax.__version__} / torch {torch.__version__}, {torch.get_num_threads()} torch threads; "
          f"{args.dtype} matmul roofline {roofline / 1e9:.0f} GFLOP/s (2048^3, best of 10)")
    lines = [line for name in args.models.split(",") for line in compare(name, run_config, args, roofline)]
    print("\n| model | implementation | s/step (median) | tokens/s | vs transformers | of roofline |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
