"""The house's layering, read from the import statements of glm5_jax/ (every `from glm5_jax.x import`,
at module level or inside a function): no package-level import cycle,
lower floors import nothing from higher ones, and the kernels stand alone."""

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "glm5_jax"
# Package pairs that import each other. None: prepare (above evaluate) writes what data reads
# (glm5_jax/data/prepared.py), and the run loader lives in train/ (train/runs.py).
OPEN_CYCLES: set = set()
# What may not import what (lower floors never import higher ones).
NEVER = {
    "chat": {"engine", "api", "train", "data", "evaluate", "model", "rl"},
    "parallel": {"model", "engine", "api", "train", "data", "evaluate", "rl"},
    "model": {"engine", "api", "train", "data", "evaluate", "chat", "rl"},
    "quant": {"model", "engine", "api", "train", "data", "evaluate", "rl"},
    "data": {"engine", "api", "evaluate", "prepare", "rl"},
    "train": {"engine", "api", "evaluate", "rl"},
    # The engine runs without the HTTP layer (generate, the in-process evaluator): it imports model,
    # parallel and the neutral modules only.
    "engine": {"api", "evaluate", "prepare", "train", "data", "checkpoint", "chat", "rl"},
    # The API drives an engine it is given and needs no JAX (serve.py loads the model).
    "api": {"model", "parallel", "quant", "checkpoint", "train", "data", "evaluate", "prepare", "rl"},
    # RL (GRPO) sits on top: the trainer, the engine, the verifiers and the data meet there only.
    "evaluate": {"rl"},
    "glm5_jax.errors": {"*"},
    "glm5_jax.pyconfig": {"model", "engine", "api", "train", "data", "evaluate", "quant", "parallel"},
}


def _unit(path: Path) -> str:
    """The package (first folder under glm5_jax/) or top-level module a file belongs to."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0] if len(parts) > 1 else f"glm5_jax.{parts[0]}"


def _imported_unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "glm5_jax" or len(parts) < 2:
        return None
    return parts[1] if (PACKAGE / parts[1]).is_dir() else f"glm5_jax.{parts[1]}"


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    graph = collections.defaultdict(set)
    for path in root.rglob("*.py"):
        unit = _unit(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                else [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                target = _imported_unit(name)
                if target is not None and target != unit:
                    graph[unit].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The pairs of units that reach each other."""
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reachable = {unit: reach(unit) for unit in list(graph)}
    return {frozenset({a, b}) for a in reachable for b in reachable[a]
            if a != b and a in reachable.get(b, ())}


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == {frozenset({"a", "b"}), frozenset({"b", "c"}), frozenset({"a", "c"})}


def test_no_package_level_import_cycle():
    graph = import_graph()
    # Pairs on a cycle that import each other directly (a longer cycle shows as its edges).
    direct = {pair for pair in cycles(graph) if any(b in graph.get(a, ()) for a in pair for b in pair - {a})}
    assert direct == OPEN_CYCLES, sorted(map(sorted, direct))


def test_lower_floors_import_nothing_from_higher_ones():
    graph = import_graph()
    for unit, forbidden in NEVER.items():
        imported = graph.get(unit, set())
        bad = imported if "*" in forbidden else imported & forbidden
        assert not bad, f"{unit} imports {sorted(bad)}"
    kernels = {target for path in (ROOT / "kernels_pallas").rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(node, ast.ImportFrom) and node.module
               for target in [node.module] if target.startswith("glm5_jax")}
    assert not kernels, f"kernels_pallas imports {sorted(kernels)}"
