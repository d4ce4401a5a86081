"""Task data built from what every machine has: this Python installation's standard library.

    stdlib_modules     multiple choice: which module defines this function (as bench/lm_eval_check.py)
    stdlib_docstrings  multiple choice: which first docstring line belongs to this `def` line
    stdlib_heldout     text: standard-library files in the validation split the demo run holds out
    stdlib_doctests    code: write a function's body from its signature and docstring; the test
                       runs the docstring's `>>>` examples against it (only functions whose own
                       body passes them, checked in the sandbox, are kept)
    arithmetic         exact match: templated integer arithmetic

Sources are read with `ast` (nothing imported here); the same installation, limit and seed give
the same items. `build(name, limit, seed)` returns the items of one of these sets.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from glm5_jax.evaluate.formats import (
    AnswerProblem,
    CodeProblem,
    MultipleChoiceItem,
    TaskDataError,
    TextDocument,
)
from glm5_jax.evaluate.sandbox import SandboxLimits, run_program

# Module files (relative to the stdlib, no `.py`) with many public documented functions.
QUESTION_MODULES = (
    "json/__init__",
    "textwrap",
    "shutil",
    "statistics",
    "fnmatch",
    "base64",
    "heapq",
    "bisect",
    "glob",
    "shlex",
    "difflib",
    "functools",
    "random",
    "tempfile",
    "posixpath",
    "calendar",
    "colorsys",
    "copy",
    "string",
    "operator",
    "gzip",
    "uuid",
    "secrets",
    "ipaddress",
    "html/__init__",
    "keyword",
    "linecache",
    "tokenize",
    "fractions",
)
# Modules whose functions carry runnable `>>>` examples.
DOCTEST_MODULES = (
    "statistics",
    "difflib",
    "pickletools",
    "pickle",
    "enum",
    "http/cookiejar",
    "typing",
    "antigravity",
    "fractions",
    "textwrap",
    "heapq",
    "bisect",
    "functools",
    "base64",
    "shlex",
    "glob",
    "fnmatch",
    "json/__init__",
    "colorsys",
    "calendar",
    "string",
)
HELD_OUT_FRACTION, HELD_OUT_SEED = 0.02, 0  # configs/demo.py's data.validation_fraction and seed
MAX_DEFINITION_LINES = 40
SOURCES = ("stdlib_modules", "stdlib_docstrings", "stdlib_heldout", "stdlib_doctests", "arithmetic")


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(relative: str) -> str:
    return relative.removesuffix("/__init__").replace("/", ".")


def _functions(relative: str) -> Iterator[tuple[ast.FunctionDef, str]]:
    """Public, undecorated top-level functions of one stdlib module file, with the file's text."""
    path = _stdlib() / f"{relative}.py"
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and not node.decorator_list:
            yield node, text


def _first_line(docstring: str | None) -> str | None:
    line = (docstring or "").strip().split("\n")[0].strip()
    return line if 12 <= len(line) <= 90 else None


def _pick_others(rng: random.Random, pool: list, right, count: int = 3) -> list:
    others = rng.sample([x for x in pool if x != right], count)
    choices = others + [right]
    rng.shuffle(choices)
    return choices


def stdlib_modules(seed: int) -> list[MultipleChoiceItem]:
    rng = random.Random(seed)
    modules = [m for m in QUESTION_MODULES if (_stdlib() / f"{m}.py").is_file()]
    names = [_module_name(m) for m in modules]
    items = []
    for relative, module in zip(modules, names, strict=True):
        functions = sorted(node.name for node, _ in _functions(relative))
        for name in rng.sample(functions, min(4, len(functions))):
            choices = _pick_others(rng, names, module)
            items.append(
                MultipleChoiceItem(
                    f"{module}.{name}",
                    f"In Python, the function {name}() is defined in the module",
                    tuple(choices),
                    choices.index(module),
                )
            )
    rng.shuffle(items)
    return items


def stdlib_docstrings(seed: int) -> list[MultipleChoiceItem]:
    rng = random.Random(seed)
    pool = []  # (id, def line, first docstring line)
    for relative in QUESTION_MODULES:
        for node, _ in _functions(relative):
            line = _first_line(ast.get_docstring(node))
            if line is not None:
                pool.append(
                    (
                        f"{_module_name(relative)}.{node.name}",
                        f"def {node.name}({ast.unparse(node.args)}):",
                        line,
                    )
                )
    lines = sorted({line for _, _, line in pool})
    items = []
    for item_id, definition, line in pool:
        choices = _pick_others(rng, lines, line)
        items.append(
            MultipleChoiceItem(item_id, f'{definition}\n    """', tuple(choices), choices.index(line))
        )
    rng.shuffle(items)
    return items


def stdlib_heldout(seed: int) -> list[TextDocument]:
    """The stdlib documents of the demo run's validation split, in a seeded order."""
    from glm5_jax.data.sources import SourceSpec, load_documents, sample_documents, split_documents

    _, held_out = split_documents(load_documents(SourceSpec()), HELD_OUT_FRACTION, HELD_OUT_SEED)
    ordered = sample_documents(held_out, max_bytes=2**62, seed=seed)
    return [TextDocument(d.doc_id, d.text) for d in ordered]


