"""Weights that stay FP8 in the matmul: the Pallas weight-only FP8 kernel equals its jnp reference
and x @ dequantize(w) (both schedules, a 2-D weight and an expert stack read through group ids,
float32 and bfloat16, partial 128-blocks on both axes; interpret mode on CPU, and the Mosaic code
path in Pallas's TPU interpreter); it lowers to the Triton and Mosaic custom calls; input errors.
Then glm5_jax.quant.matmul's products against fp8 weights per impl, and the serving step
(paged_step) on an fp8-quantized tiny model with quantized_matmul = native / pallas against
dequantize.

Tolerances: float32 max error 1e-5 (the kernel applies each block scale to a partial sum
instead of to the weight: rounding order only); bfloat16 outputs 2e-2 (one output rounding).
"native" quantizes activations to float8 per 1x128 tile (W8A8), so it is checked within a bound.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from reference import perturbed_params

from glm5_jax.model.config import ConfigError
from glm5_jax.model.options import QUANTIZED_MATMUL_IMPLS, ExecutionOptions
from glm5_jax.model.paged_decode import StepBatch, init_paged_cache, paged_step
from glm5_jax.quant import dequantize, quantize, quantize_params
from glm5_jax.quant.matmul import IMPLS, expert_linear, head_inputs, head_outputs, linear
from kernels_pallas import fp8_matmul as fp8
from kernels_pallas.common import CUSTOM_CALL_MARKERS, lower_as_text
from kernels_pallas.fp8_matmul import Tiling, fp8_matmul, fp8_matmul_reference

# 300 = 2 * 128 + 44 contraction rows, 200 = 128 + 72 columns: partial blocks on both axes.
ROWS, CONTRACT, COLS, GROUPS = 5, 300, 200, 4
GROUP_IDS = [3, 0, 3, 1, 2, 0]  # a batch of 6 over 4 experts, with repeats and one unused
TOLERANCES = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _weight(shape, seed):
    """Normal weights whose magnitude varies by 10^2 across rows, so blocks get distinct scales."""
    rng = np.random.default_rng(seed)
    rows = np.logspace(-2, 0, shape[-2])[:, None]
    return jnp.asarray(rng.standard_normal(shape) * rows / np.sqrt(shape[-2]), jnp.float32)


@functools.cache
def _problem(grouped: bool, dtype):
    """(x, fp8 QuantizedTensor, group ids or None): x [ROWS, CONTRACT] and a [CONTRACT, COLS]
    weight, or x [6, 2, CONTRACT] and a [GROUPS, CONTRACT, COLS] expert stack."""
    shape = (len(GROUP_IDS), 2, CONTRACT) if grouped else (ROWS, CONTRACT)
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape), dtype)
    weight = quantize(_weight(((GROUPS,) if grouped else ()) + (CONTRACT, COLS), 2), "fp8")
    return x, weight, jnp.asarray(GROUP_IDS, jnp.int32) if grouped else None


@pytest.mark.parametrize("schedule,grouped,dtype,tiling", [
    ("grid", False, jnp.float32, Tiling(8, 128, 128, "grid")),  # 3 x 2 tiles, one sub-block each
    ("loop", True, jnp.float32, Tiling(16, 128, 32, "loop")),  # 7 column blocks, last one masked
    ("grid", True, jnp.bfloat16, Tiling(16, 256, 256, "grid")),  # 2 x 2 sub-blocks per tile
])
def test_kernel_matches_reference_and_dequantized_matmul(schedule, grouped, dtype, tiling):
    x, weight, ids = _problem(grouped, dtype)
    got = fp8_matmul(x, weight.values, weight.scales, group_ids=ids, tiling=tiling, backend="interpret")
    assert got.shape == x.shape[:-1] + (COLS,) and got.dtype == dtype
    want = fp8_matmul_reference(x, weight.values, weight.scales, group_ids=ids, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, **TOLERANCES[dtype])
    dense = dequantize(weight, jnp.float32)
    dense = dense if ids is None else dense[ids]
    expected = jnp.matmul(x.astype(jnp.float32), dense, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(want, expected, atol=1e-5, rtol=1e-5)
    assert float(jnp.std(expected)) > 0.1


# A CPU tool: where a TPU is the default device the compiled kernel is the real check.
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="TPU interpreter check runs on the CPU")
def test_mosaic_code_path_in_tpu_interpreter(monkeypatch):
    """The Mosaic variant (group ids by scalar prefetch, block scales in SMEM, VMEM accumulator)
    run by Pallas's TPU interpreter equals the reference on the expert stack."""
    monkeypatch.setattr(fp8, "call_options", lambda backend, **_: {"interpret": pltpu.InterpretParams()})
    x, weight, ids = _problem(True, jnp.float32)
    got = fp8.fp8_matmul(x, weight.values, weight.scales, group_ids=ids, backend="mosaic_tpu",
                         tiling=Tiling(16, 256, 128, "grid"))
    want = fp8_matmul_reference(x, weight.values, weight.scales, group_ids=ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOLERANCES[jnp.float32])


