"""Results of a suite run: the JSON document (schema SCHEMA, docs/evaluation.md), the markdown
report, the plots (when matplotlib is importable) and the side-by-side comparison of runs.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from glm5_jax.evaluate.formats import TaskDataError

SCHEMA = "glm5_jax.evaluate/1"
DIMENSION_TITLES = {
    "basic": "Basic ability",
    "professional": "Professional ability",
    "real_scenarios": "Real scenarios",
}
PACKAGES = (
    "glm5-jax",
    "jax",
    "jaxlib",
    "flax",
    "numpy",
    "tokenizers",
    "ml-collections",
    "httpx",
    "matplotlib",
)
EFFICIENCY = ("ttft", "tpot", "tokens_per_s", "throughput")
NO_MATPLOTLIB = "plots skipped: matplotlib not installed (pip install matplotlib)"


# ---------------------------------------------------------------- provenance
def content_hash(path: str | os.PathLike) -> str | None:
    """sha256 over the files that make the model: a run directory's latest checkpoint and
    tokenizer, an HF checkpoint directory's files, or a single (config) file; None if absent."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / "checkpoints").is_dir():
        from glm5_jax.train.checkpoints import RunCheckpoints

        checkpoints = RunCheckpoints(path, read_only=True)
        step = checkpoints.latest_step()
        checkpoints.close()
        files = [p for p in sorted((path / "checkpoints" / str(step)).rglob("*")) if p.is_file()]
        files += [p for p in (path / "tokenizer.json",) if p.is_file()]
    elif path.is_dir():
        files = [p for p in sorted(path.iterdir()) if p.is_file()]
    else:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(path) if file != path else file.name).encode() + b"\0")
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def versions() -> dict:
    found = {"python": platform.python_version(), "platform": platform.platform()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        if commit.returncode == 0:
            found["git_commit"] = commit.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return found


def results_document(
    suite, results, model: dict, started: datetime.datetime, seconds: float, label: str, sandbox: dict
) -> dict:
    return {
        "schema": SCHEMA,
        "label": label,
        "started": started.isoformat(timespec="seconds"),
        "wall_seconds": round(seconds, 2),
        "command": sys.argv,
        "model": model,
        "suite": suite.to_dict(),
        "versions": versions(),
        "sandbox": sandbox,
        "tasks": [r.to_dict() for r in results],
    }


# ---------------------------------------------------------------- formatting
def format_value(metric: dict | None) -> str:
    if (
        metric is None
        or metric["value"] is None
        or (isinstance(metric["value"], float) and math.isnan(metric["value"]))
    ):
        return "-"
    value, unit = metric["value"], metric.get("unit", "")
    if unit == "s":
        return f"{value * 1000:.1f} ms"
    if unit == "tokens/s":
        return f"{value:.1f}"
    return f"{value:.3f}"


def format_interval(metric: dict) -> str:
    if metric.get("ci_low") is None:
        return "-"
    low, high = ({**metric, "value": metric[k]} for k in ("ci_low", "ci_high"))
    return f"[{format_value(low)}, {format_value(high)}]"


def _is_efficiency(name: str) -> bool:
    return name.startswith(EFFICIENCY)


def markdown_report(document: dict, plot: str | None) -> str:
    model = document["model"]
    lines = [
        f"# Evaluation: suite `{document['suite']['name']}` on `{document['label']}`",
        "",
        "| | |",
        "|---|---|",
        f"| model | {model.get('checkpoint') or model.get('server')} |",
        f"| content sha256 | {model.get('content_hash') or '-'} |",
        f"| quantization | {model.get('quantize') or 'none'} |",
        f"| backend | {model['backend'].get('backend')} {model['backend'].get('devices', '')} |",
        f"| started | {document['started']}, {document['wall_seconds']:.1f} s |",
        f"| versions | {', '.join(f'{k} {v}' for k, v in document['versions'].items() if k != 'platform')} |",
        f"| sandbox | {', '.join(k for k, v in document['sandbox'].items() if v) or 'limits only'} |",
        "",
    ]
    for dimension, title in DIMENSION_TITLES.items():
        tasks = [t for t in document["tasks"] if t["dimension"] == dimension]
        if not tasks:
            continue
        lines += [
            f"## {title}",
            "",
            "| task | metric | value | 95% CI | n | notes |",
            "|---|---|---|---|---|---|",
        ]
        for task in tasks:
            notes = "; ".join(task["notes"])
            for name, metric in task["metrics"].items():
                if _is_efficiency(name):
                    continue
                mark = " (primary)" if name == task["primary"] else ""
                lines.append(
                    f"| {task['name']} | {name}{mark} | {format_value(metric)} | "
                    f"{format_interval(metric)} | {metric['count']} | {notes} |"
                )
                notes = ""  # once per task
        efficiency = [(t, n, m) for t in tasks for n, m in t["metrics"].items() if _is_efficiency(n)]
        if efficiency:
            lines += [
                "",
                "Efficiency on the same replay:",
                "",
                "| task | metric | value | 95% CI |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {t['name']} | {n} | {format_value(m)} | {format_interval(m)} |" for t, n, m in efficiency
            ]
        lines.append("")
    lines.append(f"![scores per dimension]({plot})" if plot else NO_MATPLOTLIB)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- plots
def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        return None
    return pyplot


def _panels(documents: Sequence[dict]) -> list[tuple[str, list[tuple[str, str]]]]:
    """(panel title, [(task, metric)]) present in any of the documents: share-of-items scores per
    dimension, bits per byte, and the replay's median latencies."""
    panels: dict[str, list] = {}
    for document in documents:
        for task in document["tasks"]:
            for name, metric in task["metrics"].items():
                if name.endswith(("_p50",)) and name.startswith(("ttft", "tpot")):
                    panel = "latency p50 (ms, lower is better)"
                elif name == "bits_per_byte":
                    panel = "bits per byte (lower is better)"
                elif not _is_efficiency(name) and metric.get("unit", "") == "" and metric["higher_is_better"]:
                    panel = DIMENSION_TITLES[task["dimension"]]
                else:
                    continue
                key = (task["name"], name)
                if key not in panels.setdefault(panel, []):
                    panels[panel].append(key)
    order = list(DIMENSION_TITLES.values()) + [
        "bits per byte (lower is better)",
        "latency p50 (ms, lower is better)",
    ]
    return [(title, panels[title]) for title in order if title in panels]


def plot_documents(documents: Sequence[dict], path: Path) -> bool:
    """Grouped bars (one group per task metric, one bar per run) with 95% intervals; False when
    matplotlib is not installed."""
    pyplot = _pyplot()
    if pyplot is None:
        return False
    panels = _panels(documents)
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    figure, axes = pyplot.subplots(rows, columns, figsize=(4.6 * columns, 4.2 * rows), squeeze=False)
    axes = axes.ravel()
    for unused in axes[len(panels) :]:
        unused.set_visible(False)
    width = 0.8 / len(documents)
    for axis, (title, keys) in zip(axes, panels, strict=False):
        for index, document in enumerate(documents):
            tasks = {t["name"]: t for t in document["tasks"]}
            scale = 1000.0 if title.startswith("latency") else 1.0
            values, errors = [], [[], []]
            for task, name in keys:
                metric = tasks.get(task, {}).get("metrics", {}).get(name)
                value = metric["value"] * scale if metric and metric["value"] is not None else math.nan
                values.append(value)
                low = metric.get("ci_low") if metric else None
                # A bootstrap interval need not contain the point estimate: bars never go negative.
                errors[0].append(max(0.0, value - low * scale) if low is not None else 0.0)
                errors[1].append(max(0.0, metric["ci_high"] * scale - value) if low is not None else 0.0)
            positions = [i + (index - (len(documents) - 1) / 2) * width for i in range(len(keys))]
            axis.bar(positions, values, width, yerr=errors, capsize=3, label=document["label"])
        axis.set_title(title, fontsize=10)
        axis.set_xticks(range(len(keys)), [f"{t}\n{n}" for t, n in keys], fontsize=7, rotation=30, ha="right")
        if not title.startswith(("bits", "latency")):
            axis.set_ylim(0, 1)
    if len(documents) > 1:
        axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return True


# ---------------------------------------------------------------- writing
def write_run(output: Path, document: dict, results) -> dict[str, Path]:
    """results.json, samples.jsonl, scores.png (when matplotlib is there) and report.md in `output`."""
    output.mkdir(parents=True, exist_ok=True)
    paths = {
        "results": output / "results.json",
        "samples": output / "samples.jsonl",
        "report": output / "report.md",
    }
    paths["results"].write_text(json.dumps(document, indent=2, default=str) + "\n")
    with open(paths["samples"], "w", encoding="utf-8") as handle:
        for result in results:
            for sample in result.samples:
                handle.write(json.dumps({"task": result.spec.name, **sample}, default=str) + "\n")
    plot = output / "scores.png"
    plotted = plot_documents([document], plot)
    if plotted:
        paths["plot"] = plot
    paths["report"].write_text(markdown_report(document, plot.name if plotted else None))
    return paths


def read_results(path: str | os.PathLike) -> dict:
    try:
        document = json.loads(Path(path).read_text())
    except ValueError as error:
        raise TaskDataError(f"{path}: not a JSON results file ({error})") from error
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise TaskDataError(f"{path} is not an evaluation result (schema {SCHEMA})")
    return document


def compare_markdown(documents: Sequence[dict], plot: str | None) -> str:
    """A table of every task metric (rows) by run (columns), with the change from the first run;
    a change is marked * when the two 95% intervals do not overlap."""
    labels = [d["label"] for d in documents]
    header = ["task", "metric"] + labels + [f"{label} - {labels[0]}" for label in labels[1:]]
    lines = [
        "# Comparison",
        "",
        "| run | model | quantization | suite | wall time |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {d['label']} | {d['model'].get('checkpoint') or d['model'].get('server')} | "
        f"{d['model'].get('quantize') or 'none'} | {d['suite']['name']} | {d['wall_seconds']:.0f} s |"
        for d in documents
    ]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    keys = []
    for document in documents:
        for task in document["tasks"]:
            for name in task["metrics"]:
                if (task["name"], name) not in keys:
                    keys.append((task["name"], name))
    for task_name, name in keys:
        metrics = [
            {t["name"]: t for t in d["tasks"]}.get(task_name, {}).get("metrics", {}).get(name)
            for d in documents
        ]
        cells = [f"{format_value(m)} {format_interval(m)}" if m else "-" for m in metrics]
        for metric in metrics[1:]:
            base = metrics[0]
            if not (metric and base) or metric["value"] is None or base["value"] is None:
                cells.append("-")
                continue
            delta = {**metric, "value": metric["value"] - base["value"]}
            apart = None not in (metric["ci_low"], base["ci_low"]) and (
                metric["ci_low"] > base["ci_high"] or metric["ci_high"] < base["ci_low"]
            )
            sign = "+" if delta["value"] >= 0 else ""
            cells.append(f"{sign}{format_value(delta)}{' *' if apart else ''}")
        lines.append(f"| {task_name} | {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "`*`: the two runs' 95% intervals do not overlap.",
        "",
        f"![comparison]({plot})" if plot else NO_MATPLOTLIB,
    ]
    return "\n".join(lines) + "\n"


def write_comparison(paths: Sequence[str | os.PathLike], output: Path) -> dict[str, Path]:
    documents = [read_results(p) for p in paths]
    output.mkdir(parents=True, exist_ok=True)
    plot = output / "compare.png"
    plotted = plot_documents(documents, plot)
    report = output / "compare.md"
    report.write_text(compare_markdown(documents, plot.name if plotted else None))
    return {"report": report, **({"plot": plot} if plotted else {})}
