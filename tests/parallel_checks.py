"""Multi-device checks, run by tests/parallel/test_parallel.py in a subprocess with 8 fake CPU devices
(XLA_FLAGS must be set before JAX starts). For each mesh: one train step's loss and gradients
against the single-device result, and which collectives the compiled HLO holds.

    python tests/parallel_checks.py "data=8" "fsdp=2,tensor=2,expert=2" ...

Prints one JSON object per line. A mesh suffixed "@cf=F" runs the forward loss only, with
expert_capacity_factor F (so tokens may be dropped); "@step" runs the full sharded train step;
"@pallas" compares the Pallas-kernel config sharded vs on one device; "@hybrid" the loss of a
GLM-5.3-Flash-style model (KDA, pooled DSA, hyper-connections) sharded vs on one device;
"@ragged" only lowers forward+backward with expert_dispatch="ragged_all_to_all" (XLA:CPU cannot
compile ragged_all_to_all; GPUs and TPUs can).
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from reference import random_params  # noqa: E402

from glm5_jax.config_files import load_model_config  # noqa: E402
from glm5_jax.model.config import mesh_requirements  # noqa: E402
from glm5_jax.model.options import ExecutionOptions  # noqa: E402
from glm5_jax.model.transformer import param_logical_axes  # noqa: E402
from glm5_jax.parallel import sharding  # noqa: E402
from glm5_jax.parallel.local import run_local  # noqa: E402
from glm5_jax.parallel.mesh import MeshSpec, make_mesh  # noqa: E402
from glm5_jax.train.optimizer import make_optimizer  # noqa: E402
from glm5_jax.train.settings import TrainSettings  # noqa: E402
from glm5_jax.train.step import init_train_state, make_loss_fn, make_train_step, place_train_state  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# 4 MoE layers (split into 2 or 4 pipeline stages), no dense prefix and no MTP head: the
# smallest graph that exercises every parallel path (compile time dominates this check).
CONFIG = load_model_config("configs/tiny.py", num_layers=4, num_dense_layers=0, num_mtp_layers=0)
OPTIONS = ExecutionOptions(moe_impl="blocked")
# "@hybrid": GLM-5.3-Flash's layers (KDA, MLA with NoPE and pooled DSA, hyper-connections) on the
# same sizes: KDA heads split over `tensor` like MLA's, the streams whole.
HYBRID = CONFIG.replace(attention_types=["linear", "linear", "dsa", "linear"], qk_rope_head_dim=0,
                        linear_num_heads=4, linear_head_dim=8, hc_mult=2, index_kpool=2, swiglu_limit=1.0)
SETTINGS = TrainSettings(batch_size=8)
BATCH_ROWS, LENGTH = 8, 16


def make_batch():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(2, CONFIG.vocab_size, (BATCH_ROWS, LENGTH)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), ids.shape)
    # Two packed documents per row: attention and losses must respect segment boundaries.
    segments = jnp.where(positions < LENGTH // 2, 1, 2).astype(jnp.int32)
    positions = jnp.where(positions < LENGTH // 2, positions, positions - LENGTH // 2)
    return {"input_ids": ids, "positions": positions, "segment_ids": segments}


def relative_error(got, want) -> float:
    """max over leaves of max|got - want| / max|want| (in numpy: eager jnp ops on differently
    sharded leaves would compile one program per leaf and op)."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        worst = max(worst, float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30))
    return worst


def local_shape_seen(mesh) -> list[int]:
    """The shape a function wrapped by run_local sees for an [8, 3, 4, 2] ("batch", -, "heads", -)
    input on this mesh."""
    seen = []

    def record(x):
        seen.append(x.shape)
        return x

    heads = ("batch", None, "heads", None)
    with sharding.activate(mesh, sharding.DEFAULT_RULES):
        jax.jit(lambda x: run_local(record, (x,), (heads,), heads)).trace(jnp.zeros((8, 3, 4, 2)))
    return list(seen[0])