def test_bad_inputs_raise_clear_errors():
    x, weight, ids = _problem(True, jnp.float32)
    values, scales = weight.values, weight.scales
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_matmul(x, values.astype(jnp.float32), scales, group_ids=ids)
    with pytest.raises(ValueError, match="scales must be float32"):
        fp8_matmul(x, values, scales[:, :1], group_ids=ids)
    with pytest.raises(ValueError, match="contract dims differ"):
        fp8_matmul(x[..., :100], values, scales, group_ids=ids)
    with pytest.raises(ValueError, match="without group_ids"):
        fp8_matmul(x, values, scales)
    with pytest.raises(ValueError, match="group_ids must be"):
        fp8_matmul(x, values, scales, group_ids=ids[:2])
    with pytest.raises(ValueError, match="schedule='loop'"):
        fp8_matmul(x, values, scales, group_ids=ids, backend="triton", tiling=Tiling(16, 128, 128, "grid"))
    with pytest.raises(ValueError, match="dividing 128"):
        fp8_matmul(x, values, scales, group_ids=ids, tiling=Tiling(16, 128, 256, "loop"))


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_lowers_to_custom_call(backend):
    """GLM-5 decode shapes, bf16 activations: kv_a_proj [6144, 576] (576 = 4.5 blocks of columns)
    for 8 rows, and 8 tokens x top-8 experts read from the [256, 6144, 2048] stack by id."""
    sds = jax.ShapeDtypeStruct
    f8 = jnp.float8_e4m3fn
    single = functools.partial(fp8_matmul, backend=backend)
    stack = lambda x, v, s, ids: fp8_matmul(x, v, s, group_ids=ids, backend=backend)  # noqa: E731
    text = lower_as_text(single, sds((8, 6144), jnp.bfloat16), sds((6144, 576), f8),
                         sds((48, 5), jnp.float32), backend=backend)
    assert CUSTOM_CALL_MARKERS[backend] in text
    text = lower_as_text(stack, sds((64, 1, 6144), jnp.bfloat16), sds((256, 6144, 2048), f8),
                         sds((256, 48, 16), jnp.float32), sds((64,), jnp.int32), backend=backend)
    assert CUSTOM_CALL_MARKERS[backend] in text


# --- glm5_jax.quant.matmul ---------------------------------------------------------------------

def test_options_and_serve_flag_choices():
    import serve

    assert IMPLS == QUANTIZED_MATMUL_IMPLS == serve.QUANTIZED_MATMUL_CHOICES
    assert "quantized_matmul" in serve.EXECUTION_FLAGS
    assert serve.parse_args(["--quantized-matmul", "pallas"]).quantized_matmul == "pallas"
    with pytest.raises(ConfigError, match="quantized_matmul"):
        ExecutionOptions(quantized_matmul="fp8")


