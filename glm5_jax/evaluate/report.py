"""Results of a suite run: the JSON document (schema SCHEMA, docs/evaluation.md), the report
(markdown and self-contained HTML, both rendered by render.py from one content), the plots (when
matplotlib is importable) and the side-by-side comparison of runs.
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

from glm5_jax.evaluate import render
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


def run_blocks(document: dict, plot: Path | None) -> list[render.Block]:
    """One run's report: the model and provenance, then per dimension a table of the task
    metrics (and one of the replay's efficiency), then the plot (None: matplotlib missing)."""
    model = document["model"]
    about = [
        ("model", str(model.get("checkpoint") or model.get("server"))),
        ("content sha256", model.get("content_hash") or "-"),
        ("quantization", model.get("quantize") or "none"),
        ("backend", f"{model['backend'].get('backend')} {model['backend'].get('devices', '')}"),
        ("started", f"{document['started']}, {document['wall_seconds']:.1f} s"),
        ("versions", ", ".join(f"{k} {v}" for k, v in document["versions"].items() if k != "platform")),
        ("sandbox", ", ".join(k for k, v in document["sandbox"].items() if v) or "limits only"),
    ]
    blocks = [
        render.Heading(1, f"Evaluation: suite `{document['suite']['name']}` on `{document['label']}`"),
        render.Table(("", ""), tuple(about)),
    ]
    for dimension, title in DIMENSION_TITLES.items():
        tasks = [t for t in document["tasks"] if t["dimension"] == dimension]
        if not tasks:
            continue
        rows = []
        for task in tasks:
            notes = "; ".join(task["notes"])
            for name, metric in task["metrics"].items():
                if _is_efficiency(name):
                    continue
                mark = " (primary)" if name == task["primary"] else ""
                rows.append(
                    (
                        task["name"],
                        name + mark,
                        format_value(metric),
                        format_interval(metric),
                        str(metric["count"]),
                        notes,
                    )
                )
                notes = ""  # once per task
        blocks += [
            render.Heading(2, title),
            render.Table(("task", "metric", "value", "95% CI", "n", "notes"), tuple(rows)),
        ]
        efficiency = [(t, n, m) for t in tasks for n, m in t["metrics"].items() if _is_efficiency(n)]
        if efficiency:
            blocks += [
                render.Paragraph("Efficiency on the same replay:"),
                render.Table(
                    ("task", "metric", "value", "95% CI"),
                    tuple((t["name"], n, format_value(m), format_interval(m)) for t, n, m in efficiency),
                ),
            ]
    blocks.append(render.Image("scores per dimension", plot) if plot else render.Paragraph(NO_MATPLOTLIB))
    return blocks


def markdown_report(document: dict, plot: Path | None) -> str:
    return render.to_markdown(run_blocks(document, plot))


def html_report(document: dict, plot: Path | None) -> str:
    """report.md's content as one self-contained HTML page (the plot embedded)."""
    return render.to_html(run_blocks(document, plot), f"{document['label']}: {document['suite']['name']}")


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
    """results.json, samples.jsonl, scores.png (when matplotlib is there), report.md and
    report.html in `output`."""
    output.mkdir(parents=True, exist_ok=True)
    paths = {
        "results": output / "results.json",
        "samples": output / "samples.jsonl",
        "report": output / "report.md",
        "html": output / "report.html",
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
    paths["report"].write_text(markdown_report(document, plot if plotted else None))
    paths["html"].write_text(html_report(document, plot if plotted else None), encoding="utf-8")
    return paths


def read_results(path: str | os.PathLike) -> dict:
    try:
        document = json.loads(Path(path).read_text())
    except ValueError as error:
        raise TaskDataError(f"{path}: not a JSON results file ({error})") from error
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise TaskDataError(f"{path} is not an evaluation result (schema {SCHEMA})")
    return document


def compare_blocks(documents: Sequence[dict], plot: Path | None) -> list[render.Block]:
    """A table of every task metric (rows) by run (columns), with the change from the first run;
    a change is marked * when the two 95% intervals do not overlap."""
    labels = [d["label"] for d in documents]
    runs = tuple(
        (
            d["label"],
            str(d["model"].get("checkpoint") or d["model"].get("server")),
            d["model"].get("quantize") or "none",
            d["suite"]["name"],
            f"{d['wall_seconds']:.0f} s",
        )
        for d in documents
    )
    keys = []
    for document in documents:
        for task in document["tasks"]:
            for name in task["metrics"]:
                if (task["name"], name) not in keys:
                    keys.append((task["name"], name))
    rows = []
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
        rows.append((task_name, name, *cells))
    header = ("task", "metric", *labels, *(f"{label} - {labels[0]}" for label in labels[1:]))
    return [
        render.Heading(1, "Comparison"),
        render.Table(("run", "model", "quantization", "suite", "wall time"), runs),
        render.Table(header, tuple(rows)),
        render.Paragraph("`*`: the two runs' 95% intervals do not overlap."),
        render.Image("comparison", plot) if plot else render.Paragraph(NO_MATPLOTLIB),
    ]


def compare_markdown(documents: Sequence[dict], plot: Path | None) -> str:
    return render.to_markdown(compare_blocks(documents, plot))


def compare_html(documents: Sequence[dict], plot: Path | None) -> str:
    """compare.md's content as one self-contained HTML page (the plot embedded)."""
    title = "Comparison: " + ", ".join(d["label"] for d in documents)
    return render.to_html(compare_blocks(documents, plot), title)


def write_comparison(paths: Sequence[str | os.PathLike], output: Path) -> dict[str, Path]:
    documents = [read_results(p) for p in paths]
    output.mkdir(parents=True, exist_ok=True)
    plot = output / "compare.png"
    plotted = plot_documents(documents, plot)
    paths = {"report": output / "compare.md", "html": output / "compare.html"}
    paths["report"].write_text(compare_markdown(documents, plot if plotted else None))
    paths["html"].write_text(compare_html(documents, plot if plotted else None), encoding="utf-8")
    return {**paths, **({"plot": plot} if plotted else {})}
