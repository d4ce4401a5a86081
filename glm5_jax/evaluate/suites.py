"""Evaluation suites: ml_collections config files (`configs/eval/<name>.py`) naming tasks and data.

    def get_config():
        config = ml_collections.ConfigDict()
        config.name = "local"
        config.max_length = 256            # tokens per log-likelihood row
        config.batch_size = 8              # rows per log-likelihood batch
        config.engine = dict(max_slots=8, max_context=1024)        # in-process generation
        config.sandbox = dict(timeout_s=5.0, memory_mb=512)        # code execution
        config.tasks = [dict(name="modules", kind="multiple_choice", source="builtin:stdlib_modules",
                             limit=48), ...]
        return config

A task: `name`, `kind` (KINDS), `source` ("builtin:<set>" from glm5_jax/evaluate/local_data.py,
"package:<file>" shipped in glm5_jax/evaluate/data/, or file paths / globs, relative to the suite
file first), optional `format` (glm5_jax/evaluate/formats.py), `limit` (first N items), `dimension`
(default by kind) and the kind's own options (KINDS below, with their defaults).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from glm5_jax.evaluate.inprocess import EngineSettings
from glm5_jax.evaluate.sandbox import SandboxLimits
from glm5_jax.model.config import ConfigError
from glm5_jax.pyconfig import load_config_file

SUITE_DIR = Path(__file__).resolve().parents[2] / "configs" / "eval"
PACKAGE_DATA = Path(__file__).resolve().parent / "data"
DIMENSIONS = ("basic", "professional", "real_scenarios")
# HumanEval's stop sequences: a new top-level statement ends the function.
CODE_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n@")

# kind -> (default dimension, options with their defaults)
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "multiple_choice": ("basic", {"target_delimiter": " "}),
    "bits_per_byte": ("basic", {"max_document_bytes": 4000, "text_field": "text"}),
    "code": (
        "professional",
        {"samples": 1, "k": (1,), "temperature": 0.0, "top_p": 0.95, "max_tokens": 256, "stop": CODE_STOP},
    ),
    "exact_match": (
        "professional",
        {
            "num_fewshot": 0,
            "max_tokens": 64,
            "stop": ("\n\n", "Question:"),
            "prompt_template": "Question: {question}\nAnswer:",
            "shot_template": "Question: {question}\nAnswer: {solution}\n\n",
        },
    ),
    "replay": (
        "real_scenarios",
        {"max_tokens": 0, "temperature": -1.0, "concurrency": 0, "warm_up": True, "default_rules": {}},
    ),
}
COMMON_FIELDS = ("name", "kind", "dimension", "source", "format", "limit")
SUITE_FIELDS = (
    "name",
    "description",
    "seed",
    "max_length",
    "batch_size",
    "engine",
    "sandbox",
    "judge",
    "tasks",
)
JUDGE_FIELDS = ("url", "model", "api_key_env", "max_tokens")


class SuiteError(ConfigError):
    """A suite file or one of its tasks is invalid; the message names the file, task and field."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str
    dimension: str
    source: str
    format: str | None
    limit: int | None
    options: dict

    def to_dict(self) -> dict:
        """The task as a suite file states it: its fields, the options inline."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        return {**fields, **self.options}


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    path: str | None
    tasks: tuple[TaskSpec, ...]
    description: str = ""
    seed: int = 0
    max_length: int = 256
    batch_size: int = 8
    engine: EngineSettings = EngineSettings()
    sandbox: SandboxLimits = SandboxLimits()
    judge: dict | None = None

    @property
    def directory(self) -> Path | None:
        return Path(self.path).parent if self.path else None

    def limited(self, limit: int | None) -> Suite:
        """Every task capped at `limit` items (the command line's --limit)."""
        if limit is None:
            return self
        tasks = tuple(dataclasses.replace(t, limit=min(limit, t.limit or limit)) for t in self.tasks)
        return dataclasses.replace(self, tasks=tasks)

    def to_dict(self) -> dict:
        """The suite as a JSON-able dict (nested settings as dicts, tasks by `TaskSpec.to_dict`)."""
        return {**dataclasses.asdict(self), "tasks": [t.to_dict() for t in self.tasks]}


def resolve_suite_path(name_or_path: str | os.PathLike) -> Path:
    """A suite name (configs/eval/<name>.py, in the working directory or next to this package) or a path."""
    text = str(name_or_path)
    if text.endswith(".py"):
        candidates = [Path(text)]
    else:
        candidates = [Path("configs/eval") / f"{text}.py", SUITE_DIR / f"{text}.py"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in SUITE_DIR.glob("*.py")) if SUITE_DIR.is_dir() else []
    raise SuiteError(
        f"suite {text!r} not found (looked for {', '.join(map(str, candidates))}); "
        f"give a suite file path or a name in configs/eval/ ({', '.join(known) or 'none found'})"
    )


def _plain(value):
    return value.to_dict() if hasattr(value, "to_dict") else value


def _section(raw: dict, name: str, cls, where: str):
    values = _plain(raw.get(name)) or {}
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise SuiteError(f"{where}: unknown field(s) {unknown} in {name!r}; known: {known}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise SuiteError(f"{where}: {name}: {error}") from error


def task_spec(values: dict, where: str) -> TaskSpec:
    """One task entry, validated: every problem names `where` (file and task) and the field."""
    values = dict(_plain(values))
    for required in ("name", "kind", "source"):
        if not isinstance(values.get(required), str) or not values[required]:
            raise SuiteError(f"{where}: field {required!r} is required (a non-empty string)")
    kind = values["kind"]
    if kind not in KINDS:
        raise SuiteError(f"{where}: field 'kind' is {kind!r}; known kinds: {', '.join(KINDS)}")
    dimension, defaults = KINDS[kind]
    unknown = sorted(set(values) - set(COMMON_FIELDS) - set(defaults))
    if unknown:
        raise SuiteError(
            f"{where}: unknown field(s) {unknown} for a {kind} task; known: "
            f"{sorted(COMMON_FIELDS + tuple(defaults))}"
        )
    dimension = values.get("dimension", dimension)
    if dimension not in DIMENSIONS:
        raise SuiteError(f"{where}: field 'dimension' is {dimension!r}; known: {', '.join(DIMENSIONS)}")
    limit = values.get("limit")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise SuiteError(f"{where}: field 'limit' must be a positive integer, got {limit!r}")
    options = {}
    for option, default in defaults.items():
        value = _plain(values.get(option, default))
        if isinstance(default, tuple) and isinstance(value, list | tuple):
            value = tuple(value)
        expected = type(default)
        if not isinstance(value, expected) or isinstance(value, bool) != isinstance(default, bool):
            if not (expected is float and isinstance(value, int) and not isinstance(value, bool)):
                raise SuiteError(
                    f"{where}: field {option!r} must be {expected.__name__} (like {default!r}), got {value!r}"
                )
        options[option] = value
    if kind == "code" and any(k > options["samples"] or k < 1 for k in options["k"]):
        raise SuiteError(
            f"{where}: field 'k' must be between 1 and 'samples' ({options['samples']}), got {options['k']}"
        )
    return TaskSpec(values["name"], kind, dimension, values["source"], values.get("format"), limit, options)


def suite_from_config(raw, path: str | None = None) -> Suite:
    """A Suite from a get_config() result (ConfigDict or dict); path: its file, for messages and
    for resolving relative data paths."""
    raw = dict(_plain(raw))
    where = f"suite {path or '<config>'}"
    unknown = sorted(set(raw) - set(SUITE_FIELDS))
    if unknown:
        raise SuiteError(f"{where}: unknown field(s) {unknown}; known: {list(SUITE_FIELDS)}")
    entries = raw.get("tasks")
    if not isinstance(entries, list | tuple) or not entries:
        raise SuiteError(f"{where}: field 'tasks' must be a non-empty list of task dicts")
    tasks = tuple(
        task_spec(entry, f"{where}: tasks[{i}] ({_plain(entry).get('name', '?')})")
        for i, entry in enumerate(entries)
    )
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise SuiteError(f"{where}: task names must be unique, got {names}")
    judge = _plain(raw.get("judge")) or None
    if judge is not None and (set(judge) - set(JUDGE_FIELDS) or not judge.get("url")):
        raise SuiteError(f"{where}: 'judge' takes {list(JUDGE_FIELDS)} and needs 'url', got {judge}")
    return Suite(
        name=raw.get("name") or (Path(path).stem if path else "suite"),
        path=path,
        tasks=tasks,
        description=raw.get("description", ""),
        seed=raw.get("seed", 0),
        max_length=raw.get("max_length", 256),
        batch_size=raw.get("batch_size", 8),
        engine=_section(raw, "engine", EngineSettings, where),
        sandbox=_section(raw, "sandbox", SandboxLimits, where),
        judge=judge,
    )


def load_suite(name_or_path: str | os.PathLike) -> Suite:
    path = resolve_suite_path(name_or_path)
    try:
        raw = load_config_file(path)
    except ConfigError:
        raise
    except Exception as error:  # the file's own code failed
        raise SuiteError(f"suite {path}: get_config() failed: {type(error).__name__}: {error}") from error
    return suite_from_config(raw, str(path))