def _relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def test_native_and_banded_products_match_dequantize():
    """Each product shape of the serving step with weights spanning several 128-blocks (heads
    straddle block edges), "native" against "dequantize": the kv_b products (banded weight-only
    dots, the same code for "pallas") equal it to float32 rounding; the fp8 dots of o_proj and
    the gathered experts are within the activation rounding (measured 2e-2 relative). The
    kernel's own multi-block checks are above; the serving-step test runs "pallas" end to end.

    Whether the activations' fp8 rounding survives compilation is XLA's choice per platform.
    XLA:CPU keeps it for every product. XLA:GPU (H200, jax 0.11.2) kept it for o_proj but not
    for the gathered experts (error 1.2e-7, i.e. "dequantize" up to summation order). There every
    float8 x float8 dot has one row (`fp8_matmul_batched` with tokens = 1: a matrix-vector product
    per (token, k)); the likely path (inferred from XLA's GPU pipeline, not from an HLO dump) is
    that XLA:GPU does not make it an FP8 GEMM, upcasts the float8 operands (FloatNormalization),
    and, with xla_allow_excess_precision on by default, SimplifyFPConversions folds the
    activations' float32 -> float8 -> float32 round trip away: a weight-only fp8 product. Off
    the CPU the experts product may therefore be either; both are within its bound."""
    rng = np.random.default_rng(3)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    matrix, stack = _problem(False, jnp.float32)[1], _problem(True, jnp.float32)[1]  # [300, 200], [4, ...]
    # The [300, 200] matrix viewed as kv_b [R=300, N=2, H=100] (head 1 straddles the column block
    # edge at 128) and as o_proj [N=3, H=100, D=200]: the flat [I, O] layout is the same.
    weights = dict(kv_b=matrix.replace(out_shape=(2, 100)), o_proj=matrix.replace(in_shape=(3, 100)),
                   experts=stack)
    inputs = dict(context=normal(2, 2, CONTRACT), q_nope=normal(2, 2, 40), heads=normal(2, 3, 100),
                  rows=normal(3, 1, CONTRACT), ids=jnp.asarray(GROUP_IDS, jnp.int32).reshape(3, 2))

    @functools.partial(jax.jit, static_argnums=0)
    def products(impl, w, a):
        return {"o_proj": linear(a["heads"], w["o_proj"], impl, in_ndim=2),
                "value half": head_outputs(a["context"], w["kv_b"], 40, 100, impl),
                "key half": head_inputs(a["q_nope"], w["kv_b"], 0, 40, impl),
                "experts": expert_linear(a["rows"], w["experts"], a["ids"], impl)}

    want, got = products("dequantize", weights, inputs), products("native", weights, inputs)
    bounds = {"o_proj": 0.06, "value half": 1e-6, "key half": 1e-6, "experts": 0.06}
    may_fold = {"experts"} if jax.default_backend() != "cpu" else set()  # see the docstring
    for name, bound in bounds.items():
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, name
        error = _relative_error(got[name], want[name])
        assert error <= bound, (name, error)
        if bound < 1e-5:
            continue
        if name in may_fold:  # rounded activations, or none at all (weight-only), not in between
            assert error > 1e-4 or error < 1e-5, (name, error)
        else:
            assert error > 1e-4, (name, error)  # the fp8 dot ran (activations rounded)


# --- the serving step ----------------------------------------------------------------------------

PAGE, PAGES, PROMPT, NEW = 4, 2, 3, 5


@pytest.fixture(scope="module")
def fp8_model(tiny_config):
    """One MoE layer (attention projections, kv_b, o_proj, routed experts through the gathered
    path: 2 rows x top-2 <= 8 experts, shared expert = the dense MLP code), sliding-window
    attention (no indexer), every linear weight fp8."""
    config = tiny_config.replace(num_layers=1, num_dense_layers=0, num_mtp_layers=0, indexer_types=["full"],
                                 attention_types=["sliding_window"], sliding_window=8)
    return config, quantize_params(perturbed_params(config, 3), "fp8")


def _decode(config, params, impl, forced=None):
    """Two sequences decoded one token per step (prompt tokens fed, then greedy; with `forced`,
    those token chains fed instead). Returns (token chains, logits [steps, 2, V])."""
    options = ExecutionOptions(quantized_matmul=impl)
    cache = init_paged_cache(config, 2 * PAGES, PAGE)
    tables = np.arange(2 * PAGES, dtype=np.int32).reshape(2, PAGES)
    prompts = np.random.default_rng(3).integers(2, config.vocab_size, (2, PROMPT)).tolist()
    chains = forced or prompts
    empty = np.zeros((0, 0), np.int32)
    logits_per_step = []
    for position in range(PROMPT + NEW - 1):
        tokens = np.asarray([chain[position] for chain in chains], np.int32)
        batch = StepBatch(tokens, np.full(2, position, np.int32), empty, empty, tables)
        logits, cache = paged_step(config, params, cache, batch, np.arange(2), options=options, block_pages=1)
        logits_per_step.append(np.asarray(logits))
        if forced is None and position >= PROMPT - 1:
            for chain, row in zip(chains, logits_per_step[-1], strict=True):
                chain.append(int(np.argmax(row)))
    return chains, np.stack(logits_per_step)


def test_serving_step_with_fp8_weights_per_impl(fp8_model):
    """pallas: the same greedy tokens and logits as dequantize (to float32 rounding). native
    (W8A8): on dequantize's own token chains (teacher-forced, so one near-tie cannot derail the
    rest) logits within 0.12 relative RMS (measured 0.054) of dequantize's."""
    config, params = fp8_model
    tokens, logits = _decode(config, params, "dequantize")
    pallas_tokens, pallas_logits = _decode(config, params, "pallas")
    assert pallas_tokens == tokens
    np.testing.assert_allclose(pallas_logits, logits, atol=1e-4, rtol=1e-4)
    _, native_logits = _decode(config, params, "native", forced=tokens)
    assert 1e-3 < _relative_error(native_logits, logits) < 0.12
