"""Verifiable rewards: each verifier maps (task, completion) to a score, `make_rewards` combines
them as `config.rewards` lists them:

    [{"kind": "arithmetic", "weight": 1.0},
     {"kind": "code", "weight": 1.0, "timeout_s": 5.0, "memory_mb": 512},
     {"kind": "json_schema"},
     {"kind": "python", "function": "my_rewards.py:brevity", "weight": 0.1, "name": "brevity"}]

    arithmetic   tasks of kind "arithmetic": 1 when the answer is exactly the integer (or ends
                 GSM8K style "... #### 42" with exactly it), else 0
    code         tasks of kind "code": 1 when the sandboxed program (glm5_jax/evaluate/sandbox.py)
                 code_prompt + the completion's code + test + `check(entry_point)` runs to its end
                 (an early sys.exit(0) / os._exit(0) scores 0: the sandbox's end-of-run token)
    json_schema  tasks of kind "json": 1 when the answer parses as JSON and validates against the
                 task's schema (the `jsonschema` package)
    python       every task: `fn(task: dict, completion: str) -> float` from "path/file.py:name" or
                 "package.module:name"

Every entry takes "weight" (default 1.0) and "name" (default its kind); code takes the sandbox
limits (timeout_s, memory_mb, max_processes, allow_unsandboxed). A completion's total is the sum of
weight * part over the verifiers that apply to its task.

The built-in verifiers score the completion's answer (`answer_text`): the text after the thinking
block; a completion cut inside its reasoning has no answer and scores 0. The python function gets
the whole completion (it may call `answer_text` itself).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import numbers
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from glm5_jax.chat.reasoning import THINK_END, THINK_START
from glm5_jax.evaluate.sandbox import SandboxLimits, require_isolation, run_program
from glm5_jax.rl.tasks import RLTask

END_TEXTS = ("<|endoftext|>", "<|user|>", "<|observation|>")  # GLM-5's stop tokens, if decoded
_INTEGER = re.compile(r"[-+]?(?:\d+|\d{1,3}(?:,\d{3})+)")
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
SPEC_KINDS = ("arithmetic", "code", "json_schema", "python")
_APPLIES = {"arithmetic": "arithmetic", "code": "code", "json_schema": "json"}  # verifier -> task kind
_LIMIT_FIELDS = ("timeout_s", "memory_mb", "max_processes", "allow_unsandboxed")


# ---------------------------------------------------------------- the answer
def _after_reasoning(completion: str) -> str | None:
    """The text after `</think>`, None when the completion opened a thinking block it never closed,
    else the whole text; trailing stop-token text (END_TEXTS) and whitespace removed."""
    end = completion.find(THINK_END)
    if end >= 0:
        text = completion[end + len(THINK_END):]
    elif completion.lstrip().startswith(THINK_START):
        return None
    else:
        text = completion
    text = text.rstrip()
    while text.endswith(END_TEXTS):
        text = text[: -len(next(e for e in END_TEXTS if text.endswith(e)))].rstrip()
    return text


def answer_text(completion: str) -> str | None:
    """The completion's answer: the text after `</think>` when it has one (the reasoning removed),
    None when it opened a thinking block it never closed (cut inside the reasoning: no answer),
    else the whole text; stripped, trailing stop-token text (END_TEXTS) removed. A completion whose
    prompt opened the thinking block is passed with `<think>` in front (Rewards.score does that)."""
    text = _after_reasoning(completion)
    return None if text is None else text.strip()


def _integer(text: str) -> int | None:
    return int(text.replace(",", "")) if _INTEGER.fullmatch(text) else None


# ---------------------------------------------------------------- verifiers
def arithmetic(task: RLTask, completion: str) -> float:
    """1.0 when the whole answer is the integer `task.answer` ("42", "-3", "1,000"), or the text
    after its last "####" is; else 0.0 ("19 20 21", "19 or 20", "the answer is 19" score 0)."""
    answer = answer_text(completion)
    if answer is None:
        return 0.0
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip()
    value = _integer(answer)
    return float(value is not None and value == int(task.answer))


def completion_code(completion: str) -> str:
    """The code of an answer: the content of its first ```python fenced block, else its text."""
    match = _FENCE.search(completion)
    return match.group(1) if match else completion


def code_program(task: RLTask, completion: str) -> str | None:
    """The program a code task runs for a completion (None: no answer). check(...) stays the last
    statement: the sandbox passes only a program whose last statement returned."""
    answer = _after_reasoning(completion)  # not stripped: an unfenced body keeps its indentation
    if answer is None:
        return None
    test = task.test + f"\n\ncheck({task.entry_point})\n"
    return task.code_prompt + completion_code(answer) + "\n\n" + test


def code(task: RLTask, completion: str, limits: SandboxLimits | None = None) -> float:
    """1.0 when the completion's program passes in the sandbox (default limits: SandboxLimits()),
    else 0.0."""
    program = code_program(task, completion)
    return float(program is not None and run_program(program, limits or SandboxLimits()).passed)


def json_schema(task: RLTask, completion: str) -> float:
    """1.0 when the answer (or its ```json fenced block) is JSON valid against task.schema."""
    import jsonschema  # the `test` extra; only needed where JSON tasks are scored

    answer = answer_text(completion)
    if answer is None:
        return 0.0
    fenced = re.fullmatch(r"```(?:json)?[ \t]*\n(.*?)```", answer, re.DOTALL)
    try:
        value = json.loads(fenced.group(1) if fenced else answer)
    except (json.JSONDecodeError, RecursionError):
        return 0.0
    return float(jsonschema.Draft202012Validator(json.loads(task.schema)).is_valid(value))


def load_function(reference: str) -> Callable:
    """The function "path/to/file.py:name" or "package.module:name" names; ValueError naming what
    is missing."""
    location, _, name = reference.rpartition(":")
    if not location or not name:
        raise ValueError(f"reward function {reference!r} must be 'path/to/file.py:name' or "
                         "'package.module:name'")
    if location.endswith(".py") or "/" in location or os.sep in location:
        path = Path(location).expanduser()
        if not path.is_file():
            raise ValueError(f"reward function {reference!r}: file {str(path)!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"_glm5_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise ValueError(
                f"reward function {reference!r}: cannot import module {location!r} ({error})"
            ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"reward function {reference!r}: {location!r} has no function {name!r}")
    return function


def python_reward(function: Callable, reference: str) -> Callable[[RLTask, str], float]:
    """A verifier calling the user's `function(task: dict, completion: str)`; a non-number or
    non-finite return is a ValueError naming the function and the task."""

    def verifier(task: RLTask, completion: str) -> float:
        value = function(task.to_dict(), completion)
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise ValueError(f"reward function {reference!r} returned {value!r} for task {task.task_id!r}; "
                             "it must return a finite number")
        return float(value)

    return verifier


# ---------------------------------------------------------------- combining them
@dataclasses.dataclass(frozen=True)
class Reward:
    """One completion's reward: total = sum of weight * part over the verifiers that applied;
    parts by verifier name."""

    total: float
    parts: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Verifier:
    name: str
    kind: str  # one of SPEC_KINDS
    weight: float
    function: Callable[[RLTask, str], float]

    def applies(self, task: RLTask) -> bool:
        return self.kind == "python" or _APPLIES[self.kind] == task.kind


class Rewards:
    """The verifiers of config.rewards: `score` completions, `summary` their means for the log."""

    def __init__(self, verifiers: Sequence[Verifier]):
        self.verifiers = tuple(verifiers)
        self.names = tuple(v.name for v in self.verifiers)

    def score(
        self, tasks: Sequence[RLTask], completions: Sequence[str], in_reasoning: bool = False
    ) -> list[Reward]:
        """One Reward per (task, completion). in_reasoning: the prompts opened the thinking block
        (the generation prompt ends `<think>`), so the completions start inside it. Code programs
        run min(4, cpus) at a time; everything else inline. ValueError for a task no verifier
        applies to (its reward would always be 0)."""
        if len(tasks) != len(completions):
            raise ValueError(f"{len(tasks)} tasks but {len(completions)} completions")
        if in_reasoning:
            completions = [c if c.lstrip().startswith(THINK_START) else THINK_START + c for c in completions]
        jobs = []  # (completion index, verifier)
        for index, task in enumerate(tasks):
            applying = [v for v in self.verifiers if v.applies(task)]
            if not applying:
                raise ValueError(f"no reward in config.rewards ({', '.join(self.names)}) applies to task "
                                 f"{task.task_id!r} of kind {task.kind!r}")
            jobs.extend((index, v) for v in applying)
        parts = [{} for _ in tasks]
        sandboxed = [(i, v) for i, v in jobs if v.kind == "code"]
        workers = min(4, os.cpu_count() or 1)  # as glm5_jax/evaluate/tasks.py::run_code
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(v.function, tasks[i], completions[i]) for i, v in sandboxed]
            for i, v in jobs:
                if v.kind != "code":
                    try:
                        parts[i][v.name] = v.function(tasks[i], completions[i])
                    except Exception as error:
                        error.add_note(f"in reward {v.name!r} on task {tasks[i].task_id!r}")
                        raise
            for (i, v), future in zip(sandboxed, futures, strict=True):
                parts[i][v.name] = future.result()
        weights = {v.name: v.weight for v in self.verifiers}
        ordered = [{name: p[name] for name in self.names if name in p} for p in parts]
        return [Reward(sum(weights[n] * value for n, value in p.items()), p) for p in ordered]

    def summary(self, rewards: Sequence[Reward]) -> dict[str, float]:
        """`summary(rewards)`, the names in this config's order."""
        values = summary(rewards)
        keys = ("reward/mean", *(f"reward/{name}" for name in self.names))
        return {key: values[key] for key in keys if key in values}


