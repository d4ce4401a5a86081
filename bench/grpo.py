"""GRPO on the demo, before and after: arithmetic SFT of the demo run (so the initial reward is not
zero), then GRPO from it; held-out reward (greedy exact match on prompts never trained on, with
95% Wilson intervals) before and after, the training reward curve, rollout tokens/s and the share
of wall time in rollouts vs training. Writes a plot (docs/figures/grpo_demo.png by default) and
a markdown table.

    python train.py --config configs/demo.py                  # runs/demo, once (8 min on 2 cores)
    python bench/grpo.py --base runs/demo                      # SFT, then GRPO; ~20 min on 2 cores

Both runs are ordinary `train.py` runs (configs/grpo_sft_demo.py, configs/grpo_demo.py) whose
metrics.jsonl this script reads; `--skip-sft` reuses an existing SFT run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(command: list[str]) -> float:
    print("$ " + " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    return time.perf_counter() - started


def read_metrics(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def held_out(records: list[dict]) -> dict[int, tuple[float, float, float]]:
    keys = ("heldout/reward", "heldout/reward_low", "heldout/reward_high")
    return {r["step"]: tuple(r[key] for key in keys) for r in records if keys[0] in r}


def plot(records: list[dict], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps = [r["step"] for r in records if "reward/mean" in r]
    rewards = np.array([r["reward/mean"] for r in records if "reward/mean" in r])
    smooth = np.convolve(rewards, np.ones(window) / window, mode="valid") \
        if len(rewards) >= window else rewards
    evaluations = held_out(records)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, rewards, alpha=0.35, label="training reward (batch mean)")
    left.plot(steps[len(steps) - len(smooth):], smooth, label=f"{window}-step mean")
    at = sorted(evaluations)
    means = [evaluations[s][0] for s in at]
    errors = [[evaluations[s][0] - evaluations[s][1] for s in at],
              [evaluations[s][2] - evaluations[s][0] for s in at]]
    left.errorbar(at, means, yerr=errors, fmt="o-", capsize=4, label="held-out reward (greedy, 95% CI)")
    left.set_xlabel("GRPO step")
    left.set_ylabel("reward (exact match)")
    left.legend(loc="lower right")
    left.set_title("GRPO on templated arithmetic (demo model)")
    rollout = [r["rollout_seconds"] for r in records if "rollout_seconds" in r]
    train = [r["train_seconds"] for r in records if "train_seconds" in r]
    right.plot(steps[:len(rollout)], rollout, label="rollouts (engine)")
    right.plot(steps[:len(train)], train, label="train step")
    right.set_xlabel("GRPO step")
    right.set_ylabel("seconds")
    right.set_title("where a step's time goes")
    right.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="runs/demo", help="the demo run to start from")
    parser.add_argument("--sft-workdir", default="runs/grpo_sft_demo")
    parser.add_argument("--workdir", default="runs/grpo_demo")
    parser.add_argument("--skip-sft", action="store_true", help="reuse the SFT run in --sft-workdir")
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps")
    parser.add_argument("--plot", default="docs/figures/grpo_demo.png")
    parser.add_argument("--set", action="append", default=[],
                        help="extra --config.<field>=<value> for the GRPO run (repeatable)")
    args = parser.parse_args(argv)
    python = sys.executable
    sft_seconds = None
    if not args.skip_sft:
        sft_seconds = run([python, "train.py", f"--config=configs/grpo_sft_demo.py:{args.base}",
                           f"--workdir={args.sft_workdir}"])
    grpo_seconds = run([python, "train.py", f"--config=configs/grpo_demo.py:{args.sft_workdir}",
                        f"--workdir={args.workdir}", f"--config.num_train_steps={args.steps}",
                        *[f"--config.{item}" for item in args.set]])
    records = read_metrics(ROOT / args.workdir)
    evaluations = held_out(records)
    first, last = min(evaluations), max(evaluations)
    steps = [r for r in records if "reward/mean" in r]
    head, tail = steps[:10], steps[-10:]
    mean = lambda rows, key: sum(r[key] for r in rows) / max(len(rows), 1)  # noqa: E731
    rollout_seconds = sum(r["rollout_seconds"] for r in steps)
    train_seconds = sum(r["train_seconds"] for r in steps)
    step_seconds = sum(r["step_seconds"] for r in steps)
    tokens = sum(r["completion_tokens_mean"] for r in steps)  # per rollout; scaled below
    print()
    interval = lambda step: "{:.3f} [{:.3f}, {:.3f}]".format(*evaluations[step])  # noqa: E731
    print(f"| | before (step {first}) | after (step {last}) |")
    print("|---|---|---|")
    print(f"| held-out reward, greedy (95% CI) | {interval(first)} | {interval(last)} |")
    print(f"| training reward, mean of first / last 10 steps | {mean(head, 'reward/mean'):.3f} | "
          f"{mean(tail, 'reward/mean'):.3f} |")
    print()
    print(f"GRPO: {len(steps)} steps in {grpo_seconds:.0f} s wall ({step_seconds:.0f} s in steps); "
          f"rollouts {rollout_seconds:.0f} s ({rollout_seconds / step_seconds:.0%}), train steps "
          f"{train_seconds:.0f} s ({train_seconds / step_seconds:.0%}); rollout throughput "
          f"{mean(steps, 'rollout_tokens_per_second'):.0f} completion tokens/s (mean over steps); "
          f"completion length {tokens / len(steps):.2f} tokens; "
          + (f"SFT {sft_seconds:.0f} s" if sft_seconds else "SFT reused"))
    for key in ("clip_fraction", "log_prob_gap", "staleness", "zero_advantage_groups", "rows"):
        if key in steps[0]:
            print(f"  {key}: first 10 steps {mean(head, key):.4f}, last 10 {mean(tail, key):.4f}")
    plot(records, ROOT / args.plot, window=10)


if __name__ == "__main__":
    main()
