"""Training throughput: our jitted train step vs transformers + torch on the same architecture
and batch (CPU), measured in one run and reported as a ratio.

    python bench/train_step.py [--config configs/demo.py] [--steps 5] [--batch-size 8]

Both sides: the demo model without the MTP head (transformers has none), AdamW, float32, the
same random token batch; the first (compiling / warm-up) step is excluded.
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from reference import hf_config  # noqa: E402

import glm5_jax  # noqa: E402
from glm5_jax.config_files import load_config_file  # noqa: E402
from glm5_jax.model import ModelConfig  # noqa: E402
from glm5_jax.model.options import ExecutionOptions  # noqa: E402
from glm5_jax.train.optimizer import make_optimizer  # noqa: E402
from glm5_jax.train.settings import TrainSettings  # noqa: E402
from glm5_jax.train.step import init_train_state, make_train_step  # noqa: E402


def time_ours(config, options, settings, batch, steps) -> float:
    optimizer = make_optimizer(settings)
    state = init_train_state(glm5_jax.init_params(config, 0, options=options), optimizer)
    step = make_train_step(config, settings, optimizer, options=options)
    state, metrics = step(state, batch)
    float(metrics["loss"])
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
        float(metrics["loss"])
    return (time.perf_counter() - start) / steps


def time_transformers(config, settings, batch, steps) -> float:
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM._from_config(hf_config(config), attn_implementation="sdpa").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate,
                                  betas=(settings.adam_b1, settings.adam_b2),
                                  weight_decay=settings.weight_decay)
    ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)

    def one_step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    one_step()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.py", help="training config file")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per implementation")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step")
    args = parser.parse_args()

    run_config = load_config_file(args.config)
    seq_len = run_config.data.seq_len
    settings = TrainSettings.from_config(run_config).__class__(
        **{**TrainSettings.from_config(run_config).__dict__, "batch_size": args.batch_size,
           "grad_accum_steps": 1})
    base = ModelConfig.from_dict({**run_config.model.to_dict(), "num_mtp_layers": 0})
    options = ExecutionOptions.from_dict(run_config.get("execution"))
    ids = np.random.default_rng(0).integers(0, base.vocab_size, (args.batch_size, seq_len))
    batch = dict(input_ids=ids.astype(np.int32), segment_ids=np.ones_like(ids, np.int32),
                 positions=np.broadcast_to(np.arange(seq_len), ids.shape).astype(np.int32))
    tokens = args.batch_size * seq_len
    millions = glm5_jax.count_params(base)["total"] / 1e6
    print(f"jax {jax.__version__} / torch {torch.__version__}, {torch.get_num_threads()} torch "
          f"threads; batch {args.batch_size} x {seq_len}; {millions:.1f}M params")
    torch_seconds = time_transformers(base, settings, batch, args.steps)
    print("| implementation | s/step | tokens/s | vs transformers |")
    print("|---|---|---|---|")
    print(f"| transformers 5.24 + torch (eager, sdpa) | {torch_seconds:.3f} | "
          f"{tokens / torch_seconds:,.0f} | 1.00x |")
    for impl in ("blocked", "dense", "ragged"):
        seconds = time_ours(base, options.replace(moe_impl=impl), settings, batch, args.steps)
        print(f"| glm5_jax jit, moe_impl={impl} | {seconds:.3f} | {tokens / seconds:,.0f} | "
              f"{torch_seconds / seconds:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
