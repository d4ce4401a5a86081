"""lm-evaluation-harness against serve.py: a local multiple-choice task run with
`lm_eval --model local-completions` (prompt scoring through `echo` + `logprobs`) must give the
same accuracy as the log-likelihoods computed from `glm5_jax.forward` directly.

    pip install lm-eval          # the optional evaluation extra: pip install -e ".[eval]"
    python bench/lm_eval_check.py                    # demo-size model (runs/demo if trained, else random)
    python bench/lm_eval_check.py --checkpoint DIR   # any HF checkpoint or run directory

The task is real text: for functions of a few standard-library modules, "`name` is defined in
the module" with four module names to choose from (the right one and three others). lm-eval
tokenizes through the server (`/tokenizer_info`, `/tokenize`: its remote tokenizer backend) and
scores each choice with `echo: true, logprobs: 1, max_tokens: 1`; the direct computation encodes
the same (context, continuation) pairs the way lm-eval does and sums the continuation's
log-probabilities from one forward pass. Exit status 1 if the accuracies differ or any
choice's log-likelihood differs by 0.01 or more.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODULES = ["json", "textwrap", "shutil", "statistics", "fnmatch", "base64", "heapq", "bisect"]
TASK = "glm5_stdlib_mc"


def documents(count: int) -> list[dict]:
    """Multiple-choice items: which standard-library module defines this function."""
    rng = random.Random(0)
    items = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        names = sorted(n for n, f in vars(module).items()
                       if inspect.isfunction(f) and not n.startswith("_") and f.__module__ == module_name)
        for name in names[:3]:
            others = rng.sample([m for m in MODULES if m != module_name], 3)
            choices = others + [module_name]
            rng.shuffle(choices)
            items.append({"question": f"In Python, the function {name}() is defined in the module",
                          "choices": choices, "answer": choices.index(module_name)})
    rng.shuffle(items)
    return items[:count]


TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def run_lm_eval(port: int, task_dir: Path, out_dir: Path) -> tuple[float, dict[int, list[float]]]:
    """lm_eval's accuracy and, per document, the log-likelihood of each choice it received."""
    args = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"model=bench,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=remote,"
            "num_concurrent=4,max_retries=1",
            "--tasks", TASK, "--include_path", str(task_dir), "--output_path", str(out_dir), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(args, check=True, env=env)
    results = next(out_dir.rglob("results_*.json"))
    samples = [json.loads(line) for path in out_dir.rglob(f"samples_{TASK}_*.jsonl")
               for line in path.read_text().splitlines()]
    scores = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}
    return json.loads(results.read_text())["results"][TASK]["acc,none"], scores


def direct_scores(checkpoint: str, items: list[dict]) -> list[list[float]]:
    """The same task scored from glm5_jax.forward: lm-eval's pairs (context = question,
    continuation = " " + choice; continuation tokens = encode(whole)[len(encode(context)):]),
    each choice's summed continuation log-probability."""
    import jax
    import numpy as np

    import glm5_jax
    from glm5_jax.train.runs import load_any

    config, params, tokenizer = load_any(checkpoint)
    forward = jax.jit(lambda p, ids: jax.nn.log_softmax(glm5_jax.forward(config, p, ids)))

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False).ids

    scores = []
    for item in items:
        context = encode(item["question"])
        item_scores = []
        for choice in item["choices"]:
            whole = encode(item["question"] + " " + choice)
            continuation = whole[len(context):]
            ids = np.asarray([context + continuation], np.int32)
            logprobs = np.asarray(forward(params, ids), np.float64)[0]
            picked = [logprobs[len(context) - 1 + i, t] for i, t in enumerate(continuation)]
            item_scores.append(float(sum(picked)))
        scores.append(item_scores)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--items", type=int, default=24)
    args = parser.parse_args()
    if importlib.util.find_spec("lm_eval") is None:
        sys.exit("needs lm-eval: pip install lm-eval (or pip install -e '.[eval]')")
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
    serve_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_bench)
    items = documents(args.items)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        checkpoint = args.checkpoint or ("runs/demo" if (ROOT / "runs/demo").exists() else None)
        if checkpoint is None:
            checkpoint = str(scratch / "model")
            serve_bench.make_checkpoint(Path(checkpoint))
        data = scratch / "items.jsonl"
        data.write_text("".join(json.dumps(item) + "\n" for item in items))
        (scratch / "task").mkdir()
        (scratch / "task" / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
        server = serve_bench.Server(Path(checkpoint), 512, argparse.Namespace(
            max_slots=8, serve_args=["--moe-impl", "dense"]))
        try:
            served, served_scores = run_lm_eval(server.port, scratch / "task", scratch / "out")
        finally:
            server.close()
        direct = direct_scores(checkpoint, items)
    accuracy = sum(int(max(range(4), key=s.__getitem__)) == item["answer"]
                   for s, item in zip(direct, items, strict=True)) / len(items)
    gaps = [abs(a - b) for doc, row in enumerate(direct)
            for a, b in zip(row, served_scores[doc], strict=True)]
    print(f"\n{len(items)} items x 4 choices, checkpoint {checkpoint if args.checkpoint else 'demo'}")
    print(f"lm_eval --model local-completions against serve.py: acc = {served:.4f}")
    print(f"glm5_jax.forward log-likelihoods:                  acc = {accuracy:.4f}")
    print(f"per-choice log-likelihood, served vs forward: max |diff| = {max(gaps):.2e} "
          f"(mean |loglik| {sum(abs(x) for row in direct for x in row) / len(gaps):.2f})")
    sys.exit(0 if abs(served - accuracy) < 1e-9 and max(gaps) < 1e-2 else 1)

if __name__ == "__main__":
    main()
