"""RL tasks: a chat prompt plus what its verifier needs (glm5_jax/rl/rewards.py), and the task sets.

`load_tasks(spec, seed)` returns (train, held_out) for one spec:

    {"kind": "arithmetic", "count": 2000, "held_out": 200, "max_operand": 20, "ops": "+-"}
        "What is 7 + 12? Answer with the number only."; operands in [0, max_operand], ops from
        "+-*"; every question is distinct, so the held-out questions never appear in train
    {"kind": "stdlib_code", "held_out_fraction": 0.2}
        the standard library's doctest problems (glm5_jax/evaluate/local_data.stdlib_doctests):
        complete a function from its header and docstring; the test runs the docstring's examples
    {"kind": "json", "count": 500, "held_out": 100}
        "Give a JSON object with fields name (string) and age (integer) for Ada, who is 36 years
        old. Answer with the JSON only."; the schema pins the two values (const), so only the
        right object validates
    {"kind": "jsonl", "path": "tasks.jsonl", "held_out_path": "eval.jsonl"}
        user tasks, one RLTask dict per line (`RLTask.from_dict`); without held_out_path,
        "held_out_fraction" (default 0.1) splits them by prompt text

The wording of each templated set is fixed: a small model (the 10M-parameter demo) can learn one
format. The same spec and seed give the same tasks. `write_sft_set` writes the tasks' reference
answers as chat_jsonl conversations (glm5_jax/data/chat.py) for the SFT warm-up before GRPO.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from glm5_jax.data.sources import json_objects
from glm5_jax.evaluate.local_data import stdlib_doctests

KINDS = ("arithmetic", "code", "json")  # what the built-in verifiers check (user tasks may add more)
SPEC_KINDS = ("arithmetic", "stdlib_code", "json", "jsonl")
OPS = "+-*"
_STRING_FIELDS = ("task_id", "kind", "answer", "code_prompt", "test", "entry_point", "schema", "reference")
_NAMES = ("Ada", "Alan", "Grace", "Linus", "Ken", "Barbara", "Edsger", "Donald", "Margaret", "Dennis",
          "Frances", "John", "Radia", "Tim", "Hedy", "Guido", "Niklaus", "Sophie", "Leslie", "Claude")


@dataclasses.dataclass(frozen=True)
class RLTask:
    """One prompt and its verifier data.

    messages: the chat prompt (OpenAI-style, a user turn), rendered with the chat template and a
    generation prompt. Verifier data by kind: arithmetic `answer` (the exact integer as text);
    code `code_prompt`, `test`, `entry_point` (the program run is code_prompt + the completion's
    code + test + `check(entry_point)`); json `schema` (a JSON schema as text). reference: a correct
    completion (SFT data; empty when there is none).
    """

    task_id: str
    kind: str
    messages: tuple[dict, ...]
    answer: str = ""
    code_prompt: str = ""
    test: str = ""
    entry_point: str = ""
    schema: str = ""
    reference: str = ""

    @property
    def prompt_text(self) -> str:
        """The text of the prompt's messages (what held-out disjointness is checked on)."""
        return "\n".join(str(m.get("content", "")) for m in self.messages)

    def to_dict(self) -> dict:
        """JSON-serialisable (`RLTask.from_dict` rebuilds it)."""
        values = dataclasses.asdict(self)
        values["messages"] = [dict(m) for m in self.messages]
        return values

    @classmethod
    def from_dict(cls, record: dict, where: str = "task") -> RLTask:
        """Rebuilds a task from `to_dict`/`dataclasses.asdict` output or a user's JSONL line; raises
        ValueError naming `where` and the field at fault."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} (an RLTask has {sorted(known)})")
        for name in ("task_id", "kind", "messages"):
            if name not in record:
                raise ValueError(f"{where}: missing field {name!r}")
        for name in _STRING_FIELDS:
            if name in record and not isinstance(record[name], str):
                got = type(record[name]).__name__
                raise ValueError(f"{where}: field {name!r} must be a string, got {got}")
        if not record["task_id"] or not record["kind"]:
            raise ValueError(f"{where}: fields 'task_id' and 'kind' must not be empty")
        messages = record["messages"]
        if not isinstance(messages, list | tuple) or not messages:
            raise ValueError(f"{where}: field 'messages' must be a non-empty list of messages")
        for index, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"{where}: field 'messages' [{index}] must be an object with string "
                                 "'role' and 'content'")
        _check_verifier_fields(record, where)
        return cls(**{**record, "messages": tuple(dict(m) for m in messages)})


def _check_verifier_fields(record: dict, where: str) -> None:
    kind = record["kind"]
    if kind == "arithmetic" and not _is_integer(record.get("answer", "")):
        raise ValueError(f"{where}: field 'answer' must be an integer for an arithmetic task, "
                         f"got {record.get('answer', '')!r}")
    if kind == "code":
        for name in ("test", "entry_point"):
            if not record.get(name):
                raise ValueError(f"{where}: field {name!r} is required for a code task")
    if kind == "json":
        try:
            schema = json.loads(record.get("schema", ""))
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: field 'schema' must be a JSON schema as text ({error.msg})") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"{where}: field 'schema' must be a JSON object (a schema)")


def _is_integer(text: str) -> bool:
    try:
        int(text.strip())
    except ValueError:
        return False
    return text.strip() != ""


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def _option(spec: dict, name: str, default, kind: type | tuple):
    value = spec.get(name, default)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"task spec {spec.get('kind')!r}: field {name!r} must be "
                         f"{getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _check_fields(spec: dict, allowed: Iterable[str]) -> None:
    extra = sorted(set(spec) - {"kind", *allowed})
    if extra:
        raise ValueError(f"task spec {spec['kind']!r}: unknown field {extra[0]!r} "
                         f"(known: {sorted(allowed)})")


# ---------------------------------------------------------------- templated arithmetic
def arithmetic_tasks(spec: dict, seed: int) -> tuple[list[RLTask], list[RLTask]]:
    """`count` + `held_out` distinct questions `a op b`, a and b in [0, max_operand]."""
    _check_fields(spec, ("count", "held_out", "max_operand", "ops"))
    count = _option(spec, "count", 2000, int)
    held_out = _option(spec, "held_out", 200, int)
    max_operand = _option(spec, "max_operand", 20, int)
    ops = _option(spec, "ops", "+-", str)
    if not ops or any(op not in OPS for op in ops) or len(set(ops)) != len(ops):
        raise ValueError(
            f"task spec 'arithmetic': field 'ops' must be distinct characters of {OPS!r}, got {ops!r}"
        )
    if count < 0 or held_out < 0 or max_operand < 1:
        raise ValueError("task spec 'arithmetic': count and held_out must be >= 0 and max_operand >= 1")
    side = max_operand + 1
    space = side * side * len(ops)
    if count + held_out > space:
        raise ValueError(f"task spec 'arithmetic': count + held_out = {count + held_out} exceeds the "
                         f"{space} distinct questions of max_operand={max_operand}, ops={ops!r}")
    tasks = []
    for index in random.Random(seed).sample(range(space), count + held_out):  # distinct questions
        op, rest = ops[index // (side * side)], index % (side * side)
        a, b = divmod(rest, side)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        tasks.append(RLTask(
            task_id=f"arithmetic:{a}{op}{b}",
            kind="arithmetic",
            messages=_user(f"What is {a} {op} {b}? Answer with the number only."),
            answer=str(value),
            reference=str(value),
        ))
    return tasks[held_out:], tasks[:held_out]


# ---------------------------------------------------------------- stdlib code
CODE_INSTRUCTION = ("Complete the body of this Python function. Answer with the body only, in a "
                    "```python block.\n\n```python\n{prompt}```")


def stdlib_code_tasks(spec: dict, seed: int) -> tuple[list[RLTask], list[RLTask]]:
    """The stdlib doctest problems (seeded order); the first `held_out_fraction` are held out."""
    _check_fields(spec, ("held_out_fraction",))
    fraction = _option(spec, "held_out_fraction", 0.2, (int, float))
    if not 0 <= fraction < 1:
        raise ValueError(
            f"task spec 'stdlib_code': field 'held_out_fraction' must be in [0, 1), got {fraction}"
        )
    tasks = [
        RLTask(
            task_id=f"stdlib_code:{p.item_id}",
            kind="code",
            messages=_user(CODE_INSTRUCTION.format(prompt=p.prompt)),
            code_prompt=p.prompt,
            test=p.test,
            entry_point=p.entry_point,
            # fenced: the chat template strips an answer's text, which would lose the indentation
            reference=f"```python\n{p.canonical_solution}```",
        )
        for p in stdlib_doctests(seed)
    ]
    held = max(1, round(fraction * len(tasks))) if fraction > 0 else 0
    return tasks[held:], tasks[:held]


# ---------------------------------------------------------------- templated JSON
def json_tasks(spec: dict, seed: int) -> tuple[list[RLTask], list[RLTask]]:
    """`count` + `held_out` distinct (name, age) pairs; the schema requires exactly those values."""
    _check_fields(spec, ("count", "held_out"))
    count = _option(spec, "count", 500, int)
    held_out = _option(spec, "held_out", 100, int)
    ages = range(1, 100)
    space = len(_NAMES) * len(ages)
    if count < 0 or held_out < 0 or count + held_out > space:
        raise ValueError(f"task spec 'json': count and held_out must be >= 0 with a sum of at most {space}")
    tasks = []
    for index in random.Random(seed).sample(range(space), count + held_out):
        name, age = _NAMES[index // len(ages)], ages[index % len(ages)]
        schema = {
            "type": "object",
            "properties": {
                "name": {"type": "string", "const": name},
                "age": {"type": "integer", "const": age},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        }
        tasks.append(RLTask(
            task_id=f"json:{name}-{age}",
            kind="json",
            messages=_user(f"Give a JSON object with fields name (string) and age (integer) for {name}, "
                           f"who is {age} years old. Answer with the JSON only."),
            schema=json.dumps(schema),
            reference=json.dumps({"name": name, "age": age}),
        ))
    return tasks[held_out:], tasks[:held_out]


# ---------------------------------------------------------------- user JSONL
def read_tasks(path: str | Path) -> list[RLTask]:
    """One RLTask dict per non-blank line; ValueError naming the file, line and field."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"task file {str(path)!r} does not exist")
    with open(path, encoding="utf-8") as handle:
        records = json_objects(enumerate(handle, 1), str(path), ValueError)
        tasks = [RLTask.from_dict(record, where) for where, record in records]
    if not tasks:
        raise ValueError(f"task file {str(path)!r} holds no tasks")
    return tasks


