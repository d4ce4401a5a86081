"""Shared fixtures (the tiny config), float32 CPU determinism, and the suite's compile budget.

Every compiled program goes to one persistent JAX compilation cache for the whole run: a temporary
directory created by the first process (pytest, or the xdist controller) and handed through the
environment to xdist workers and to the subprocesses tests start (train.py, serve.py, the mesh
checks), so a program compiled once is loaded, not compiled, everywhere else.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

if "GLM5_TEST_COMPILATION_CACHE" not in os.environ:  # the first process of this run
    os.environ["GLM5_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="glm5-jax-test-cache-")
    _OWNS_CACHE = True
else:
    _OWNS_CACHE = False
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["GLM5_TEST_COMPILATION_CACHE"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests run tiny programs once or a few times: LLVM's optimisation passes cost more than they
# save, and so do XLA:CPU's newer fusion emitters (MLIR kernels per fusion). Without both, a tiny
# train step compiles in ~6 s instead of ~21 s, with the same loss bits (no fast-math either way);
# execution is slower, which these shapes never notice. Inherited by every subprocess a test
# starts. A jaxlib that no longer knows the emitter flag gets the other two only (XLA aborts on
# an unknown flag, so the first process checks once in a subprocess).
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_NO_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flags: str) -> bool:
    probe = "import jax; jax.devices()"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    _flags = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
    if _xla_accepts(f"{_flags} {_NO_FUSION_EMITTERS}"):
        _flags = f"{_flags} {_NO_FUSION_EMITTERS}"
    os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402
import jax.monitoring  # noqa: E402
import pytest  # noqa: E402

from glm5_jax.config_files import load_model_config  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
    if _OWNS_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["GLM5_TEST_COMPILATION_CACHE"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_config():
    return load_model_config("configs/tiny.py")


@pytest.fixture(scope="module")
def data_glob(tmp_path_factory):
    """A few real Python files (from the standard library) as training data: a glob."""
    directory = tmp_path_factory.mktemp("data")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json/encoder.py", "json/decoder.py", "textwrap.py", "string.py", "bisect.py",
                 "heapq.py", "colorsys.py", "fnmatch.py", "glob.py", "shlex.py"):
        shutil.copyfile(stdlib / name, directory / name.replace("/", "_"))
    return str(directory / "*.py")


# Modules whose tests take longest (docs/testing.md), most worker time first, started first so no
# worker is left with a long tail at the end (pyproject's --no-loadscope-reorder makes xdist keep
# this order; by default it would order its units by their number of tests); the rest keep
# their file order.
SLOW_FIRST = ("test_train_cli", "test_multihost", "test_parallel", "test_serve_multihost", "test_serve_mesh",
              "test_parity_next", "test_kda", "test_grpo_loop", "test_train_step", "test_hybrid_serving",
              "test_serve_next", "test_notebook", "test_soak", "test_model", "test_serve_e2e", "test_engine",
              "test_structured", "test_paged_decode", "test_parity", "test_context_parallel",
              "test_speculative", "test_kernels_moe", "test_kernel_switch")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        module = item.module.__name__ if item.module else ""
        return SLOW_FIRST.index(module) if module in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: file order within a rank


# --- compile budget: programs each test compiles (or loads from the cache), summed per test ----
# In-process only: subprocesses (train.py, serve.py, the mesh checks) are not counted here.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiled = {"count": 0, "seconds": 0.0}
_phase_start = dict(_compiled)
_per_test: dict[str, list[float]] = {}


def _count_compile(event: str, duration: float, **_) -> None:
    if event == _COMPILE_EVENT:
        _compiled["count"] += 1
        _compiled["seconds"] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def pytest_runtest_logstart(nodeid, location):
    _phase_start.update(_compiled)
    for progress in _progress:
        progress.start(nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    count = _compiled["count"] - _phase_start["count"]
    seconds = _compiled["seconds"] - _phase_start["seconds"]
    _phase_start.update(_compiled)
    report.user_properties = [*report.user_properties, ("compiles", (count, seconds))]


def pytest_runtest_logreport(report):  # on the xdist controller too: properties travel with reports
    for progress in _progress:
        progress.report(report)
    for name, value in report.user_properties:
        if name == "compiles":
            totals = _per_test.setdefault(report.nodeid, [0, 0.0])
            totals[0] += value[0]
            totals[1] += value[1]


# --- progress a person can read: one line per finished test module, and a status line ----------
# `pytest -q` prints only dots; on the 2-core CI machine the suite runs for many minutes. On the
# process that reports (the xdist controller, or the only process with -n 0), each test module
# that finishes prints "[m:ss] tests/test_x.py: 9 passed in 1:02 (12/58 modules, 310/640 tests)",
# and when a minute passes without such a line, the next finished test prints which modules are
# still running. Not with -v (which names every test already).
_STATUS_EVERY = 60.0


class _Progress:
    def __init__(self, reporter):
        self.reporter = reporter
        self.started = time.monotonic()
        self.last_line = self.started
        self.total: dict[str, int] = {}  # module -> tests collected (after -k / deselection)
        self.module_started: dict[str, float] = {}
        self.outcomes: dict[str, dict[str, str]] = {}  # module -> test id -> outcome
        self.finished: dict[str, int] = {}  # module -> tests torn down
        self.modules_done = 0

    def collected(self, nodeids) -> None:
        if self.total:  # every xdist worker reports the same collection
            return
        for nodeid in nodeids:
            module = nodeid.split("::")[0]
            self.total[module] = self.total.get(module, 0) + 1

    def clock(self, seconds: float) -> str:
        return f"{int(seconds // 60)}:{int(seconds % 60):02d}"

    def write(self, text: str) -> None:
        if getattr(self.reporter._tw, "width_of_current_line", 0):  # after the dots of -q
            self.reporter.write("\n")
        self.reporter.write_line(f"[{self.clock(time.monotonic() - self.started)}] {text}")
        self.last_line = time.monotonic()

    def start(self, nodeid: str) -> None:
        self.module_started.setdefault(nodeid.split("::")[0], time.monotonic())

    def report(self, report) -> None:
        module = report.nodeid.split("::")[0]
        if module not in self.total:
            return
        self.module_started.setdefault(module, time.monotonic())
        outcomes = self.outcomes.setdefault(module, {})
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif report.skipped:
            outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        else:
            outcome = "passed"
        if outcomes.get(report.nodeid, "passed") == "passed":  # the first non-pass of a test sticks
            outcomes[report.nodeid] = outcome
        if report.when != "teardown":
            return
        self.finished[module] = self.finished.get(module, 0) + 1
        finished = sum(self.finished.values())
        tests = sum(self.total.values())
        if self.finished[module] == self.total[module]:
            self.modules_done += 1
            counts = {}
            for value in outcomes.values():
                counts[value] = counts.get(value, 0) + 1
            summary = ", ".join(f"{count} {name}" for name, count in sorted(counts.items()))
            self.write(f"{module}: {summary} in {self.clock(time.monotonic() - self.module_started[module])} "
                       f"({self.modules_done}/{len(self.total)} modules, {finished}/{tests} tests)")
        elif time.monotonic() - self.last_line >= _STATUS_EVERY:
            running = [f"{name} ({self.finished.get(name, 0)}/{self.total[name]})"
                       for name in self.module_started if self.finished.get(name, 0) < self.total[name]]
            self.write(f"{finished}/{tests} tests done; running " + ", ".join(running))


_progress: list[_Progress] = []  # the reporting process's one _Progress


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if not hasattr(config, "workerinput") and reporter is not None and config.option.verbose <= 0:
        _progress.append(_Progress(reporter))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    for progress in _progress:
        progress.collected(ids)


def pytest_collection_finish(session):  # -n 0: this process runs the tests it collected
    for progress in _progress:
        if session.items:
            progress.collected(item.nodeid for item in session.items)


def pytest_terminal_summary(terminalreporter):
    if not _per_test:
        return
    worst = sorted(_per_test.items(), key=lambda item: -item[1][1])[:15]
    terminalreporter.write_sep("=", "most compile time (XLA programs compiled or loaded, in-process)")
    for nodeid, (count, seconds) in worst:
        terminalreporter.write_line(f"{seconds:8.2f}s {count:5d} programs  {nodeid}")
    count = sum(c for c, _ in _per_test.values())
    seconds = sum(s for _, s in _per_test.values())
    terminalreporter.write_line(f"{seconds:8.2f}s {count:5d} programs  in all")
