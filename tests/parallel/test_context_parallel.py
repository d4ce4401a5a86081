"""Context parallelism: a `context` mesh axis splits every sequence (glm5_jax/parallel/sharding.py
maps the logical `length` axis to it; model/mla.py gathers only the keys' side).

Mesh parsing, the rules and the length check run here. The equivalence runs in one subprocess
with 8 fake CPU devices (this file run as a script): loss, every gradient and logits against one
device, for a tiny model (an MoE sliding-window layer and the MTP head, an MoE DSA layer keeping
8 of up to 48 keys; two packed documents per row) on context=8, and for one MoE DSA layer with
the Pallas attention and indexer kernels on data=2,context=2,expert=2 (expert-parallel
all_to_all of tokens split by context too); plus what the compiled programs hold. Every test of
the group reads its results.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from glm5_jax.config_files import load_model_config
from glm5_jax.model.transformer import forward, param_shapes
from glm5_jax.parallel import sharding, shards
from glm5_jax.parallel.mesh import MESH_AXES, MeshSpec

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-5
BATCH, LENGTH = 4, 48  # the subprocess's batch: 4 rows (data x expert), 48 positions (context 8 x 6)
# configs/tiny.py's widths, to recognise arrays in the compiled context=8 program.
HIDDEN, LATENT, ROPE, INDEX_DIM = 64, 32, 16, 32


def test_mesh_spec_parses_the_context_axis():
    spec = MeshSpec.parse("data=2,context=4")
    assert spec.context == 4 and MESH_AXES.index("context") == MESH_AXES.index("fsdp") + 1
    assert spec.sizes(8) == dict(pipeline=1, data=2, fsdp=1, context=4, expert=1, tensor=1)
    assert MeshSpec.parse("context=-1,expert=2").sizes(16)["context"] == 8
    assert MeshSpec.from_dict({"data": 2}).context == 1  # configs without the axis keep working


def test_rules_split_length_over_context_and_weights_over_fsdp_and_context():
    with nn.logical_axis_rules(sharding.DEFAULT_RULES):
        activations = nn.logical_to_mesh_axes(("batch", "length", "embed"))
        weight = nn.logical_to_mesh_axes(("embed", "q_lora"))
    assert tuple(activations) == (("data", "fsdp", "expert"), "context", None)
    assert tuple(weight) == (("fsdp", "context"), None)  # a weight's first such axis takes both
    serving = dict(sharding.SERVING_RULES)
    assert serving["length"] is None and serving["batch"] is None  # serving keeps tokens whole


def test_a_length_the_context_axis_does_not_divide_is_refused():
    config = load_model_config("configs/tiny.py", num_layers=1, num_dense_layers=1, num_mtp_layers=0)
    params = param_shapes(config)
    # data=2, context=4: traced on an abstract mesh, nothing compiled.
    mesh = jax.sharding.AbstractMesh((1, 2, 1, 4, 1, 1), MESH_AXES,
                                     axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        assert (shards("length"), shards("batch"), shards("embed")) == (4, 2, 4)
        with pytest.raises(ValueError, match="sequence length 6 does not split evenly over the 4 devices"):
            jax.eval_shape(lambda params, ids: forward(config, params, ids), params,
                           jax.ShapeDtypeStruct((2, 6), jnp.int32))


CONTEXT_CHECKS = pytest.mark.xdist_group("context_parallel_checks")


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {result["mesh"]: result for result in lines}


@CONTEXT_CHECKS
@pytest.mark.parametrize("mesh", ["context=8", "data=2,context=2,expert=2@pallas"])
def test_loss_gradients_and_logits_equal_one_device(results, mesh):
    result = results[mesh]
    assert result["loss_rel"] < RTOL
    assert result["grad_rel"] < RTOL
    assert result["logits_rel"] < RTOL
    assert result["selection_matters"]  # DSA layers choose 8 of up to 48 keys: top-k is not all


@CONTEXT_CHECKS
def test_activations_are_split_and_only_the_keys_side_is_gathered(results):
    result = results["context=8"]
    # Each device holds 48 / 8 = 6 positions of each row: the inputs and the logits.
    assert result["input_shard"] == [BATCH, LENGTH // 8]
    assert result["logits_shard"][:2] == [BATCH, LENGTH // 8]
    gathered = {tuple(shape) for shape in result["sequence_gathers"]}
    # The MLA latent, the rope key and the indexer keys, whole sequence, on every device...
    assert {(BATCH, LENGTH, LATENT), (BATCH, LENGTH, ROPE), (BATCH, LENGTH, INDEX_DIM)} <= gathered
    # ...and never the hidden states.
    assert all(shape[-1] != HIDDEN for shape in gathered)


@CONTEXT_CHECKS
def test_expert_parallelism_composes_with_context(results):
    result = results["data=2,context=2,expert=2@pallas"]
    assert result["expert_all_to_all"]  # tokens dispatched over `expert`
    assert result["kernel_query_rows"] == LENGTH // 2  # a kernel sees its device's queries...
    assert result["kernel_key_rows"] == LENGTH  # ...and every key


# --- the subprocess: 8 fake CPU devices ------------------------------------------------------------


def main():
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from reference import random_params

    import kernels_pallas.sparse_attention as sparse_module
    from glm5_jax.model.config import mesh_requirements
    from glm5_jax.model.options import ExecutionOptions
    from glm5_jax.model.transformer import apply_model, param_logical_axes
    from glm5_jax.parallel.mesh import make_mesh
    from glm5_jax.train.loss import language_model_losses
    from glm5_jax.train.settings import TrainSettings

    jax.config.update("jax_default_matmul_precision", "highest")
    # An MoE sliding-window layer (window 12: crosses shard boundaries) and the MTP head (an MoE
    # DSA layer); the Pallas run (slow to compile in interpret mode) one MoE DSA layer only.
    config = load_model_config("configs/tiny.py", num_layers=1, num_dense_layers=0,
                               attention_types=["sliding_window"], sliding_window=12)
    moe_only = load_model_config("configs/tiny.py", num_layers=1, num_dense_layers=0, num_mtp_layers=0)
    settings = TrainSettings(batch_size=BATCH)
    rng = np.random.default_rng(0)
    ids = rng.integers(2, config.vocab_size, (BATCH, LENGTH)).astype(np.int32)
    positions = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), ids.shape)
    # Two packed documents per row, the boundary (29) inside a context shard.
    segments = np.where(positions < 29, 1, 2).astype(np.int32)
    batch = {"input_ids": ids, "positions": np.where(positions < 29, positions, positions - 29),
             "segment_ids": segments}

    def program(model, options):
        """The training loss (as train/step.py's make_loss_fn), its gradients and the logits."""

        def loss_fn(params, batch):
            outputs = apply_model(model, params, batch["input_ids"], batch["positions"],
                                  batch["segment_ids"], with_mtp=True, collect_intermediates=True,
                                  options=options)
            loss, _ = language_model_losses(
                outputs, batch["input_ids"], batch["segment_ids"], z_loss_weight=settings.z_loss_weight,
                mtp_loss_weight=settings.mtp_loss_weight, balance_loss_weight=settings.balance_loss_weight)
            return loss, outputs["logits"]

        def run(params, batch):
            (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
            return loss, grads, logits

        return run

    seen = {}  # shapes the sparse attention kernel is called with (traced per device)
    kernel = sparse_module.sparse_attention

    def recording(q_latent, q_rope, latent, *args, **kwargs):
        seen["query_rows"], seen["key_rows"] = q_latent.shape[1], latent.shape[1]
        return kernel(q_latent, q_rope, latent, *args, **kwargs)

    sparse_module.sparse_attention = recording
    runs = {"context=8": (config, ExecutionOptions(moe_impl="dense")),
            "data=2,context=2,expert=2@pallas": (moe_only, ExecutionOptions(
                moe_impl="dense", attention_impl="pallas", indexer_impl="pallas"))}
    # XLA compiles outside the GIL: each program compiles on the other core while the next traces.
    pool = ThreadPoolExecutor(2)
    compiling, params, placed, kernel_seen = {}, {}, {}, {}
    for name, (model, options) in runs.items():
        params[name] = random_params(model, 0)
        compiling[(name, "one device")] = pool.submit(
            jax.jit(program(model, options)).lower(params[name], batch).compile)
        mesh = make_mesh(MeshSpec.parse(name.partition("@")[0]), mesh_requirements(model))
        shardings = (sharding.param_shardings(param_logical_axes(model), mesh), sharding.batch_sharding(mesh))
        with sharding.activate(mesh, sharding.DEFAULT_RULES):
            placed[name] = jax.device_put((params[name], batch), shardings)
            compiling[(name, "mesh")] = pool.submit(
                jax.jit(program(model, options), in_shardings=shardings).lower(*placed[name]).compile)
        kernel_seen[name] = dict(seen)  # the last call: a layer's attention on this mesh
    compiled = {key: future.result() for key, future in compiling.items()}
    pool.shutdown()

    def relative(got, want) -> float:
        worst = 0.0
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            worst = max(worst, float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30))
        return worst

    for name in runs:
        want_loss, want_grads, want_logits = compiled[(name, "one device")](params[name], batch)
        executable = compiled[(name, "mesh")]
        loss, grads, logits = executable(*placed[name])
        hlo = executable.as_text()
        result = {"mesh": name, "loss_rel": abs(float(loss) - float(want_loss)) / abs(float(want_loss)),
                  "grad_rel": relative(grads, want_grads), "logits_rel": relative(logits, want_logits),
                  "input_shard": list(placed[name][1]["input_ids"].addressable_shards[0].data.shape),
                  "logits_shard": list(logits.addressable_shards[0].data.shape),
                  # all-gathers whose result spans the whole sequence in its second axis
                  "sequence_gathers": [[int(d) for d in dims.split(",")] for dims in re.findall(
                      rf"= f32\[(\d+,{LENGTH},\d+)\]\{{[\d,]*\}} all-gather\(", hlo)],
                  # the MoE's dispatch (an all-to-all inside its shard_map)
                  "expert_all_to_all": bool(re.search(r'all-to-all\(.*op_name="[^"]*moe/shard_map', hlo)),
                  "kernel_query_rows": kernel_seen[name].get("query_rows"),
                  "kernel_key_rows": kernel_seen[name].get("key_rows"),
                  "selection_matters": runs[name][0].index_topk < LENGTH}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in tests/
    main()