def jsonl_tasks(spec: dict, seed: int) -> tuple[list[RLTask], list[RLTask]]:
    _check_fields(spec, ("path", "held_out_path", "held_out_fraction"))
    if not isinstance(spec.get("path"), str):
        raise ValueError("task spec 'jsonl': field 'path' (a JSONL file of RLTask dicts) is required")
    tasks = read_tasks(spec["path"])
    if "held_out_path" in spec:
        held_out = read_tasks(_option(spec, "held_out_path", "", str))
        prompts = {t.prompt_text for t in held_out}
        return [t for t in tasks if t.prompt_text not in prompts], held_out  # disjoint by prompt
    fraction = _option(spec, "held_out_fraction", 0.1, (int, float))
    if not 0 <= fraction < 1:
        raise ValueError(f"task spec 'jsonl': field 'held_out_fraction' must be in [0, 1), got {fraction}")
    prompts = sorted({t.prompt_text for t in tasks})
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: round(fraction * len(prompts))])  # whole prompts: repeats stay on one side
    return [t for t in tasks if t.prompt_text not in held], [t for t in tasks if t.prompt_text in held]


def load_tasks(spec: dict, seed: int) -> tuple[list[RLTask], list[RLTask]]:
    """(train, held_out) tasks of one spec (see the module docstring); no held-out prompt text
    appears in train. ValueError for an unknown kind or a bad field."""
    loaders = {"arithmetic": arithmetic_tasks, "stdlib_code": stdlib_code_tasks, "json": json_tasks,
               "jsonl": jsonl_tasks}
    if not isinstance(spec, dict) or spec.get("kind") not in loaders:
        kind = spec.get("kind") if isinstance(spec, dict) else spec
        raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(SPEC_KINDS)}")
    return loaders[spec["kind"]](spec, seed)


