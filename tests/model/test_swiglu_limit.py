"""The SwiGLU clamp (GLM-5.3-Flash's `swiglu_limit`; 0 = off, GLM-5): every routed-experts path
applies it (equal to a per-expert loop with the clamp, and different from the unclamped result),
moe_block and swiglu_mlp equal transformers' Glm5NextTextMoE and Glm5NextTextMLP, and the
expert-parallel dispatcher (a subprocess on 4 fake CPU devices) applies it too.

Weights are scaled so most gate/up pre-activations (std ~4) lie outside the limit."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model import kernel_calls
from glm5_jax.model.layers import swiglu, swiglu_mlp
from glm5_jax.model.moe import (
    MoESpec,
    input_major_experts,
    moe_block,
    routed_experts,
    routed_experts_blocked,
    routed_experts_dense,
    routed_experts_gathered,
    routed_experts_ragged,
)
from glm5_jax.quant.formats import dequantize, quantize

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 2.0
TOKENS, HIDDEN, INNER, EXPERTS, TOP_K = 12, 16, 8, 8, 2


def _problem(seed: int = 0):
    """x [T, D], routing weights and experts [T, K], gate/up [E, D, F], down [E, F, D] (float32)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(TOKENS, HIDDEN)).astype(np.float32)
    gate, up = (rng.normal(size=(EXPERTS, HIDDEN, INNER)).astype(np.float32) for _ in range(2))
    down = (rng.normal(size=(EXPERTS, INNER, HIDDEN)) / INNER ** 0.5).astype(np.float32)
    chosen = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(TOKENS)]).astype(np.int32)
    weights = rng.uniform(0.5, 1.0, size=(TOKENS, TOP_K)).astype(np.float32)
    return x, weights, chosen, gate, up, down


