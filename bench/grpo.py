"""GRPO on the demo, before and after: arithmetic SFT of the demo run (so the initial reward is not
zero), then GRPO from it; held-out reward (greedy exact match on prompts never trained on, with
95% Wilson intervals) at the run's evaluations, the training reward curve, rollout tokens/s and the
share of wall time in rollouts vs training; then the SFT and GRPO checkpoints side by side on the
same held-out prompts and seeds (greedy and sampled reward, the difference with a paired-bootstrap
95% interval). Writes a plot (docs/img/grpo_demo.png by default) and markdown tables.

    python train.py --config configs/demo.py                  # runs/demo, once (8 min on 2 cores)
    python bench/grpo.py --base runs/demo                      # SFT, then GRPO; ~20 min on 2 cores

Both runs are ordinary `train.py` runs (configs/grpo_sft_demo.py, configs/grpo_demo.py) whose
metrics.jsonl this script reads; `--skip-sft` / `--skip-grpo` reuse existing runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

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


def held_out_rewards(checkpoint: Path, samples: int) -> dict[str, np.ndarray]:
    """Per held-out prompt: the greedy answer's reward and the mean reward of `samples` samples at
    the GRPO config's temperature (the same seeds for every checkpoint)."""
    from glm5_jax.pyconfig import load_config_file
    from glm5_jax.rl.rewards import make_rewards
    from glm5_jax.rl.rollouts import RolloutWorker, sample_seed
    from glm5_jax.rl.tasks import load_tasks
    from glm5_jax.train.loop import chat_renderer
    from glm5_jax.train.runs import load_any

    config = load_config_file(ROOT / "configs" / "grpo_demo.py")
    model_config, params, tokenizer = load_any(str(checkpoint))
    tasks = [task for spec in config.tasks for task in load_tasks(dict(spec), config.seed)[1]]
    rewards = make_rewards([dict(spec) for spec in config.rewards])
    worker = RolloutWorker(model_config, params, tokenizer, chat_renderer(checkpoint),
                           max_context=config.data.seq_len, max_slots=config.grpo.engine_slots,
                           token_budget=config.grpo.engine_token_budget,
                           page_size=config.grpo.engine_page_size)
    prompts = [(index, worker.prompt_ids(task.messages)) for index, task in enumerate(tasks)]
    found = {}
    try:
        for name, count, temperature in (("greedy", 1, 0.0), ("sampled", samples, config.grpo.temperature)):
            rollouts, _ = worker.generate(
                prompts, samples=count, max_new_tokens=config.grpo.max_new_tokens,
                temperature=temperature, top_p=config.grpo.top_p,
                seeds=lambda position, sample: sample_seed(12345, 0, position, sample))
            scored = rewards.score([tasks[r.task_index] for r in rollouts], [r.text for r in rollouts])
            found[name] = np.array([r.total for r in scored]).reshape(len(tasks), count).mean(axis=1)
    finally:
        worker.shutdown()
    return found


def paired_difference(before: np.ndarray, after: np.ndarray, draws: int = 10000):
    """(mean of after - before over prompts, 95% paired-bootstrap interval)."""
    differences = after - before
    rng = np.random.default_rng(0)
    means = differences[rng.integers(0, len(differences), (draws, len(differences)))].mean(axis=1)
    return float(differences.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def plot(records: list[dict], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    keys = ("heldout/sampled_reward", "heldout/sampled_reward_low", "heldout/sampled_reward_high")
    sampled = {r["step"]: tuple(r[key] for key in keys) for r in records if keys[0] in r}
    if sampled:
        at = sorted(sampled)
        below = [sampled[s][0] - sampled[s][1] for s in at]
        above = [sampled[s][2] - sampled[s][0] for s in at]
        left.errorbar([s + 1 for s in at], [sampled[s][0] for s in at], yerr=[below, above], fmt="s--",
                      capsize=4, label="held-out reward (sampled, 95% CI)")
    left.set_xlabel("GRPO step")
    left.set_ylabel("reward (exact match)")
    left.legend(loc="upper left", fontsize=8)
    left.set_title("GRPO on templated arithmetic (demo model)")
    rollout = [r["rollout_seconds"] for r in records if "rollout_seconds" in r]
    train = [r["train_seconds"] for r in records if "train_seconds" in r]
    right.plot(steps[:len(rollout)], rollout, label="rollouts (engine)")
    right.plot(steps[:len(train)], train, label="train step")
    right.set_xlabel("GRPO step")
    right.set_ylabel("seconds")
    right.set_title("where a step's time goes (step 1 compiles)")
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
    parser.add_argument("--skip-grpo", action="store_true",
                        help="reuse the GRPO run in --workdir (report and compare only)")
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps")
    parser.add_argument("--plot", default="docs/img/grpo_demo.png")
    parser.add_argument("--samples", type=int, default=16,
                        help="sampled answers per held-out prompt in the before/after comparison")
    parser.add_argument("--set", action="append", default=[],
                        help="extra --config.<field>=<value> for the GRPO run (repeatable)")
    args = parser.parse_args(argv)
    python = sys.executable
    sft_seconds = None
    if not args.skip_sft:
        sft_seconds = run([python, "train.py", f"--config=configs/grpo_sft_demo.py:{args.base}",
                           f"--workdir={args.sft_workdir}"])
    grpo_seconds = None if args.skip_grpo else run(
        [python, "train.py", f"--config=configs/grpo_demo.py:{args.sft_workdir}", f"--workdir={args.workdir}",
         f"--config.num_train_steps={args.steps}", *[f"--config.{item}" for item in args.set]])
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
    wall = f"{grpo_seconds:.0f} s wall" if grpo_seconds else "an earlier run"
    print(f"GRPO: {len(steps)} steps in {wall} ({step_seconds:.0f} s in steps); "
          f"rollouts {rollout_seconds:.0f} s ({rollout_seconds / step_seconds:.0%}), train steps "
          f"{train_seconds:.0f} s ({train_seconds / step_seconds:.0%}); rollout throughput "
          f"{mean(steps, 'rollout_tokens_per_second'):.0f} completion tokens/s (mean over steps); "
          f"completion length {tokens / len(steps):.2f} tokens; "
          + (f"SFT {sft_seconds:.0f} s" if sft_seconds else "SFT reused"))
    for key in ("clip_fraction", "log_prob_gap", "staleness", "zero_advantage_groups", "rows"):
        if key in steps[0]:
            print(f"  {key}: first 10 steps {mean(head, key):.4f}, last 10 {mean(tail, key):.4f}")
    plot(records, ROOT / args.plot, window=10)
    # Before vs after on the same held-out prompts, paired (the same prompts and seeds).
    before = held_out_rewards(ROOT / args.sft_workdir, args.samples)
    after = held_out_rewards(ROOT / args.workdir, args.samples)
    print()
    print(f"held-out prompts: {len(before['greedy'])}; {args.samples} samples each at the rollout "
          "temperature")
    print("| held-out | SFT (before) | GRPO (after) | after - before (95% paired bootstrap) |")
    print("|---|---|---|---|")
    for name in ("greedy", "sampled"):
        difference = paired_difference(before[name], after[name])
        print(f"| {name} reward | {before[name].mean():.3f} | {after[name].mean():.3f} | "
              "{:+.3f} [{:+.3f}, {:+.3f}] |".format(*difference))


if __name__ == "__main__":
    main()