# ---------------------------------------------------------------- SFT warm-up data
def write_sft_set(tasks: Sequence[RLTask], path: str | Path) -> int:
    """chat_jsonl lines {"messages": [prompt..., {"role": "assistant", "content": reference}]} for
    the tasks that have a reference; returns how many were written."""
    written = 0
    with open(path, "w", encoding="utf-8") as handle:
        for task in tasks:
            if task.reference:
                answer = {"role": "assistant", "content": task.reference}
                messages = [dict(m) for m in task.messages] + [answer]
                handle.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
                written += 1
    return written


def ensure_sft_set(specs: Sequence[dict], seed: int, directory: str | Path = "~/.cache/glm5_jax") -> str:
    """The training splits of `specs` (as `load_tasks` draws them with `seed`) as an SFT set, written
    once to `directory` under a name keyed by the specs and seed; returns its path. The held-out
    prompts are never in it."""
    key = hashlib.sha256(json.dumps([dict(spec) for spec in specs], sort_keys=True).encode()
                         + f":{seed}".encode()).hexdigest()[:16]
    path = Path(directory).expanduser() / f"rl_sft-{key}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        train = [task for spec in specs for task in load_tasks(dict(spec), seed)[0]]
        partial = path.with_suffix(".partial")
        write_sft_set(train, partial)
        partial.replace(path)  # never a half-written set under the final name
    return str(path)

