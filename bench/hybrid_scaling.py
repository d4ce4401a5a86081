"""How a GLM-5.3-Flash training step grows with sequence length: configs/glm5_next_demo.py's
hybrid model (3 KDA linear-attention layers, 1 MLA layer with pooled DSA, 4 hyper-connection
streams) against transformers' Glm5NextForConditionalGeneration (its PyTorch KDA and conv
fallbacks, eager attention) on the same architecture, one sequence per step, 1K to 8K tokens.

    python bench/hybrid_scaling.py [--lengths 1024,2048,4096,8192] [--steps 3] [--reference-up-to 4096]

Each side runs forward + backward + AdamW on one [1, T] random-token row; the first (compiling /
warm-up) step is excluded; the figure is the median of --steps timed steps. The KDA layers' cost
is linear in T (a lax.scan over chunks of `linear_chunk_size` positions: [C, C] work per chunk);
the MLA layer's attention is dense [T, T] in this reference backend, so it grows quadratically;
the per-token column shows which dominates at each length.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_step import ours  # noqa: E402 - bench/train_step.py's step closure

import glm5_jax  # noqa: E402
from glm5_jax.checkpoint import config_to_hf  # noqa: E402
from glm5_jax.config_files import load_config_file  # noqa: E402
from glm5_jax.host_memory import reuse_freed_memory  # noqa: E402
from glm5_jax.model import ModelConfig  # noqa: E402
from glm5_jax.model.options import ExecutionOptions  # noqa: E402
from glm5_jax.train.settings import TrainSettings  # noqa: E402


def transformers_step(config, settings):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                  out_hidden_size=config.hidden_size, projection_intermediate_size=32)
    model = Glm5NextForConditionalGeneration._from_config(
        Glm5NextConfig(text_config=config_to_hf(config)["text_config"], vision_config=vision),
        attn_implementation="eager").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate)

    def one_step(batch):
        ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return one_step


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/glm5_next_demo.py")
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side and length (median)")
    parser.add_argument("--reference-up-to", type=int, default=4096,
                        help="run transformers up to this length (its eager [T, T] attention and PyTorch KDA "
                             "fallback get slow beyond)")
    parser.add_argument("--chunk-size", type=int, default=0, help="override execution.linear_chunk_size")
    args = parser.parse_args()
    reuse_freed_memory()
    run_config = load_config_file(args.config)
    config = ModelConfig.from_dict({**run_config.model.to_dict(), "max_position_embeddings": 1 << 20})
    options = ExecutionOptions.from_dict(run_config.get("execution"))
    if args.chunk_size:
        options = options.replace(linear_chunk_size=args.chunk_size)
    settings = TrainSettings.from_config(run_config)
    settings = settings.__class__(**{**settings.__dict__, "batch_size": 1, "grad_accum_steps": 1})
    print(f"{args.config}: {glm5_jax.count_params(config)['total'] / 1e6:.1f}M parameters, "
          f"layers {list(config.attention_types)}, linear_chunk_size {options.linear_chunk_size}, "
          f"causal_block_size {options.causal_block_size}; {torch.get_num_threads()} torch threads",
          flush=True)
    rows, previous = [], {}
    for length in (int(n) for n in args.lengths.split(",")):
        ids = np.random.default_rng(length).integers(1, config.vocab_size, (1, length)).astype(np.int32)
        positions = np.arange(length, dtype=np.int32)[None]
        batch = dict(input_ids=ids, segment_ids=np.ones_like(ids), positions=positions)
        sides = {"glm5_jax": ours(config, options, settings)}
        if length <= args.reference_up_to:
            sides["transformers"] = transformers_step(config, settings)
        for label, one_step in sides.items():
            one_step(batch)  # compile / warm up
            seconds = statistics.median(timed(lambda: one_step(batch)) for _ in range(args.steps))  # noqa: B023
            growth = f"{seconds / previous[label]:.2f}x" if label in previous else ""
            previous[label] = seconds
            rows.append(f"| {length} | {label} | {seconds:.3f} | {seconds / length * 1e6:.0f} | {growth} |")
            print(rows[-1], flush=True)
    print("\n| tokens | implementation | s/step (median) | us/token | vs half the length |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
