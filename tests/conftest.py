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
import tempfile

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


# Modules whose tests take longest (docs/testing.md), started first so no worker is left with
# a long tail at the end; the rest keep their file order.
SLOW_FIRST = ("test_parallel", "test_train_cli", "test_serve_mesh", "test_train_step", "test_soak",
              "test_kernel_switch", "test_kernels_moe", "test_engine", "test_speculative", "test_serve_e2e",
              "test_structured", "test_model")


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    count = _compiled["count"] - _phase_start["count"]
    seconds = _compiled["seconds"] - _phase_start["seconds"]
    _phase_start.update(_compiled)
    report.user_properties = [*report.user_properties, ("compiles", (count, seconds))]


def pytest_runtest_logreport(report):  # on the xdist controller too: properties travel with reports
    for name, value in report.user_properties:
        if name == "compiles":
            totals = _per_test.setdefault(report.nodeid, [0, 0.0])
            totals[0] += value[0]
            totals[1] += value[1]


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
