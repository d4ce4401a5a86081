"""Running a suite's tasks on a backend: one runner per task kind, each returning a TaskResult
(metrics with 95% intervals, per-item samples for samples.jsonl, notes).

    multiple_choice  acc, acc_norm (lm-eval's: log-likelihood / characters of the choice)
    bits_per_byte    bits_per_byte, token_perplexity (rolling windows over each document)
    code             pass@k for each k (the unbiased estimator over `samples` per problem), programs
                     run in the sandbox
    exact_match      exact_match (last number of the output), exact_match_strict (`#### N`)
    replay           rules_pass_rate, reference_exact / reference_f1, judge_score, and efficiency
                     (TTFT, TPOT, output tokens/s percentiles, throughput)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import time
from collections import Counter

import numpy as np
from tqdm import tqdm

from glm5_jax.evaluate import local_data, replay
from glm5_jax.evaluate.backend import Backend, GenerationRequest, encode_pair, rolling_windows
from glm5_jax.evaluate.formats import (
    AnswerProblem,
    CodeProblem,
    MultipleChoiceItem,
    TaskDataError,
    TextDocument,
    expand,
    read_items,
    read_text,
)
from glm5_jax.evaluate.sandbox import require_isolation, run_program
from glm5_jax.evaluate.scoring import (
    Metric,
    bootstrap,
    extract_last_number,
    extract_strict,
    pass_at_k,
    percentile,
    proportion,
    token_f1,
)
from glm5_jax.evaluate.suites import PACKAGE_DATA, Suite, SuiteError, TaskSpec

logger = logging.getLogger(__name__)
ITEM_TYPES = {
    "multiple_choice": MultipleChoiceItem,
    "bits_per_byte": TextDocument,
    "code": CodeProblem,
    "exact_match": AnswerProblem,
    "replay": replay.ReplayRecord,
}


@dataclasses.dataclass
class TaskResult:
    spec: TaskSpec
    metrics: dict[str, Metric]
    primary: str
    items: int
    seconds: float = 0.0
    samples: list[dict] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    extra: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            **self.spec.to_dict(),
            "items": self.items,
            "primary": self.primary,
            "seconds": round(self.seconds, 3),
            "metrics": {k: m.to_dict() for k, m in self.metrics.items()},
            "notes": self.notes,
            **({"extra": self.extra} if self.extra else {}),
        }


class _NoProgress(contextlib.AbstractContextManager):
    def update(self, count: int = 1) -> None:
        pass

    def __exit__(self, *exception) -> None:
        return None


def progress_bar(enabled: bool, total: int, description: str, unit: str):
    """tqdm with rate and ETA on stderr, or a stand-in that ignores updates."""
    if enabled:
        return tqdm(total=total, desc=description, unit=unit, dynamic_ncols=True, leave=True)
    return _NoProgress()


# ---------------------------------------------------------------- items
def load_items(spec: TaskSpec, suite: Suite) -> list:
    """All items of a task's source (the limit is applied by the runner)."""
    if spec.source.startswith("builtin:"):
        items = local_data.build(spec.source.removeprefix("builtin:"), suite.seed)
        if items and not isinstance(items[0], ITEM_TYPES[spec.kind]):
            raise SuiteError(
                f"task {spec.name!r}: source {spec.source!r} gives {type(items[0]).__name__} items, "
                f"not what a {spec.kind} task reads"
            )
        return items
    if spec.source.startswith("package:"):
        paths = expand(spec.source.removeprefix("package:"), PACKAGE_DATA)
    else:
        paths = expand([p.strip() for p in spec.source.split(",")], suite.directory)
    if spec.kind == "bits_per_byte":
        return read_text(paths, spec.options["text_field"])
    if spec.kind == "replay":
        return replay.read_replay(paths)
    return read_items(spec.kind, paths, spec.format)


# ---------------------------------------------------------------- basic
def run_multiple_choice(
    spec: TaskSpec, items: list[MultipleChoiceItem], backend: Backend, suite: Suite, progress: bool
) -> TaskResult:
    delimiter = spec.options["target_delimiter"]
    pairs = [
        encode_pair(backend, item.context, delimiter + choice) for item in items for choice in item.choices
    ]
    with progress_bar(progress, len(pairs), spec.name, "choice") as bar:
        scores = backend.loglikelihood(pairs, bar)
    correct, correct_norm, samples, at = [], [], [], 0
    for item in items:
        lls = np.array([score for score, _ in scores[at : at + len(item.choices)]])
        at += len(item.choices)
        lengths = np.array([float(len(choice)) for choice in item.choices])  # lm-eval: characters
        prediction, prediction_norm = int(np.argmax(lls)), int(np.argmax(lls / lengths))
        correct.append(prediction == item.gold)
        correct_norm.append(prediction_norm == item.gold)
        samples.append(
            {
                "id": item.item_id,
                "gold": item.gold,
                "prediction": prediction,
                "prediction_norm": prediction_norm,
                "loglikelihoods": [round(x, 4) for x in lls],
            }
        )
    chance = float(np.mean([1 / len(item.choices) for item in items]))
    metrics = {"acc": proportion(correct), "acc_norm": proportion(correct_norm)}
    return TaskResult(spec, metrics, "acc", len(items), samples=samples, notes=[f"chance level {chance:.3f}"])


