"""Communication accounting (glm5_jax.parallel.collectives) and the bf16 gradient reduction.

Parsing: a hand-written HLO module with every collective kind, the three replica-group forms and
nested loops, checked against the ring formulas by hand. Real programs: one subprocess with 8
fake CPU devices (this file run as a script) compiles a shard_map program whose collectives have
known sizes inside a 3-step scan, and a one-layer train step with grad_reduce_dtype "" (XLA's
float32 reduction) and "bfloat16" (over 2 microbatches) on data=8; every test reads its results.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm5_jax.parallel import collectives

ROOT = Path(__file__).resolve().parents[2]

# An outer loop of 4 (known trip count) around an inner loop of 3 (bound read from its
# condition); the all-reduce and the all-to-all run 4 times, the rest 12 times. A backslash ends
# a line of this string where an HLO instruction continues on the next.
HLO = """HloModule hand_written, num_partitions=8

FileNames
1 "/x/kernels_pallas/some_kernel.py"
FunctionNames
1 "kernel"
FileLocations
1 {file_name_id=1 function_name_id=1 line=7 end_line=7 column=1 end_column=1}
StackFrames
1 {file_location_id=1 parent_frame_id=1}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%inner_cond (p: (s32[], bf16[4,8])) -> pred[] {
  %p = (s32[], bf16[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %bound = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %bound), direction=LT
}

%inner_body (p.1: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %p.1 = (s32[], bf16[4,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %v = bf16[4,8]{1,0} get-tuple-element(%p.1), index=1
  %gathered = bf16[8,8]{1,0} all-gather(%v), channel_id=3, replica_groups=[4,2]<=[8], dimensions={0}
  %scattered = f32[2,8]{1,0} reduce-scatter(f32[8,8]{1,0} %wide), channel_id=4, \
replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add
  %wide = f32[8,8]{1,0} convert(%gathered)
  %passed = bf16[4,8]{1,0} collective-permute(%v), channel_id=5, \
source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %ragged = f32[16,8]{1,0} ragged-all-to-all(f32[4,8]{1,0} %rows, f32[16,8]{1,0} %out, \
s32[8]{0} %o, s32[8]{0} %s, s32[8]{0} %o, s32[8]{0} %s), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}
  %in_kernel = bf16[4,8]{1,0} all-to-all(%v), channel_id=7, replica_groups={{0,1},{2,3},{4,5},{6,7}}, \
dimensions={0}, metadata={op_name="k" stack_frame_id=1}
  %one = s32[] constant(1)
  %next = s32[] add(%i.1, %one)
  ROOT %t = (s32[], bf16[4,8]{1,0}) tuple(%next, %passed)
}

%outer_body (q: (s32[], f32[64])) -> (s32[], f32[64]) {
  %q = (s32[], f32[64]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %a = f32[64]{0} get-tuple-element(%q), index=1
  %reduced = f32[64]{0} all-reduce(%a), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, \
use_global_device_ids=true, to_apply=%add
  %pairs = (f32[64]{0}, bf16[32]{0}) all-to-all(%a, %h), channel_id=2, \
replica_groups=mesh['x'=2,'y'=4] {'x'}, dimensions={0}
  %h = bf16[32]{0} parameter(1)
  %init = (s32[], bf16[4,8]{1,0}) tuple(%j, %h)
  %loop = (s32[], bf16[4,8]{1,0}) while(%init), condition=%inner_cond, body=%inner_body
  ROOT %r = (s32[], f32[64]{0}) tuple(%j, %reduced)
}

%outer_cond (q.1: (s32[], f32[64])) -> pred[] {
  %q.1 = (s32[], f32[64]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (arg: f32[64]) -> f32[64] {
  %arg = f32[64]{0} parameter(0)
  %zero = s32[] constant(0)
  %start = (s32[], f32[64]{0}) tuple(%zero, %arg)
  %outer = (s32[], f32[64]{0}) while(%start), condition=%outer_cond, body=%outer_body, \
backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[64]{0} get-tuple-element(%outer), index=1
}
"""


def by_name(found):
    return {c.name: c for c in found}


def test_hand_written_module_bytes_groups_and_counts():
    found = by_name(collectives.parse_collectives(HLO))
    assert set(found) == {"reduced", "pairs", "gathered", "scattered", "passed", "ragged", "in_kernel"}
    reduced = found["reduced"]
    assert (reduced.count, reduced.group_size, reduced.dtype) == (4, 4, "f32")
    assert reduced.bytes_moved == 2 * 3 / 4 * 256  # f32[64] over groups of 4
    pairs = found["pairs"]  # a tuple all-to-all over mesh axis 'x' (size 2): groups {i, i + 4}
    assert pairs.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert pairs.bytes_moved == 1 / 2 * (256 + 64)
    gathered = found["gathered"]
    assert gathered.count == 12 and gathered.groups[0] == (0, 1)
    assert gathered.bytes_moved == 1 * 64  # (n - 1) x the bf16[4,8] shard = 1/2 of the gathered 128
    scattered = found["scattered"]  # [2,4]<=[4,2]T(1,0): groups {0,2,4,6}, {1,3,5,7}
    assert scattered.groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert scattered.bytes_moved == 3 / 4 * 256
    assert found["passed"].bytes_moved == 64 and found["passed"].count == 12
    assert found["ragged"].bytes_moved == 7 / 8 * 128  # the send buffer only
    assert found["in_kernel"].in_interpreted_kernel and not reduced.in_interpreted_kernel
    totals = collectives.bytes_by_kind(collectives.counted(found.values()))
    assert totals["all-reduce"] == 4 * 384 and totals["all-to-all"] == 4 * 160
    assert totals["all-gather"] == 12 * 64 and totals["reduce-scatter"] == 12 * 192


def test_mesh_axes_groups_with_sub_axes_and_device_order():
    groups = collectives._groups("replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}", 8)
    assert groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    groups = collectives._groups("replica_groups=mesh['a'=8] {'a':(2)2}", 8)  # a = [2][2][2]: the middle
    assert groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert collectives._groups("replica_groups={}", 8) == (tuple(range(8)),)


def test_time_model_links_and_fractions():
    found = collectives.parse_collectives(HLO)
    h200 = collectives.SYSTEMS["h200"]
    reduced = by_name(found)["reduced"]
    assert collectives.link_of(reduced, h200) is h200.local  # devices 0-3 and 4-7: inside a node of 8
    wide = collectives.Collective("all-reduce", "w", "f32", 1e9, 1e9, (tuple(range(16)),), 1)
    assert collectives.link_of(wide, h200) is h200.remote
    estimate = collectives.estimate([wide], 989e12 * 0.03, h200)
    assert estimate.comm_seconds == pytest.approx(2 * 15 / 16 * 1e9 / 50e9)  # 37.5 ms
    assert estimate.compute_seconds == pytest.approx(0.03)
    assert estimate.fraction_no_overlap == pytest.approx(0.0375 / 0.0675)
    assert estimate.fraction_perfect_overlap == pytest.approx(0.0075 / 0.0375)


def test_dot_flops_count_loop_iterations():
    text = HLO.replace(
        "%one = s32[] constant(1)",
        "%one = s32[] constant(1)\n"
        "  %d = f32[4,4]{1,0} dot(f32[4,8]{1,0} %rows, f32[8,4]{1,0} %cols), "
        "lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    )
    text = text.replace("%i.1 = s32[]", "%rows = f32[4,8]{1,0} parameter(1)\n  %i.1 = s32[]")
    assert collectives.dot_flops(text) == 12 * 2 * 16 * 8


# --- real programs on 8 simulated devices (one subprocess) --------------------------------------


MESH_RESULTS = pytest.mark.xdist_group("collectives_mesh")  # one worker runs the subprocess once


@pytest.fixture(scope="module")
def mesh_results():
    # The repository and tests/ (the shared helpers: reference.py) on the subprocess's path.
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@MESH_RESULTS
def test_compiled_collectives_match_the_ring_formulas(mesh_results):
    kinds = mesh_results["collectives"]
    size = 64 * 32 * 4  # f32[64, 32] per device
    assert kinds["all-reduce"] == {"bytes": 3 * 2 * 3 / 4 * size, "count": 3}  # psum over b (4), 3 steps
    assert kinds["all-gather"] == {"bytes": 3 * 1 * size, "count": 3}  # all_gather over a (2)
    assert kinds["reduce-scatter"] == {"bytes": 3 * 3 / 4 * size, "count": 3}  # psum_scatter over b
    assert kinds["all-to-all"] == {"bytes": 3 * 3 / 4 * size, "count": 3}
    assert kinds["collective-permute"] == {"bytes": 3 * size, "count": 3}


@MESH_RESULTS
def test_bf16_gradient_reduction_halves_the_bytes(mesh_results):
    f32, bf16 = mesh_results["step"][""], mesh_results["step"]["bfloat16"]
    params, unused = mesh_results["params"], mesh_results["unused_params"]
    ring = 2 * 7 / 8  # all-reduce over data=8
    # XLA reduces each used weight's f32 gradient where it is computed (the indexer's, unused by a
    # sliding-window layer, is a known zero); the option sums every accumulated gradient once, in
    # bf16: 4 -> 2 bytes per parameter. What is left in f32 is the loss metrics.
    assert set(f32["all_reduce"]) == {"f32"}
    assert f32["all_reduce"]["f32"] == pytest.approx(ring * 4 * (params - unused), rel=1e-3)
    assert bf16["all_reduce"]["bf16"] == pytest.approx(ring * 2 * params, rel=1e-6)
    assert bf16["all_reduce"].get("f32", 0) < 100


@MESH_RESULTS
def test_bf16_gradient_reduction_stays_close(mesh_results):
    f32, bf16 = mesh_results["step"][""], mesh_results["step"]["bfloat16"]
    # Two microbatches of 8 full rows: their mean loss is the mean over the 16 rows.
    assert bf16["loss"] == pytest.approx(f32["loss"], rel=1e-6)
    # Each replica's gradient is rounded to bf16 (relative error 2^-9) and 8 are summed in bf16.
    assert abs(bf16["grad_norm"] - f32["grad_norm"]) / f32["grad_norm"] < 1e-2


def test_grad_reduce_dtype_is_validated():
    from glm5_jax.model.config import ConfigError
    from glm5_jax.train.settings import TrainSettings

    with pytest.raises(ConfigError, match="grad_reduce_dtype"):
        TrainSettings(grad_reduce_dtype="float16").validate()


@MESH_RESULTS
def test_replicas_that_cannot_be_vmapped_are_refused(mesh_results):
    assert "attention_impl=pallas" in mesh_results["refused"]


def main():
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from reference import random_params

    from glm5_jax.config_files import load_model_config
    from glm5_jax.model.config import mesh_requirements
    from glm5_jax.model.options import ExecutionOptions
    from glm5_jax.parallel import sharding
    from glm5_jax.parallel.mesh import MeshSpec, make_mesh
    from glm5_jax.train.optimizer import make_optimizer
    from glm5_jax.train.settings import TrainSettings
    from glm5_jax.train.step import init_train_state, make_train_step, place_train_state

    jax.config.update("jax_default_matmul_precision", "highest")
    lowered = {}
    # 1. Every kind once per step of a 3-step scan, on f32[64, 32] per device.
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def body(x):
        def step(carry, _):
            summed = jax.lax.psum(carry, "b")
            gathered = jax.lax.all_gather(carry, "a", tiled=True)[:64]
            scattered = jax.lax.psum_scatter(carry, "b", tiled=True)
            swapped = jax.lax.all_to_all(carry, "b", 0, 0, tiled=True)
            passed = jax.lax.ppermute(carry, "b", [(i, (i + 1) % 4) for i in range(4)])
            return summed + gathered + swapped + passed + jnp.tile(scattered, (4, 1)), None

        return jax.lax.scan(step, x, None, length=3)[0]

    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b"))))
    lowered["program"] = program.lower(
        jax.ShapeDtypeStruct((8 * 64, 32), jnp.float32, sharding=NamedSharding(mesh, P(("a", "b"))))
    )

    # 2. One train step of a one-layer model on data=8, gradients reduced by XLA (float32) or in bf16.
    config = load_model_config(
        "configs/tiny.py",
        num_layers=1,
        num_dense_layers=1,
        num_mtp_layers=0,
        attention_types=["sliding_window"],
        indexer_types=["full"],
        sliding_window=4,
    )
    options = ExecutionOptions(moe_impl="dense")
    mesh = make_mesh(MeshSpec.parse("data=8"), mesh_requirements(config))
    params = random_params(config, 0)
    ids = np.random.default_rng(0).integers(2, config.vocab_size, (16, 8)).astype(np.int32)
    batch = {
        "input_ids": ids,
        "segment_ids": np.ones_like(ids),
        "positions": np.broadcast_to(np.arange(8, dtype=np.int32), ids.shape),
    }
    batch = jax.device_put(batch, sharding.batch_sharding(mesh))
    states = {}
    for mode in ("", "bfloat16"):  # the bf16 step accumulates 2 microbatches: the replica accumulators
        settings = TrainSettings(batch_size=16, grad_reduce_dtype=mode, grad_accum_steps=2 if mode else 1)
        optimizer = make_optimizer(settings)
        states[mode] = place_train_state(
            init_train_state(jax.tree.map(jnp.copy, params), optimizer),
            config,
            optimizer,
            mesh,
            options=options,
        )
        step = make_train_step(config, settings, optimizer, mesh, options=options)
        with sharding.activate(mesh):
            lowered[mode] = step.jitted.lower(states[mode], batch)
    try:  # refused where the replicas cannot be vmapped
        make_train_step(config, settings, optimizer, mesh, options=options.replace(attention_impl="pallas"))
    except ValueError as error:
        refused = str(error)
    with ThreadPoolExecutor(len(lowered)) as pool:  # XLA compiles outside the GIL: use both cores
        compiled = dict(
            zip(lowered, pool.map(collectives.compile_partitioned, lowered.values()), strict=True)
        )

    found = collectives.parse_collectives(compiled.pop("program")[1])
    out = {
        "collectives": {
            kind: {
                "bytes": sum(c.total_bytes for c in found if c.kind == kind),
                "count": sum(c.count for c in found if c.kind == kind),
            }
            for kind in {c.kind for c in found}
        },
        "step": {},
        "refused": refused,
        "params": sum(x.size for x in jax.tree.leaves(params)),
        "unused_params": sum(
            x.size
            for path, x in jax.tree_util.tree_leaves_with_path(params)
            if "indexer" in jax.tree_util.keystr(path)
        ),
    }
    for mode, (executable, hlo) in compiled.items():
        _, metrics = executable(states[mode], batch)
        reduces = [c for c in collectives.parse_collectives(hlo) if c.kind == "all-reduce"]
        out["step"][mode] = {
            "loss": float(metrics["loss"]),
            "grad_norm": float(metrics["grad_norm"]),
            "all_reduce": {
                d: sum(c.total_bytes for c in reduces if c.dtype == d) for d in {c.dtype for c in reduces}
            },
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
