"""Distributed training: mesh validation, sharding rules, and (in subprocesses with 8 fake CPU
devices) loss and gradients on data/fsdp/tensor/expert/pipeline meshes equal to one device.

The mesh checks run in one subprocess (one JAX start-up and one single-device reference for all
meshes and variants), in one xdist group: every test of the group reads its results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm5_jax.model.config import mesh_requirements
from glm5_jax.parallel import sharding
from glm5_jax.parallel.mesh import MeshError, MeshSpec, check_divisible
from glm5_jax.parallel.pipeline import bubble_fraction, default_microbatches

ROOT = Path(__file__).resolve().parents[2]
# data x expert alone runs in VARIANTS (capacity factor, ragged dispatch); fsdp x tensor x expert
# covers dropless expert parallelism here.
MESHES = ["data=8", "fsdp=2,tensor=2,expert=2", "pipeline=2,data=2,expert=2", "pipeline=4,fsdp=2"]
VARIANTS = ["data=2,expert=4@cf=1", "fsdp=2,tensor=2,expert=2@step", "data=2,expert=4@ragged",
            "fsdp=2,tensor=2,expert=2@pallas", "fsdp=2,tensor=2,expert=2@hybrid"]
RTOL = 1e-5


MESH_CHECKS = pytest.mark.xdist_group("parallel_mesh_checks")  # the tests reading the subprocess's results


def run_checks(meshes):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "parallel_checks.py"), *meshes],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1500)
    assert run.returncode == 0, run.stderr[-4000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {(r["mesh"], r["variant"]): r for r in results}


@pytest.fixture(scope="module")
def results():
    return run_checks(MESHES + VARIANTS)


@MESH_CHECKS
@pytest.mark.parametrize("mesh", MESHES)
def test_loss_and_gradients_equal_single_device(results, mesh):
    result = results[(mesh, "")]
    assert result["loss_rel"] < RTOL
    assert result["grad_rel"] < RTOL
    assert result["dropped"] == 0.0  # dropless by default


@MESH_CHECKS
@pytest.mark.parametrize("mesh", MESHES)
def test_compiled_program_holds_the_expected_collectives(results, mesh):
    result = results[(mesh, "")]
    if "expert=" in mesh:
        assert result["all_to_all"]  # expert parallelism dispatches tokens
    elif not mesh.startswith("pipeline="):  # (microbatch reshapes may reshard with all-to-all)
        assert not result["all_to_all"]
    if mesh.startswith("pipeline="):
        assert result["collective_permute"]  # stages pass activations


@MESH_CHECKS
def test_capacity_factor_drops_and_reports_tokens(results):
    result = results[("data=2,expert=4", "cf=1")]
    assert 0 < result["dropped"] < result["copies"]
    assert result["loss_rel"] > 0  # dropped copies change the output


@MESH_CHECKS
def test_pallas_kernels_run_per_device_and_match(results):
    result = results[("fsdp=2,tensor=2,expert=2", "pallas")]
    # A kernel sees its device's rows (batch 8 over fsdp x expert = 4) and heads (4 over tensor = 2).
    assert result["local_shape"] == [2, 3, 2, 2]
    assert result["loss_rel"] < RTOL and result["grad_rel"] < RTOL  # vs the same kernels on one device
    assert result["reference_loss_rel"] < 1e-4  # and the kernels agree with the jnp reference


@MESH_CHECKS
def test_hybrid_model_shards_and_matches(results):
    """GLM-5.3-Flash's layers on fsdp x tensor x expert: the loss equals one device's; KDA
    projections split their heads over `tensor` (and their input over `fsdp`); the
    hyper-connections' small mixing weights stay whole (replicated), as do the few streams."""
    result = results[("fsdp=2,tensor=2,expert=2", "hybrid")]
    assert result["loss_rel"] < RTOL, result
    assert "tensor" in result["q_proj_spec"] and "tensor" in result["o_proj_spec"], result
    assert "tensor" not in result["hc_fn_spec"], result


@MESH_CHECKS
def test_ragged_dispatch_lowers_to_ragged_all_to_all(results):
    # Forward: tokens out and results back (rows + expert ids each way); backward: the transposes.
    assert results[("data=2,expert=4", "ragged")]["ragged_all_to_all"] >= 4


@MESH_CHECKS
def test_sharded_train_step_keeps_shardings_and_matches(results):
    result = results[("fsdp=2,tensor=2,expert=2", "step")]
    assert result["step"] == 1 and result["shardings_kept"]
    assert result["loss_rel"] < RTOL and result["grad_norm_rel"] < RTOL


def test_mesh_sizes_fill_and_validate():
    assert MeshSpec.parse("expert=4").sizes(8) == dict(pipeline=1, data=2, fsdp=1, context=1, expert=4,
                                                      tensor=1)
    assert MeshSpec.parse("data=2,fsdp=-1,tensor=2").sizes(16)["fsdp"] == 4
    with pytest.raises(MeshError, match="multiply to 6 .* 8 devices"):
        MeshSpec.parse("data=3,tensor=2").sizes(8)
    with pytest.raises(MeshError, match="not divisible"):
        MeshSpec.parse("data=-1,tensor=3").sizes(8)
    with pytest.raises(MeshError, match="unknown mesh axis model"):
        MeshSpec.parse("model=2")
    with pytest.raises(MeshError, match="at most one"):
        MeshSpec.parse("data=-1,fsdp=-1")
    with pytest.raises(MeshError, match="axis=size"):
        MeshSpec.parse("data:2")


def test_model_must_split_over_the_mesh(tiny_config):
    sizes = dict(pipeline=1, data=1, fsdp=1, expert=3, tensor=1)
    requirements = mesh_requirements(tiny_config)
    with pytest.raises(MeshError, match="num_experts=8 is not divisible by the expert axis"):
        check_divisible(sizes, requirements)
    with pytest.raises(MeshError, match="num_moe_layers=3 is not divisible by the pipeline axis"):
        check_divisible({**sizes, "expert": 1, "pipeline": 2}, requirements)
    with pytest.raises(MeshError, match="num_heads=4 is not divisible by the tensor axis"):
        check_divisible({**sizes, "expert": 1, "tensor": 8}, requirements)
    check_divisible({**sizes, "expert": 4}, requirements)  # 8 experts over 4


def test_rules_overrides_are_checked():
    rules = dict(sharding.make_rules({"vocab": None, "embed": ["fsdp", "data"]}))
    assert rules["vocab"] is None and rules["embed"] == ("fsdp", "data")
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
        sharding.make_rules({"hidden": "tensor"})
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        sharding.make_rules({"heads": "model"})


def test_pipeline_schedule_numbers():
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(1, 8) == 0.0
    assert default_microbatches(2, 8, 0) == 8
    assert default_microbatches(4, 8, 0) == 8  # 16 does not divide 8 rows; 2 x stages does
    with pytest.raises(ValueError, match="does not divide the batch"):
        default_microbatches(2, 8, 3)