def main(meshes):
    params = random_params(CONFIG, 0)
    batch = make_batch()
    value_and_grad = jax.value_and_grad(make_loss_fn(CONFIG, SETTINGS, OPTIONS), has_aux=True)
    (loss, _), grads = jax.jit(value_and_grad)(params, batch)
    for text in meshes:
        text, _, variant = text.partition("@")
        config, options = CONFIG, OPTIONS
        if variant.startswith("cf="):
            options = OPTIONS.replace(expert_capacity_factor=float(variant[3:]))
        mesh = make_mesh(MeshSpec.parse(text), mesh_requirements(config))
        param_shardings = sharding.param_shardings(param_logical_axes(config), mesh)
        batch_sharding = sharding.batch_sharding(mesh)
        placed_batch = jax.device_put(batch, batch_sharding)
        result = {"mesh": text, "variant": variant}
        if variant == "hybrid":
            # The loss only (its backward is the same program's transpose; compile time dominates).
            hybrid_params = random_params(HYBRID, 1)
            loss_fn = make_loss_fn(HYBRID, SETTINGS, OPTIONS)
            want, _ = jax.jit(loss_fn)(hybrid_params, batch)
            shardings = sharding.param_shardings(param_logical_axes(HYBRID), mesh)
            with sharding.activate(mesh, sharding.DEFAULT_RULES):
                got, _ = jax.jit(loss_fn, in_shardings=(shardings, batch_sharding))(
                    jax.device_put(hybrid_params, shardings), placed_batch)
            kda = shardings["layers_0_to_1"]["linear_attention"]
            result.update(loss_rel=abs(float(got) - float(want)) / abs(float(want)),
                          q_proj_spec=str(kda["q_proj"].spec), o_proj_spec=str(kda["o_proj"].spec),
                          hc_fn_spec=str(shardings["layers_0_to_1"]["attn_hc"]["fn"].spec))
        elif variant == "pallas":  # the Pallas kernels (interpreted) run per device via shard_map
            options = OPTIONS.replace(attention_impl="pallas", indexer_impl="pallas", moe_impl="pallas")
            grad_fn = jax.value_and_grad(make_loss_fn(config, SETTINGS, options), has_aux=True)
            (want, _), want_grads = jax.jit(grad_fn)(params, batch)
            shardings = sharding.param_shardings(param_logical_axes(config), mesh)
            with sharding.activate(mesh, sharding.DEFAULT_RULES):
                compiled = jax.jit(grad_fn, in_shardings=(shardings, batch_sharding)).lower(
                    jax.device_put(params, shardings), placed_batch).compile()
                (got, _), got_grads = compiled(jax.device_put(params, shardings), placed_batch)
            result.update(local_shape=local_shape_seen(mesh),
                          loss_rel=abs(float(got) - float(want)) / abs(float(want)),
                          grad_rel=relative_error(got_grads, want_grads),
                          reference_loss_rel=abs(float(want) - float(loss)) / abs(float(loss)))
        elif variant == "ragged":
            options = OPTIONS.replace(expert_dispatch="ragged_all_to_all", moe_impl="ragged")
            abstract = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params,
                                    sharding.param_shardings(param_logical_axes(config), mesh))
            ragged_grad = jax.value_and_grad(make_loss_fn(config, SETTINGS, options), has_aux=True)
            with sharding.activate(mesh, sharding.DEFAULT_RULES):
                lowered = jax.jit(ragged_grad).trace(abstract, placed_batch).lower().as_text()
            result.update(ragged_all_to_all=lowered.count("ragged_all_to_all"))
        elif variant == "step":
            optimizer = make_optimizer(SETTINGS)
            # A copy: the step donates its state, and placing may reuse `params`' buffers.
            state = place_train_state(init_train_state(jax.tree.map(jnp.copy, params), optimizer), config,
                                      optimizer, mesh, options=options)
            step = make_train_step(config, SETTINGS, optimizer, mesh, options=options)
            new_state, metrics = step(state, placed_batch)
            shardings_kept = all(
                a.sharding.is_equivalent_to(b.sharding, a.ndim)
                for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state), strict=True))
            reference_norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(g)))
                                               for g in jax.tree.leaves(grads))))
            result.update(loss_rel=abs(float(metrics["loss"]) - float(loss)) / abs(float(loss)),
                          grad_norm_rel=abs(float(metrics["grad_norm"]) - reference_norm) / reference_norm,
                          shardings_kept=bool(shardings_kept), step=int(new_state.step))
        else:
            fn = make_loss_fn(config, SETTINGS, options) if variant else value_and_grad
            with sharding.activate(mesh, sharding.DEFAULT_RULES):
                compiled = jax.jit(fn, in_shardings=(param_shardings, batch_sharding)).lower(
                    jax.device_put(params, param_shardings), placed_batch).compile()
                out = compiled(jax.device_put(params, param_shardings), placed_batch)
            hlo = compiled.as_text()
            result.update(all_to_all="all-to-all" in hlo, collective_permute="collective-permute" in hlo)
            if variant:
                sharded_loss, (metrics, _) = out
                result.update(loss_rel=abs(float(sharded_loss) - float(loss)) / abs(float(loss)),
                              dropped=float(metrics.get("dropped_tokens", -1.0)),
                              copies=BATCH_ROWS * LENGTH * CONFIG.num_experts_per_token
                              * CONFIG.num_moe_layers)
            else:
                (sharded_loss, (metrics, _)), sharded_grads = out
                result.update(loss_rel=abs(float(sharded_loss) - float(loss)) / abs(float(loss)),
                              grad_rel=relative_error(sharded_grads, grads),
                              dropped=float(metrics.get("dropped_tokens", 0.0)))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