def _per_expert_loop(x, weights, chosen, gate, up, down, limit: float) -> np.ndarray:
    """The routed experts written out token by token, in float64 numpy."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    out = np.zeros((x.shape[0], down.shape[-1]))
    for t in range(x.shape[0]):
        for k in range(chosen.shape[1]):
            e = int(chosen[t, k])
            g, u = x[t] @ gate[e], x[t] @ up[e]
            if limit:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            out[t] += float(weights[t, k]) * (g / (1 + np.exp(-g)) * u) @ down[e]
    return out


def _spec(impl: str, limit: float, **overrides) -> MoESpec:
    fields = dict(hidden_size=HIDDEN, moe_intermediate_size=INNER, num_experts=EXPERTS,
                  num_experts_per_token=TOP_K, num_shared_experts=0, num_expert_groups=1,
                  num_selected_groups=1, normalize_topk_weights=True, routed_scaling_factor=1.0,
                  initializer_range=0.1, impl=impl, swiglu_limit=limit)
    return MoESpec(**(fields | overrides))


def _dispatched(impl: str):
    """moe.routed_experts (the dispatcher) with spec.impl = impl and the limit from the spec."""
    def run(*args, swiglu_limit: float = 0.0):
        return routed_experts(*args, _spec(impl, swiglu_limit))[0]
    return run


def _dispatched_gathered(x, weights, chosen, gate, up, down, swiglu_limit: float = 0.0):
    """The dispatcher on 4 tokens at a time: T * K = 8 <= E, so it takes the gathered path."""
    spec = _spec("ragged", swiglu_limit)
    return jnp.concatenate([routed_experts(x[i:i + 4], weights[i:i + 4], chosen[i:i + 4], gate, up, down,
                                           spec)[0] for i in range(0, x.shape[0], 4)])


def _input_major(routed):
    """`routed` given gate and up held input-major (the serving layout)."""
    def run(x, weights, chosen, gate, up, down, swiglu_limit: float = 0.0):
        return routed(x, weights, chosen, input_major_experts(gate), input_major_experts(up), down,
                      swiglu_limit=swiglu_limit)
    return run


def _gathered_fp8(impl: str):
    """The gathered path on fp8 expert stacks (quant.matmul impl "native" or "dequantize")."""
    def run(x, weights, chosen, gate, up, down, swiglu_limit: float = 0.0):
        stacks = [quantize(w, "fp8") for w in (gate, up, down)]
        return routed_experts_gathered(x, weights, chosen, *stacks, impl, swiglu_limit=swiglu_limit)
    return run


ROUTED = {
    "dense": routed_experts_dense,
    "blocked": routed_experts_blocked,
    "blocked_rows4": functools.partial(routed_experts_blocked, block_rows=4),
    "ragged": routed_experts_ragged,
    "gathered": routed_experts_gathered,
    "pallas": kernel_calls.routed_experts,  # interpret mode on CPU
    "pallas_local": kernel_calls.routed_experts_local,
    "dense_input_major": _input_major(routed_experts_dense),
    "gathered_input_major": _input_major(routed_experts_gathered),
    "gathered_fp8_native": _gathered_fp8("native"),
    "gathered_fp8_dequantize": _gathered_fp8("dequantize"),
    "dispatch_blocked": _dispatched("blocked"),
    "dispatch_pallas": _dispatched("pallas"),
    "dispatch_gathered": _dispatched_gathered,
    "dispatch_dense_input_major": _input_major(_dispatched("dense")),
}


def test_swiglu_by_hand():
    gate, up = jnp.array([3.0, -3.0, 0.5]), jnp.array([3.0, -3.0, 0.5])
    silu = jax.nn.silu
    np.testing.assert_allclose(swiglu(gate, up, 1.0), [silu(1.0) * 1.0, silu(-3.0) * -1.0, silu(0.5) * 0.5],
                               rtol=1e-6)
    np.testing.assert_allclose(swiglu(gate, up), silu(gate) * up, rtol=1e-6)  # 0 = no clamp
    assert swiglu(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16), 1.0).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="swiglu_limit must be >= 0"):
        swiglu(gate, up, -1.0)


@pytest.mark.parametrize("name", list(ROUTED))
def test_every_routed_experts_path_applies_the_limit(name):
    x, weights, chosen, gate, up, down = _problem()
    if name.startswith("gathered_fp8"):  # the expected values from the weights fp8 rounds to
        gate, up, down = (np.asarray(dequantize(quantize(jnp.asarray(w), "fp8"))) for w in (gate, up, down))
    pre_activations = np.einsum("TD,EDF->TEF", x, np.concatenate([gate, up], axis=-1))
    assert np.mean(np.abs(pre_activations) > LIMIT) > 0.5  # the limit bites
    clamped = _per_expert_loop(x, weights, chosen, gate, up, down, LIMIT)
    unclamped = _per_expert_loop(x, weights, chosen, gate, up, down, 0.0)
    assert np.max(np.abs(clamped - unclamped)) > 1.0
    x, weights, chosen, gate, up, down = _problem()
    routed = ROUTED[name]
    args = [jnp.asarray(a) for a in (x, weights, chosen, gate, up, down)]
    for got, expected, other in ((routed(*args, swiglu_limit=LIMIT), clamped, unclamped),
                                 (routed(*args), unclamped, clamped)):  # off by default
        if name == "gathered_fp8_native":
            # It also rounds the activations to fp8 (~5% off in norm); the clamp moves the result
            # by 80-400% of its norm, so closeness still tells which setting ran.
            relative = functools.partial(_relative_distance, np.asarray(got))
            assert relative(expected) < 0.1 and relative(other) > 0.5
        else:
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _relative_distance(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


# --- parity with transformers' GLM-5.3-Flash modules --------------------------------------------------


def _hf_config(limit: float):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    return Glm5NextTextConfig(hidden_size=HIDDEN, intermediate_size=24, moe_intermediate_size=INNER,
                              n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=2, topk_group=1,
                              n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                              hidden_act="silu", swiglu_limit=limit)


def _randomize(module, seed: int, std: float) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)


def _mlp_weights(mlp) -> dict:
    """HF nn.Linear weights [out, in] -> ours [in, out]."""
    return {name: jnp.asarray(getattr(mlp, name).weight.detach().numpy().T)
            for name in ("gate_proj", "up_proj", "down_proj")}


def test_moe_block_equals_glm5_next_moe():
    import torch
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMoE

    reference = Glm5NextTextMoE(_hf_config(LIMIT)).float().eval()
    _randomize(reference, seed=1, std=1.0)
    experts = reference.experts
    gate_up = experts.gate_up_proj.detach().numpy()  # [E, 2F, D]: gate rows first, then up
    weights = {
        "router": jnp.asarray(reference.gate.weight.detach().numpy().T),  # [D, E]
        "router_bias": jnp.asarray(reference.gate.e_score_correction_bias.numpy() * 0.1),
        "gate_proj": jnp.asarray(gate_up[:, :INNER].transpose(0, 2, 1)),  # [E, D, F]
        "up_proj": jnp.asarray(gate_up[:, INNER:].transpose(0, 2, 1)),
        "down_proj": jnp.asarray(experts.down_proj.detach().numpy().transpose(0, 2, 1)),  # [E, F, D]
        "shared_experts": _mlp_weights(reference.shared_experts),
    }
    with torch.no_grad():
        reference.gate.e_score_correction_bias.mul_(0.1)
        x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(2))
        expected = reference(x).numpy()
    for impl in ("ragged", "dense"):
        spec = _spec(impl, LIMIT, num_shared_experts=1, num_expert_groups=2, routed_scaling_factor=2.5)
        got, _ = moe_block(spec, weights, jnp.asarray(x.numpy()))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        unclamped, _ = moe_block(_spec(impl, 0.0, num_shared_experts=1, num_expert_groups=2,
                                       routed_scaling_factor=2.5), weights, jnp.asarray(x.numpy()))
        assert np.max(np.abs(np.asarray(unclamped) - expected)) > 1.0


def test_swiglu_mlp_equals_glm5_next_mlp():
    import torch
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMLP

    reference = Glm5NextTextMLP(_hf_config(LIMIT)).float().eval()
    _randomize(reference, seed=3, std=1.0)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(x).numpy()
    got = swiglu_mlp(jnp.asarray(x.numpy()), _mlp_weights(reference), swiglu_limit=LIMIT)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(np.asarray(swiglu_mlp(jnp.asarray(x.numpy()), _mlp_weights(reference)))
                         - expected)) > 1.0


# --- expert parallelism: 4 fake CPU devices in a subprocess ---------------------------------------------


def test_expert_parallel_dispatch_applies_the_limit():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    # training rules (tokens split over expert: all_to_all) and serving rules (tokens whole: psum),
    # experts split over `expert` and their hidden units over `tensor`.
    assert len(errors) == 8
    for case, (error, distance_to_other_setting) in errors.items():
        assert error < 1e-5 and distance_to_other_setting > 1.0, case


def main():
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from glm5_jax.parallel import sharding
    from glm5_jax.parallel.mesh import MeshSpec, make_mesh

    jax.config.update("jax_default_matmul_precision", "highest")
    x, weights, chosen, gate, up, down = _problem()
    args = [jnp.asarray(a) for a in (x, weights, chosen, gate, up, down)]
    mesh = make_mesh(MeshSpec.parse("expert=2,tensor=2"))
    errors = {}
    for rules_name, rules in (("training", sharding.DEFAULT_RULES), ("serving", sharding.SERVING_RULES)):
        for impl in ("ragged", "dense"):
            for limit in (LIMIT, 0.0):
                spec = _spec(impl, limit)
                with sharding.activate(mesh, rules):
                    program = jax.jit(lambda *a, spec=spec: routed_experts(*a, spec)[0])
                    got = program(*args)
                    collective = "all_to_all" if rules_name == "training" else "all_reduce"
                    assert collective in program.lower(*args).as_text(), (rules_name, "not expert-parallel")
                expected = _per_expert_loop(x, weights, chosen, gate, up, down, limit)
                other = _per_expert_loop(x, weights, chosen, gate, up, down, LIMIT if not limit else 0.0)
                key = f"{rules_name}/{impl}/limit={limit}"
                errors[key] = (float(np.max(np.abs(np.asarray(got) - expected))),
                               float(np.max(np.abs(np.asarray(got) - other))))
    print(json.dumps(errors))


if __name__ == "__main__":
    main()
