"""Real-scenario replay: recorded requests sent again, scored with the rules they carry, timed.

Records (JSONL, or a `serve.py --feedback-dir` directory):
- `{"request": {...OpenAI chat body with "messages", or completion body with "prompt"...},
   "reference": "answer" | ["answers"], "rules": {...}, "id": "..."}`: any request log;
- the feedback log's `interaction` records (docs/feedback.md); a later `feedback` record's
  `correction`, or else an answer rated >= 0.5, becomes the reference.

Rules (RULES; every one given must hold for the record to pass): finish_reason ("stop": the answer
ended on its own, not at the token limit), max_tokens (most output tokens), min_chars / max_chars,
contains / not_contains (lists of strings), starts_with, regex (re.search), format ("json",
"json_object", "number"), reference ("exact", "contains" or "f1>=0.5": against the reference),
judge (true or a criteria text: the suite's judge model scores the answer 1-10; reported as
judge_score, not part of passing).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path

from glm5_jax.evaluate.backend import GenerationRequest, GenerationResult
from glm5_jax.evaluate.formats import TaskDataError, jsonl_records
from glm5_jax.evaluate.scoring import normalize_text, token_f1

RULES = (
    "finish_reason",
    "max_tokens",
    "min_chars",
    "max_chars",
    "contains",
    "not_contains",
    "starts_with",
    "regex",
    "format",
    "reference",
    "judge",
)
FORMATS = ("json", "json_object", "number")
GOOD_RATING = 0.5
DEFAULT_MAX_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class ReplayRecord:
    record_id: str
    request: GenerationRequest
    references: tuple[str, ...] = ()
    rules: dict = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------- reading
def _sampling(body: dict, where: str, chat: bool) -> dict:
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    max_tokens = body.get("max_tokens") or (body.get("max_completion_tokens") if chat else None)
    values = {
        "max_tokens": max_tokens or DEFAULT_MAX_TOKENS,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "stop": stop,
        "seed": body.get("seed"),
    }
    for name in ("max_tokens", "temperature", "top_p"):
        if not isinstance(values[name], int | float) or isinstance(values[name], bool):
            raise TaskDataError(f"{where}: request field {name!r} must be a number, got {values[name]!r}")
    if not all(isinstance(s, str) for s in stop):
        raise TaskDataError(f"{where}: request field 'stop' must be a string or a list of strings")
    return values


def _request(body: dict, where: str) -> GenerationRequest:
    if not isinstance(body, dict):
        raise TaskDataError(f"{where}: field 'request' must be an object (an OpenAI request body)")
    if "messages" in body:
        messages = body["messages"]
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and "role" in m for m in messages)
        ):
            raise TaskDataError(
                f"{where}: request field 'messages' must be a non-empty list of {{role, content}} objects"
            )
        kwargs = body.get("chat_template_kwargs")
        return GenerationRequest(
            messages=tuple(messages), chat_template_kwargs=kwargs, **_sampling(body, where, chat=True)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise TaskDataError(
            f"{where}: request needs 'messages' (chat) or a text 'prompt' (completions); "
            "token-id prompts are not replayed"
        )
    return GenerationRequest(prompt=prompt, **_sampling(body, where, chat=False))


def check_rules(rules: dict, where: str) -> dict:
    """The rules of one record, validated (names, types)."""
    if not isinstance(rules, dict):
        raise TaskDataError(f"{where}: field 'rules' must be an object")
    for name, value in rules.items():
        if name not in RULES:
            raise TaskDataError(f"{where}: unknown rule {name!r}; known rules: {', '.join(RULES)}")
        bad = {
            "max_tokens": not isinstance(value, int),
            "min_chars": not isinstance(value, int),
            "max_chars": not isinstance(value, int),
            "contains": not (isinstance(value, list) and all(isinstance(s, str) for s in value)),
            "not_contains": not (isinstance(value, list) and all(isinstance(s, str) for s in value)),
            "format": value not in FORMATS,
            "judge": not isinstance(value, bool | str),
            "reference": not (value in ("exact", "contains") or str(value).startswith("f1>=")),
        }.get(name, not isinstance(value, str))
        if bad:
            raise TaskDataError(
                f"{where}: rule {name!r} has an invalid value {value!r} (see docs/evaluation.md)"
            )
        if name == "regex":
            try:
                re.compile(value)
            except re.error as error:
                raise TaskDataError(f"{where}: rule 'regex' is not a regular expression: {error}") from error
    return dict(rules)


def _references(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise TaskDataError(f"{where}: field 'reference' must be a string or a list of strings")
    return tuple(values)


def _interaction_records(where: str, record: dict, feedback: dict) -> list[ReplayRecord]:
    """The replayable requests of one feedback-log interaction (one per prompt)."""
    request, choices = record.get("request") or {}, record.get("choices") or []
    sampling = request.get("sampling") or {}
    if record.get("endpoint") == "chat":
        prompts = [{"messages": request.get("messages")}]
    else:
        prompts = [{"prompt": p} for p in request.get("prompts") or []]
    found = []
    for index, body in enumerate(prompts):
        if not isinstance(body.get("prompt", ""), str):
            continue  # token-id prompts are not replayed
        references = []
        for choice in choices:
            if choice.get("prompt_index", 0) != index:
                continue
            rated = feedback.get((record["id"], choice.get("index", 0)))
            if rated and rated.get("correction"):
                references.append(rated["correction"])
            elif rated and (rated.get("rating") or 0) >= GOOD_RATING and choice.get("content"):
                references.append(choice["content"])
        found.append(
            ReplayRecord(f"{record['id']}:{index}", _request({**sampling, **body}, where), tuple(references))
        )
    return found


def read_replay(paths: Sequence[Path]) -> list[ReplayRecord]:
    """Replay records from JSONL files and feedback-log directories."""
    lines = []
    for path in paths:
        files = sorted(path.glob("feedback-*.jsonl")) if path.is_dir() else [path]
        for file in files:
            lines.extend(jsonl_records(file))
    feedback = {(r["id"], r.get("index", 0)): r for _, r in lines if r.get("type") == "feedback"}
    records = []
    for where, record in lines:
        if record.get("type") == "feedback":
            continue
        if record.get("type") == "interaction":
            records.extend(_interaction_records(where, record, feedback))
            continue
        if "request" not in record:
            raise TaskDataError(f"{where}: missing field 'request' (or a feedback-log 'type')")
        records.append(
            ReplayRecord(
                str(record.get("id", where)),
                _request(record["request"], where),
                _references(record.get("reference"), where),
                check_rules(record.get("rules") or {}, where),
            )
        )
    if not records:
        raise TaskDataError(f"{', '.join(map(str, paths))}: no replayable requests")
    return records


# ---------------------------------------------------------------- scoring
def _format_holds(text: str, kind: str) -> bool:
    text = text.strip()
    if kind == "number":
        return re.fullmatch(r"-?[\d,]*\.?\d+", text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return kind == "json" or isinstance(value, dict)


def reference_holds(text: str, references: tuple[str, ...], how: str) -> bool:
    if not references:
        return False
    if how == "exact":
        return any(normalize_text(text) == normalize_text(r) for r in references)
    if how == "contains":
        return any(normalize_text(r) in normalize_text(text) for r in references)
    return max(token_f1(text, r) for r in references) >= float(how.removeprefix("f1>="))


def rule_outcomes(record: ReplayRecord, result: GenerationResult) -> dict[str, bool]:
    """Whether each of the record's rules holds for this answer (the judge rule is scored apart)."""
    rules, text = record.rules, result.text
    checks = {
        "finish_reason": lambda v: result.finish_reason == v,
        "max_tokens": lambda v: result.completion_tokens <= v,
        "min_chars": lambda v: len(text) >= v,
        "max_chars": lambda v: len(text) <= v,
        "contains": lambda v: all(s in text for s in v),
        "not_contains": lambda v: not any(s in text for s in v),
        "starts_with": lambda v: text.lstrip().startswith(v),
        "regex": lambda v: re.search(v, text) is not None,
        "format": lambda v: _format_holds(text, v),
        "reference": lambda v: reference_holds(text, record.references, v),
    }
    return {
        name: bool(checks[name](value)) and result.finish_reason != "error"
        for name, value in rules.items()
        if name in checks
    }