def run_bits_per_byte(
    spec: TaskSpec, items: list[TextDocument], backend: Backend, suite: Suite, progress: bool
) -> TaskResult:
    limit = spec.options["max_document_bytes"]
    documents, pairs, owners = [], [], []
    for index, item in enumerate(items):
        text = item.text.encode("utf-8")[:limit].decode("utf-8", "ignore")
        tokens = backend.encode(text)
        documents.append((item.item_id, len(text.encode("utf-8")), len(tokens)))
        windows = rolling_windows(tokens, backend.prefix_token_id, backend.max_length)
        pairs.extend(windows)
        owners.extend([index] * len(windows))
    with progress_bar(progress, len(pairs), spec.name, "window") as bar:
        scores = backend.loglikelihood(pairs, bar)
    nats = np.zeros(len(items))
    for owner, (score, _) in zip(owners, scores, strict=True):
        nats[owner] -= score
    byte_counts = np.array([b for _, b, _ in documents], np.float64)
    token_counts = np.array([t for _, _, t in documents], np.float64)
    bits = bootstrap(nats / math.log(2), weights=byte_counts, higher_is_better=False, unit="bits/byte")
    per_token = bootstrap(nats, weights=token_counts, higher_is_better=False)
    perplexity = Metric(
        math.exp(per_token.value),
        *(math.exp(x) if x is not None else None for x in (per_token.ci_low, per_token.ci_high)),
        per_token.method,
        per_token.count,
        False,
    )
    samples = [
        {"id": doc_id, "bytes": b, "tokens": t, "bits_per_byte": n / math.log(2) / b}
        for (doc_id, b, t), n in zip(documents, nats, strict=True)
    ]
    return TaskResult(
        spec,
        {"bits_per_byte": bits, "token_perplexity": perplexity},
        "bits_per_byte",
        len(items),
        samples=samples,
        notes=[
            f"{int(byte_counts.sum())} bytes, {int(token_counts.sum())} tokens, "
            f"{len(pairs)} windows of <= {backend.max_length} tokens"
        ],
    )


# ---------------------------------------------------------------- professional
def run_code(
    spec: TaskSpec, items: list[CodeProblem], backend: Backend, suite: Suite, progress: bool
) -> TaskResult:
    options, samples_per = spec.options, spec.options["samples"]
    require_isolation(suite.sandbox)  # refuse before generating, not after
    requests = [
        GenerationRequest(
            prompt=p.prompt,
            max_tokens=options["max_tokens"],
            temperature=options["temperature"],
            top_p=options["top_p"],
            stop=options["stop"],
            seed=suite.seed + j,
        )
        for p in items
        for j in range(samples_per)
    ]
    with progress_bar(progress, len(requests), f"{spec.name} (generate)", "sample") as bar:
        completions = backend.generate(requests, bar)
    # check(...) stays the last statement: the sandbox scores passed only a program whose last
    # statement returned (its end-of-run token), so exiting early with status 0 fails.
    programs = [
        p.prompt + c.text + "\n\n" + p.test + f"\n\ncheck({p.entry_point})\n"
        for p, c in zip((p for p in items for _ in range(samples_per)), completions, strict=True)
    ]
    with (
        progress_bar(progress, len(programs), f"{spec.name} (execute)", "program") as bar,
        concurrent.futures.ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool,
    ):

        def execute(program):
            outcome = run_program(program, suite.sandbox)
            bar.update(1)
            return outcome

        outcomes = list(pool.map(execute, programs))
    passed = np.array([o.passed for o in outcomes]).reshape(len(items), samples_per)  # [problems, samples]
    metrics = {}
    for k in options["k"]:
        per_problem = [pass_at_k(samples_per, int(c), k) for c in passed.sum(axis=1)]
        metrics[f"pass@{k}"] = proportion(per_problem) if samples_per == 1 else bootstrap(per_problem)
    samples = [
        {
            "id": p.item_id,
            "sample": j,
            "completion": c.text,
            "finish_reason": c.finish_reason,
            "status": o.status,
            "error": (o.stderr.strip().splitlines() or [o.reason])[-1][:300],
        }
        for (p, j), c, o in zip(
            ((p, j) for p in items for j in range(samples_per)), completions, outcomes, strict=True
        )
    ]
    statuses = Counter(o.status for o in outcomes)
    return TaskResult(
        spec,
        metrics,
        f"pass@{options['k'][0]}",
        len(items),
        samples=samples,
        notes=[
            f"{samples_per} sample(s) per problem; programs: "
            + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
        ],
        extra={"sandbox": dataclasses.asdict(suite.sandbox)},
    )


