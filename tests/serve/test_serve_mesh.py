"""Serving on a mesh of 8 simulated CPU devices (tests/serve_mesh_checks.py in a subprocess):
through the HTTP API, with prefix caching and preemption active, greedy completions and their
log-probs on `expert=8` (float weights) and `tensor=2,expert=4` (FP8-quantized weights) equal
the full forward's on one device with the same weights, and the weights were loaded straight into
their shardings."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MESHES = ["expert=8", "tensor=2,expert=4@fp8"]


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                         os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "serve_mesh_checks.py"), *MESHES],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    return {r["mesh"]: r for r in map(json.loads, lines)}


def test_mesh_serving_equals_one_device(results):
    for mesh in MESHES:
        single = results["1@fp8" if mesh.endswith("@fp8") else "1"]  # glm5_jax.forward on one device
        got = results[mesh]
        assert got["placed"], f"{mesh}: weights not in their shardings"
        assert got["tokens"] == single["tokens"], mesh
        assert got["again"] == got["tokens"], f"{mesh}: prefix-cache hits changed the output"
        for have, want in zip(got["logprobs"], single["logprobs"], strict=True):
            np.testing.assert_allclose(have, want, atol=1e-4, err_msg=mesh)
        assert got["preemptions"] > 0 and min(got["cached"]) >= 12, mesh
    # Routed experts split over `expert` (8 experts), their hidden units over `tensor` (32).
    assert results["expert=8"]["expert_shard"][1:] == [1, 64, 32]
    assert results["tensor=2,expert=4@fp8"]["expert_shard"][1:] == [2, 64, 16]  # FP8 values, split alike
    # The quantized weights really ran (their log-probs differ from the float weights').
    assert not np.allclose(results["1@fp8"]["logprobs"][0], results["1"]["logprobs"][0], atol=1e-4)


def test_plan_serve_places_weights_as_the_server_does():
    """`plan --serve` compiles the step serve.py --mesh runs (FP8 weights split like the
    runner's, per layer when unrolled; the page pool replicated) and reports per-device memory;
    with --processes, which axes cross the processes and the bytes sent across and inside them."""
    run = subprocess.run([sys.executable, "-m", "glm5_jax.plan", "--config", "configs/tiny.py", "--serve",
                          "--mesh", "tensor=2,expert=4", "--batch", "4", "--context", "64",
                          "--page-size", "4",
                          "--quantize", "fp8", "--top", "40", "--set", "scan_unroll=8",  # per-layer weights
                          "--processes", "2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout
    assert "weights (fp8)" in out and "latent page pool" in out and "replicated" in out
    # Devices 0-3 on one process, 4-7 on the other: `expert` (outer) crosses, `tensor` does not.
    assert "processes: 2 of 4 devices; across processes: expert; within a process: tensor" in out
    sent = re.search(r"across processes ([\d.]+) kB, inside one ([\d.]+) kB", out)
    across, inside = (float(x) for x in sent.groups())
    assert across > 0 and inside > 0
    experts = next(line for line in out.splitlines() if "moe/gate_proj/.values" in line)
    assert "float8_e4m3fn" in experts and "'expert'" in experts and "'tensor'" in experts
