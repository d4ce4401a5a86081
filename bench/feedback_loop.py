"""The feedback loop, measured: serve a chat model with --feedback-dir, ask it questions, rate its
answers, export preference pairs, DPO on them, and compare the held-out pairs' reward margin
before and after.

    python bench/feedback_loop.py --checkpoint runs/sft_demo        # ~10 min on a 2-core CPU

1. `serve.py --checkpoint CKPT --feedback-dir DIR` in a subprocess; each question of the
   templated stdlib chat set ("What does `module.name` do?", glm5_jax/data/templated.py) goes
   through the official `openai` client (greedy, --max-tokens).
2. A stand-in for a human rater scores each answer against the reference answer
   (difflib ratio r: rating 2r - 1) and posts a correction (the reference) when r < 0.6, through
   `POST /v1/feedback`.
3. `python -m glm5_jax.data.feedback --input DIR --sft ... --pairs ...` exports the pairs
   (chosen = correction, rejected = the model's answer).
4. `python train.py --config configs/dpo_demo.py:CKPT,PAIRS` trains on them; its step-0 and last
   validation lines give the held-out pairs' reward margin and accuracy (10% of the pairs are held
   out by the usual document split).
Writes a markdown table to stdout (and --out JSON).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def serve_bench_module():
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def questions(count: int) -> list[tuple[list[dict], str]]:
    """(prompt messages, reference answer) of the "what does X do" conversations."""
    from glm5_jax.data.templated import stdlib_conversations

    chosen = [c["messages"] for c in stdlib_conversations()
              if c["messages"][1]["content"].startswith("What does")]
    return [(messages[:-1], messages[-1]["content"]) for messages in chosen[:count]]


def ask_and_rate(port: int, prompt: list[dict], reference: str, max_tokens: int) -> float:
    """One question through the API, rated against the reference; returns the similarity."""
    url = f"http://127.0.0.1:{port}/v1"
    with openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=600) as client:
        # Non-thinking mode: the templated answers have no reasoning, so the prompt ends `</think>`.
        no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
        reply = client.chat.completions.create(model="bench", messages=prompt, max_tokens=max_tokens,
                                               temperature=0, extra_body=no_thinking)
    answer = reply.choices[0].message.content or ""
    similarity = difflib.SequenceMatcher(None, answer, reference).ratio()
    feedback = {"id": reply.id, "rating": round(2 * similarity - 1, 3)}
    if similarity < 0.6:
        feedback["correction"] = reference
    response = httpx.post(f"http://127.0.0.1:{port}/v1/feedback", json=feedback, timeout=60)
    response.raise_for_status()
    return similarity


def run(command: list[str]) -> str:
    log("running " + " ".join(command[1:]))
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed:\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    return result.stdout


def validation_lines(workdir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "val_reward_margin" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="runs/sft_demo", help="the chat model to serve and tune")
    parser.add_argument("--workdir", default="runs/feedback_loop",
                        help="where the feedback log, the exports and the DPO run go")
    parser.add_argument("--questions", type=int, default=240, help="questions asked (default 240)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default 48)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument("--steps", type=int, default=40, help="DPO steps (default 40)")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    checkpoint, workdir = Path(args.checkpoint), Path(args.workdir)
    if not checkpoint.exists():
        sys.exit(f"error: {checkpoint} does not exist; make it first: "
                 "python train.py --config configs/sft_demo.py")
    if workdir.exists():
        sys.exit(f"error: {workdir} exists; remove it or pass another --workdir")
    feedback_dir = workdir / "feedback"

    # 1-2. serve, ask, rate
    bench_serve = serve_bench_module()
    server = bench_serve.Server(checkpoint, 512, argparse.Namespace(
        max_slots=args.clients, serve_args=["--feedback-dir", str(feedback_dir)]))
    asked = questions(args.questions)
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(args.clients) as pool:
            similarities = list(pool.map(lambda q: ask_and_rate(server.port, *q, args.max_tokens), asked))
    finally:
        server.close()
    serve_seconds = time.perf_counter() - started
    log(f"{len(asked)} answers rated in {serve_seconds:.0f} s; mean similarity "
        f"{sum(similarities) / len(similarities):.3f}")

    # 3. export
    sft, pairs = workdir / "sft.jsonl", workdir / "pairs.jsonl"
    export = run([sys.executable, "-m", "glm5_jax.data.feedback", "--input", str(feedback_dir),
                  "--sft", str(sft), "--pairs", str(pairs)])
    print(export.strip(), file=sys.stderr)

    # 4. DPO on the exported pairs
    tuned = workdir / "dpo"
    run([sys.executable, "train.py", f"--config=configs/dpo_demo.py:{checkpoint},{pairs}",
         f"--workdir={tuned}", f"--config.num_train_steps={args.steps}",
         f"--config.eval_every={args.steps // 4}"])
    lines = validation_lines(tuned)
    before, after = lines[0], lines[-1]
    figures = {"questions": len(asked), "serve_seconds": serve_seconds,
               "pairs": sum(1 for _ in pairs.open()),
               "mean_similarity": sum(similarities) / len(similarities),
               "before": before, "after": after}
    print(f"| held-out pairs | step {before['step']} | step {after['step']} |\n|---|---|---|")
    for key in ("val_reward_margin", "val_reward_accuracy", "val_dpo_loss"):
        print(f"| {key} | {before[key]:.4f} | {after[key]:.4f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