def run_exact_match(
    spec: TaskSpec,
    items: list[AnswerProblem],
    backend: Backend,
    suite: Suite,
    progress: bool,
    shots: list[AnswerProblem] = (),
) -> TaskResult:
    options = spec.options
    try:
        prefix = "".join(
            options["shot_template"].format(question=s.question, solution=s.solution) for s in shots
        )
        prompts = [prefix + options["prompt_template"].format(question=item.question) for item in items]
    except (KeyError, IndexError) as error:
        raise SuiteError(
            f"task {spec.name!r}: prompt_template / shot_template may use {{question}} and "
            f"{{solution}} only, got {{{error.args[0]}}}"
        ) from error
    requests = [
        GenerationRequest(
            prompt=prompt, max_tokens=options["max_tokens"], temperature=0.0, stop=options["stop"]
        )
        for prompt in prompts
    ]
    with progress_bar(progress, len(requests), spec.name, "question") as bar:
        outputs = backend.generate(requests, bar)
    flexible = [extract_last_number(o.text) == item.target for item, o in zip(items, outputs, strict=True)]
    strict = [extract_strict(o.text) == item.target for item, o in zip(items, outputs, strict=True)]
    samples = [
        {
            "id": item.item_id,
            "target": item.target,
            "output": o.text,
            "extracted": extract_last_number(o.text),
        }
        for item, o in zip(items, outputs, strict=True)
    ]
    metrics = {"exact_match": proportion(flexible), "exact_match_strict": proportion(strict)}
    return TaskResult(spec, metrics, "exact_match", len(items), samples=samples, notes=[f"{len(shots)}-shot"])


# ---------------------------------------------------------------- real scenarios
def _efficiency(results, wall_seconds: float) -> dict[str, Metric]:
    done = [r for r in results if r.finish_reason != "error"]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    rate = [r.completion_tokens / r.latency_s for r in done if r.latency_s > 0 and r.completion_tokens]
    metrics = {}
    for name, values, unit, higher in (
        ("ttft", ttft, "s", False),
        ("tpot", tpot, "s", False),
        ("tokens_per_s", rate, "tokens/s", True),
    ):
        for q in (50, 90, 99):
            metrics[f"{name}_p{q}"] = percentile(values, q, unit=unit, higher_is_better=higher)
    total = sum(r.completion_tokens for r in done)
    metrics["throughput_tokens_per_s"] = Metric(
        total / wall_seconds if wall_seconds else math.nan, None, None, "none", len(done), True, "tokens/s"
    )
    return metrics


