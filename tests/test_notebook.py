"""notebooks/quickstart.ipynb: stored without outputs, and run top to bottom by nbclient on its small
setting (the papermill convention: `SMALL = True` injected after the cell tagged `parameters`, so the
tiny architecture, a few steps, tiny evaluation limits and a one-slot engine) in a temporary working
directory. Every cell must run without error; the loss goes down, the evaluation scores every task of
the suite, the int8 model stays close on the basic-ability tasks, and the openai client gets a
completion from the in-process server.

The kernel is this interpreter (a kernel spec written for the test), with the checkout importable; it
inherits the suite's environment (conftest.py's fast-compile XLA flags) but not the persistent
compilation cache (see below). Nearly all of its time is JAX tracing and XLA compiling seven programs:
the weight initialisation, the train step, the engine's mixed and decode steps (shared by sampling, the
evaluation and the server), the log-likelihood forward, the quantization and the int8 forward."""

import json
import math
import os
import sys
from pathlib import Path

import pytest

from glm5_jax.evaluate import load_suite

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"

pytestmark = pytest.mark.xdist_group("notebook")


def code_cells(notebook: dict) -> list[dict]:
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def is_parameters(cell) -> bool:
    return "parameters" in cell.get("metadata", {}).get("tags", [])


def test_notebook_is_stored_without_outputs():
    notebook = json.loads(NOTEBOOK.read_text())
    cells = code_cells(notebook)
    assert cells
    for index, cell in enumerate(cells):
        assert cell["outputs"] == [] and cell["execution_count"] is None, (
            f"code cell {index} of {NOTEBOOK.name} was saved with outputs: clear them before committing "
            "(Edit > Clear All Outputs in Jupyter; notebooks/README.md)")
    parameters = [cell for cell in cells if is_parameters(cell)]
    assert len(parameters) == 1, "exactly one code cell tagged `parameters` (papermill's convention)"
    assert "SMALL = False" in "".join(parameters[0]["source"])


def stream_text(cell) -> str:
    return "".join(output.get("text", "") for output in cell.outputs if output.output_type == "stream")


def test_notebook_runs_on_the_small_setting(tmp_path, monkeypatch, capfd):
    reason = "the notebook extra is not installed (pip install -e '.[notebook]')"
    nbclient = pytest.importorskip("nbclient", reason=reason)
    nbformat = pytest.importorskip("nbformat", reason=reason)
    for module in ("ipykernel", "matplotlib", "openai"):
        pytest.importorskip(module, reason=reason)

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    index = next(i for i, cell in enumerate(notebook.cells) if is_parameters(cell))
    notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(
        "SMALL = True", metadata={"tags": ["injected-parameters"]}))
    # A kernel spec for this interpreter (the installed python3 spec runs whatever `python` is on PATH).
    spec = tmp_path / "jupyter" / "kernels" / "glm5-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "glm5-jax test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # No other test compiles the notebook's programs, and with JAX's persistent cache on, XLA:CPU
    # compiles them 1.5-2x slower (measured: the tiny train step 6 s -> 9 s): the kernel goes without.
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    work = tmp_path / "work"
    work.mkdir()

    # The kernel talks to the client over unix sockets, not localhost TCP: over TCP ipykernel (7+)
    # warns on every start that the traffic is unencrypted. The sockets live in tmp_path.
    from traitlets.config import Config

    config = Config()
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = str(tmp_path / "kernel")
    client = nbclient.NotebookClient(notebook, kernel_name="glm5-test", timeout=300, config=config,
                                     resources={"metadata": {"path": str(work)}})
    client.execute()  # raises CellExecutionError, naming the cell and the traceback, if any cell fails
    kernel_log = capfd.readouterr().err  # the kernel process writes its log to this process's stderr
    assert "without encryption" not in kernel_log, kernel_log

    cells = code_cells(notebook)
    training = next(cell for cell in cells if "train_step(state" in cell.source)
    assert any("image/png" in output.get("data", {}) for output in training.outputs), "no loss plot"
    summary = json.loads(stream_text(cells[-1]))
    assert summary["train_steps"] >= 3
    assert summary["loss_last"] < summary["loss_first"], summary
    tasks = load_suite(summary["suite"]).tasks
    assert set(summary["scores"]) == {task.name for task in tasks}
    assert all(math.isfinite(score["value"]) for score in summary["scores"].values()), summary["scores"]
    # The quantized model is compared on the basic-ability tasks (log-likelihoods and bits per byte).
    assert set(summary["compared"]) == {task.name for task in tasks if task.dimension == "basic"}
    for name, score in summary["compared"].items():
        assert math.isfinite(score["trained"]) and math.isfinite(score["quantized"]), (name, score)
        if score["metric"] == "bits_per_byte":  # int8 weights barely move the held-out text's bits per byte
            assert score["quantized"] == pytest.approx(score["trained"], abs=0.05), (name, score)
    assert summary["completion_tokens"] > 0
    run = work / "runs" / "notebook"  # the notebook's WORKDIR, relative to its working directory
    assert (run / "tokenizer.json").is_file() and (run / "config.json").is_file()
    assert (run / "eval" / "compare" / "compare.md").is_file()