_DOCTEST_CHECK = """import doctest as _doctest
import importlib as _importlib

_DOCSTRING = {docstring!r}


def check(candidate):
    globs = dict(vars(_importlib.import_module({module!r})))
    globs[{name!r}] = candidate
    test = _doctest.DocTestParser().get_doctest(_DOCSTRING, globs, {name!r}, None, 0)
    result = _doctest.DocTestRunner(optionflags=_doctest.ELLIPSIS).run(test, out=lambda text: None)
    assert result.attempted > 0 and result.failed == 0, f"{{result.failed}} of {{result.attempted}} failed"
"""


def _top_level_names(text: str) -> set[str]:
    """Names a module binds at its top level (assignments, definitions, imports; also inside
    top-level if/try blocks, never inside functions or classes)."""
    names = set()
    pending = list(ast.parse(text).body)
    while pending:
        statement = pending.pop()
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(statement.name)
        elif isinstance(statement, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in statement.names)
        else:
            for child in ast.iter_child_nodes(statement):
                if isinstance(child, ast.stmt | ast.excepthandler):
                    pending.append(child)
                else:
                    names.update(
                        n.id
                        for n in ast.walk(child)
                        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                    )
    return names


def _doctest_problem(relative: str, node: ast.FunctionDef, text: str) -> CodeProblem | None:
    """The function's header and docstring as the prompt, its body as the reference solution, a
    test running its `>>>` examples; None when it does not fit (no examples, too long)."""
    docstring = ast.get_docstring(node)
    if not docstring or ">>>" not in docstring or not isinstance(node.body[0], ast.Expr):
        return None
    if node.end_lineno - node.lineno >= MAX_DEFINITION_LINES or len(node.body) < 2:
        return None
    module = _module_name(relative)
    local = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    needed = sorted((used - local) & _top_level_names(text) - {node.name})
    lines = text.splitlines(keepends=True)
    header = f"from {module} import {', '.join(needed)}\n\n\n" if needed else ""
    prompt = header + "".join(lines[node.lineno - 1 : node.body[0].end_lineno])
    solution = "".join(lines[node.body[0].end_lineno : node.end_lineno])
    test = _DOCTEST_CHECK.format(docstring=docstring, module=module, name=node.name)
    return CodeProblem(f"{module}.{node.name}", prompt, test, node.name, solution)


_VALIDATE = """import json
problems = json.loads({problems!r})
passed = []
for problem in problems:
    scope = {{"__name__": "__main__"}}
    try:
        exec(problem["prompt"] + problem["solution"] + "\\n\\n" + problem["test"], scope)
        scope["check"](scope[problem["entry_point"]])
    except BaseException:
        continue
    passed.append(problem["id"])
print(json.dumps(passed))
"""


def stdlib_doctests(seed: int) -> list[CodeProblem]:
    """Functions of DOCTEST_MODULES whose own body passes its examples in the sandbox."""
    candidates = [
        p
        for relative in DOCTEST_MODULES
        for node, text in _functions(relative)
        if (p := _doctest_problem(relative, node, text)) is not None
    ]
    listed = json.dumps(
        [
            {
                "id": p.item_id,
                "prompt": p.prompt,
                "solution": p.canonical_solution,
                "test": p.test,
                "entry_point": p.entry_point,
            }
            for p in candidates
        ]
    )
    # The programs are this installation's own functions and examples, not model output: they may
    # run where bubblewrap cannot (the model's completions for them still need it, or the flag).
    limits = SandboxLimits(timeout_s=60, memory_mb=1024, allow_unsandboxed=True)
    result = run_program(_VALIDATE.format(problems=listed), limits)
    if not result.passed:
        raise TaskDataError(
            f"checking the stdlib doctest problems failed ({result.status}): {result.stderr[-500:]}"
        )
    passing = set(json.loads(result.stdout.strip().splitlines()[-1]))
    problems = [p for p in candidates if p.item_id in passing]
    random.Random(seed).shuffle(problems)
    return problems


def arithmetic(seed: int, count: int = 1000) -> list[AnswerProblem]:
    """`a op b` with two-digit operands, the answer an integer."""
    rng = random.Random(seed)
    problems = []
    for index in range(count):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        problems.append(AnswerProblem(f"arithmetic-{index}", f"{a} {op} {b}", str(value), str(value)))
    return problems


def build(name: str, seed: int) -> list:
    """The items of a built-in set (see SOURCES)."""
    builders = {
        "stdlib_modules": stdlib_modules,
        "stdlib_docstrings": stdlib_docstrings,
        "stdlib_heldout": stdlib_heldout,
        "stdlib_doctests": stdlib_doctests,
        "arithmetic": arithmetic,
    }
    if name not in builders:
        raise TaskDataError(f"unknown built-in source 'builtin:{name}'; known: {', '.join(SOURCES)}")
    return builders[name](seed)
