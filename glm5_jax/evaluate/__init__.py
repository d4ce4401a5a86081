"""Evaluation in three dimensions (docs/evaluation.md): basic ability (log-likelihood multiple
choice, bits per byte), professional ability (code run against unit tests in a sandbox, exact-match
answers) and real scenarios (replayed request logs scored by their rules, with TTFT/TPOT).

    python -m glm5_jax.evaluate --checkpoint runs/demo --suite local

From Python:

    from glm5_jax.evaluate import InProcessBackend, load_suite, run_suite
    backend = InProcessBackend.from_checkpoint("runs/demo")
    results = run_suite(load_suite("local"), backend)
"""

from glm5_jax.evaluate.backend import GenerationRequest, GenerationResult, encode_pair
from glm5_jax.evaluate.inprocess import EngineSettings, InProcessBackend
from glm5_jax.evaluate.sandbox import SandboxLimits, run_program
from glm5_jax.evaluate.scoring import Metric, pass_at_k
from glm5_jax.evaluate.suites import Suite, SuiteError, TaskSpec, load_suite, suite_from_config
from glm5_jax.evaluate.tasks import TaskResult, run_suite, run_task

__all__ = [
    "EngineSettings",
    "GenerationRequest",
    "GenerationResult",
    "InProcessBackend",
    "Metric",
    "SandboxLimits",
    "Suite",
    "SuiteError",
    "TaskResult",
    "TaskSpec",
    "encode_pair",
    "load_suite",
    "pass_at_k",
    "run_program",
    "run_suite",
    "run_task",
    "suite_from_config",
]