def run_replay(
    spec: TaskSpec,
    items: list[replay.ReplayRecord],
    backend: Backend,
    suite: Suite,
    progress: bool,
    judge: Backend | None = None,
) -> TaskResult:
    options = spec.options
    records = [dataclasses.replace(r, rules={**options["default_rules"], **r.rules}) for r in items]
    requests = []
    for record in records:
        request = record.request
        changes = {"seed": request.seed if request.seed is not None else suite.seed}
        if options["max_tokens"] > 0:
            changes["max_tokens"] = min(request.max_tokens, options["max_tokens"])
        if options["temperature"] >= 0:
            changes["temperature"] = options["temperature"]
        requests.append(dataclasses.replace(request, **changes))
    notes, extra = [], {}
    if options["warm_up"] and hasattr(backend, "warm_up"):
        start = time.perf_counter()
        backend.warm_up()
        notes.append(f"engine warm-up (compiling every step shape) took {time.perf_counter() - start:.1f} s")
    compiles = getattr(backend, "compile_count", None)
    start = time.perf_counter()
    with progress_bar(progress, len(requests), spec.name, "request") as bar:
        results = backend.generate(requests, bar, concurrency=options["concurrency"] or None)
    wall = time.perf_counter() - start
    if compiles is not None:
        extra["compiles_during_replay"] = backend.compile_count - compiles
    outcomes = [replay.rule_outcomes(r, result) for r, result in zip(records, results, strict=True)]
    metrics = {}
    ruled = [all(o.values()) for o in outcomes if o]
    if ruled:
        metrics["rules_pass_rate"] = proportion(ruled)
        extra["rules"] = {
            name: [sum(o[name] for o in outcomes if name in o), sum(name in o for o in outcomes)]
            for name in sorted({n for o in outcomes for n in o})
        }
    referenced = [(r, result) for r, result in zip(records, results, strict=True) if r.references]
    if referenced:
        metrics["reference_exact"] = proportion(
            [replay.reference_holds(x.text, r.references, "exact") for r, x in referenced]
        )
        metrics["reference_f1"] = bootstrap(
            [max(token_f1(x.text, ref) for ref in r.references) for r, x in referenced]
        )
    judged = {}
    wanted = replay.judge_requests(records, results, (suite.judge or {}).get("max_tokens", 32))
    if wanted and judge is None:
        notes.append(f"{len(wanted)} record(s) ask for a judge; the suite has no `judge` (skipped)")
    elif wanted:
        verdicts = judge.generate([request for _, request in wanted])
        judged = {index: replay.judge_score(v.text) for (index, _), v in zip(wanted, verdicts, strict=True)}
        scores = [s for s in judged.values() if s is not None]
        metrics["judge_score"] = bootstrap(scores)
        if len(scores) < len(judged):
            notes.append(f"the judge gave no score for {len(judged) - len(scores)} record(s)")
    metrics.update(_efficiency(results, wall))
    errors = [r.error for r in results if r.finish_reason == "error"]
    if errors:
        notes.append(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    samples = [
        {
            "id": r.record_id,
            "output": x.text,
            "finish_reason": x.finish_reason,
            "completion_tokens": x.completion_tokens,
            "ttft_s": x.ttft_s,
            "latency_s": round(x.latency_s, 4),
            "rules": o,
            "judge": judged.get(i),
        }
        for i, (r, x, o) in enumerate(zip(records, results, outcomes, strict=True))
    ]
    primary = "rules_pass_rate" if ruled else "reference_f1" if referenced else "throughput_tokens_per_s"
    return TaskResult(spec, metrics, primary, len(records), samples=samples, notes=notes, extra=extra)


# ---------------------------------------------------------------- suites
RUNNERS = {
    "multiple_choice": run_multiple_choice,
    "bits_per_byte": run_bits_per_byte,
    "code": run_code,
    "exact_match": run_exact_match,
    "replay": run_replay,
}


def task_items(spec: TaskSpec, suite: Suite) -> tuple[list, list]:
    """(items to evaluate, few-shot examples) of a task: its source read, the limit applied."""
    items, shots = load_items(spec, suite), []
    if spec.kind == "exact_match":
        shots, items = items[: spec.options["num_fewshot"]], items[spec.options["num_fewshot"] :]
    items = items[: spec.limit] if spec.limit else items
    if not items:
        raise TaskDataError(f"task {spec.name!r}: no items left to evaluate in {spec.source}")
    return items, shots


def prepare(suite: Suite) -> dict[str, tuple[list, list]]:
    """Every task's items, read before any model work so that bad data stops the run early."""
    return {spec.name: task_items(spec, suite) for spec in suite.tasks}


def run_task(
    spec: TaskSpec,
    suite: Suite,
    backend: Backend,
    progress: bool = True,
    judge: Backend | None = None,
    prepared: tuple[list, list] | None = None,
) -> TaskResult:
    """One task on the backend; prepared: its (items, shots) from `prepare` (else read now)."""
    start = time.perf_counter()
    items, shots = prepared if prepared is not None else task_items(spec, suite)
    extra = (
        {"shots": shots} if spec.kind == "exact_match" else {"judge": judge} if spec.kind == "replay" else {}
    )
    result = RUNNERS[spec.kind](spec, items, backend, suite, progress, **extra)
    result.seconds = time.perf_counter() - start
    metric = result.metrics[result.primary]
    interval = "" if metric.ci_low is None else f" [{metric.ci_low:.4f}, {metric.ci_high:.4f}]"
    logger.info(
        "%s: %s = %.4f%s (%d items, %.1f s)",
        spec.name,
        result.primary,
        metric.value,
        interval,
        result.items,
        result.seconds,
    )
    return result


def run_suite(
    suite: Suite,
    backend: Backend,
    progress: bool = True,
    judge: Backend | None = None,
    prepared: dict[str, tuple[list, list]] | None = None,
) -> list[TaskResult]:
    """Every task of the suite, in order (prepared: `prepare(suite)`, else each task reads its data
    when it starts)."""
    prepared = prepared or {}
    return [run_task(spec, suite, backend, progress, judge, prepared.get(spec.name)) for spec in suite.tasks]