# ---------------------------------------------------------------- judge
JUDGE_PROMPT = """You grade an AI assistant's answer to a request.

[Request]
{request}
{reference}
[Answer]
{answer}

Criteria: {criteria}
Reply with "Score: N", N an integer from 1 (useless or wrong) to 10 (perfect)."""


def judge_requests(
    records: Sequence[ReplayRecord], results: Sequence[GenerationResult], max_tokens: int = 32
) -> list[tuple[int, GenerationRequest]]:
    """(record index, chat request for the judge) for the records with a judge rule."""
    requests = []
    for index, (record, result) in enumerate(zip(records, results, strict=True)):
        criteria = record.rules.get("judge")
        if not criteria:
            continue
        asked = record.request.prompt or "\n".join(
            f"{m.get('role')}: {m.get('content')}" for m in record.request.messages
        )
        reference = f"\n[Reference answer]\n{record.references[0]}\n" if record.references else ""
        text = JUDGE_PROMPT.format(
            request=asked,
            reference=reference,
            answer=result.text,
            criteria=criteria if isinstance(criteria, str) else "correct, helpful and clear",
        )
        requests.append(
            (
                index,
                GenerationRequest(
                    messages=({"role": "user", "content": text},),
                    max_tokens=max_tokens,
                    temperature=0.0,
                    chat_template_kwargs={"enable_thinking": False},
                ),
            )
        )
    return requests


def judge_score(text: str) -> float | None:
    """The judge's "Score: N" (or first integer 1-10) mapped to [0, 1]; None when it gave none."""
    found = re.search(r"[Ss]core\s*[:=]?\s*(\d+)", text) or re.search(r"\b(10|[1-9])\b", text)
    if not found or not 1 <= int(found.group(1)) <= 10:
        return None
    return (int(found.group(1)) - 1) / 9