def summary(rewards: Sequence[Reward]) -> dict[str, float]:
    """reward/mean (of the totals) and reward/<name>: the mean part over the completions each
    verifier applied to (the names the parts hold); {} for no rewards."""
    if not rewards:
        return {}
    values = {"reward/mean": sum(r.total for r in rewards) / len(rewards)}
    for name in dict.fromkeys(name for r in rewards for name in r.parts):
        scored = [r.parts[name] for r in rewards if name in r.parts]
        values[f"reward/{name}"] = sum(scored) / len(scored)
    return values


def _verifier(entry: dict, where: str) -> Verifier:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a dict with a 'kind', got {entry!r}")
    kind = entry.get("kind")
    if kind not in SPEC_KINDS:
        raise ValueError(f"{where}: field 'kind' must be one of {SPEC_KINDS}, got {kind!r}")
    allowed = {"kind", "weight", "name"} | ({"function"} if kind == "python" else set())
    allowed |= set(_LIMIT_FIELDS) if kind == "code" else set()
    for field in entry:
        if field not in allowed:
            raise ValueError(
                f"{where}: unknown field {field!r} for a {kind} reward (known: {sorted(allowed)})"
            )
    weight = entry.get("weight", 1.0)
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not math.isfinite(weight):
        raise ValueError(f"{where}: field 'weight' must be a finite number, got {weight!r}")
    name = entry.get("name", kind)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: field 'name' must be a non-empty string, got {name!r}")
    if kind == "code":
        try:
            limits = SandboxLimits(**{f: entry[f] for f in _LIMIT_FIELDS if f in entry})
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from None
        require_isolation(limits)  # refuse before any rollout, not after
        function = functools.partial(code, limits=limits)
    elif kind == "python":
        if not isinstance(entry.get("function"), str):
            raise ValueError(f"{where}: field 'function' ('path/file.py:name' or 'module:name') is required")
        function = python_reward(load_function(entry["function"]), entry["function"])
    else:
        function = arithmetic if kind == "arithmetic" else json_schema
    return Verifier(name, kind, float(weight), function)


def make_rewards(specs: Sequence[dict]) -> Rewards:
    """Rewards from config.rewards (see the module docstring); ValueError naming the entry and the
    field at fault."""
    if isinstance(specs, dict | str) or not specs:
        raise ValueError(f"config.rewards must be a non-empty list of reward dicts, got {specs!r}")
    verifiers = [_verifier(entry, f"config.rewards[{index}]") for index, entry in enumerate(specs)]
    names = [v.name for v in verifiers]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise ValueError(f"config.rewards[{index}]: field 'name' {name!r} repeats an earlier entry's "
                             "(give each a distinct name)")
    return Rewards(verifiers)
