"""Execution options: how a model runs (dtypes, kernels, remat, MoE dispatch), not what it is.

`ModelConfig` holds the architecture (what maps to HF config.json); `ExecutionOptions` holds the
choices that change speed, memory and rounding but not the function computed. Config files keep
them apart: a `model` section and an `execution` section. Every entry point takes
`options=None`, which means the defaults below (float32, reference kernels: runs everywhere).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from glm5_jax.execution_flags import (  # noqa: F401 - the choices are defined there, once
    DTYPE_NAMES,
    EXPERT_DISPATCHES,
    KERNEL_IMPLS,
    MOE_IMPLS,
    QUANTIZED_MATMUL_IMPLS,
    REMAT_POLICIES,
)
from glm5_jax.model.attention import backend_names
from glm5_jax.model.config import ConfigError, ModelConfig, check_field
from glm5_jax.model.dsa_training import DSA_STAGES

DTYPES = {name: getattr(jnp, name) for name in DTYPE_NAMES}
# On a CPU, "dense" up to this many experts per chosen one (at most that many times the chosen
# experts' FLOPs, in a few large matmuls); measured (docs/benchmarks.md): 8 experts top-2,
# serving 32 requests in-process, dense 1,646 tok/s, blocked 1,154, ragged 1,113.
CPU_DENSE_EXPERTS_PER_CHOSEN = 4
# On a CPU, models up to this depth are unrolled by default (platform_scan_unroll).
CPU_UNROLLED_LAYERS = 16


def platform_moe_impl(num_experts: int, experts_per_token: int, platform: str | None = None) -> str:
    """The routed-experts implementation for `platform` (default: JAX's default backend) when
    nothing chose one: "ragged" on GPUs and TPUs (a grouped matmul there); on a CPU, where
    lax.ragged_dot lowers to a masked loop over every expert, "dense" for few experts per chosen
    one (CPU_DENSE_EXPERTS_PER_CHOSEN), else "blocked"."""
    if (platform or jax.default_backend()) != "cpu":
        return "ragged"
    return "dense" if num_experts <= CPU_DENSE_EXPERTS_PER_CHOSEN * experts_per_token else "blocked"


def platform_scan_unroll(num_layers: int, platform: str | None = None) -> int:
    """Layers unrolled per scan iteration for `platform` when nothing chose it: on a CPU all of a
    model of at most CPU_UNROLLED_LAYERS layers (the slicing of scanned weights is a copy there,
    and compile time grows with the layers unrolled); elsewhere 1 (XLA:GPU reads a slice of the
    stacked weights in place)."""
    on_cpu = (platform or jax.default_backend()) == "cpu"
    return num_layers if on_cpu and num_layers <= CPU_UNROLLED_LAYERS else 1


@dataclasses.dataclass(frozen=True)
class ExecutionOptions:
    """How to run a model; frozen and hashable (a static argument of jitted functions)."""

    dtype: str = "float32"  # compute dtype of activations
    param_dtype: str = "float32"  # storage dtype of weights (router and its bias stay float32)
    # Gradient checkpointing of each decoder layer: "none", "full" (recompute everything in the
    # backward pass) or "save_matmuls" (keep matmul outputs, recompute the rest).
    remat: str = "none"
    # Layers per iteration of each scanned layer stack: 1 keeps a loop (compile time flat in
    # depth); a larger value unrolls that many (all of them when >= the stack's depth), which on
    # a CPU saves the loop's per-layer slicing and stacking of weights and saved activations.
    # The serving step runs a stack that this covers whole layer by layer on per-layer weight
    # arrays, split from the stack once when serving starts (paged_decode.serving_layout): no
    # per-step copy of each layer's weights out of the stack (CPU decode 13-19% faster).
    scan_unroll: int = 1
    # Routed-expert computation, all dropless and equal: "ragged" (tokens sorted by expert,
    # lax.ragged_dot: GPU/TPU), "blocked" (sorted rows padded into per-expert blocks, batched
    # matmuls: fast on CPUs), "dense" (every expert on every token, weighted) or "pallas" (the
    # grouped-matmul kernel).
    moe_impl: str = "ragged"
    # Hand-written kernels per op (kernels_pallas/): "reference" (plain jnp, runs everywhere, the
    # CPU default) or "pallas" (Triton on NVIDIA GPUs, Mosaic on TPUs). attention_impl:
    # prefill/training attention (flash attention, and gathered top-k attention on DSA layers);
    # indexer_impl: DSA indexer scores fused with top-k; decode_attention_impl: MLA attention
    # over the paged latent cache. A backend registered with glm5_jax.model.attention.register_backend
    # is a further choice for attention_impl and decode_attention_impl.
    attention_impl: str = "reference"
    indexer_impl: str = "reference"
    decode_attention_impl: str = "reference"
    # attention_impl "reference" over a whole sequence (training, `forward`): the queries in
    # blocks of this many, each against the keys up to its own end (mla.attend_causal_blocks), so
    # most of the causally masked [T, S] half is not computed; 0 = one [T, S] block. Used when it
    # divides the sequence (and is shorter), which is not split over `context`, outside the DSA KL
    # stages. The same result either way; on a CPU 64 was fastest at T = 256 and 512.
    causal_block_size: int = 0
    # KDA ("linear") layers over a sequence: positions per chunk of the chunked delta rule
    # (kda.kda_chunked: [C, C] work per chunk, a lax.scan over chunks, so linear in length), run
    # by "reference" (jnp) or "pallas" (kernels_pallas/kda.py, forward and backward).
    linear_chunk_size: int = 64
    linear_attention_impl: str = "reference"
    # How the serving step (paged_step) multiplies by "fp8" QuantizedTensor weights (see
    # glm5_jax.quant.matmul): "dequantize" (a float copy of each weight per layer, then the
    # einsum: every backend), "native" (XLA float8 x float8 dots, activations quantized per 1x128
    # tile: FP8 tensor cores) or "pallas" (kernels_pallas.fp8_matmul, tiles dequantized inside the
    # kernel). int8 / nvfp4 weights are always dequantized; training and `forward` always dequantize.
    quantized_matmul: str = "dequantize"
    # Expert parallelism (used when the mesh has an expert axis > 1): tokens travel to the devices
    # owning their experts with "all_to_all" (fixed-size buffers, every backend) or
    # "ragged_all_to_all" (GPU/TPU only). Per-device buffer capacity = factor * average load;
    # 0 means dropless (capacity = the worst case), equal to the unsharded MoE.
    expert_dispatch: str = "all_to_all"
    expert_capacity_factor: float = 0.0
    # Pipeline parallelism (used when the mesh has a pipeline axis > 1): microbatches per batch
    # in the GPipe schedule; 0 picks 4 x stages (or the largest of 2x, 1x dividing the batch).
    pipeline_microbatches: int = 0
    # DSA training stage (glm5_jax/model/dsa_training.py; set from a training config's dsa_stage):
    # "off", "dense_warmup" (dense attention; the indexer learns the attention distribution by
    # KL) or "sparse" (top-k attention plus the indexer's KL on the selected keys).
    dsa_stage: str = "off"

    def __post_init__(self):
        self.validate()

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return DTYPES[self.param_dtype]

    def replace(self, **changes: Any) -> ExecutionOptions:
        """New validated options with some fields changed."""
        return ExecutionOptions.from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> ExecutionOptions:
        """Builds and validates options from a mapping (a dict or an ml_collections ConfigDict,
        e.g. a config file's `execution` section); None or {} gives the defaults."""
        if values is None:
            return cls()
        if hasattr(values, "to_dict"):
            values = values.to_dict()
        # Saved runs of 2026-12-02 have `causal_blocks` (a block count, since replaced by
        # causal_block_size); it only changed the speed, not the result.
        values = {name: value for name, value in values.items() if name != "causal_blocks"}
        unknown = sorted(set(values) - set(EXECUTION_FIELDS))
        if unknown:
            raise ConfigError(f"unknown execution option(s): {', '.join(unknown)} "
                              f"(known: {', '.join(EXECUTION_FIELDS)})")
        return cls(**values)

    def validate(self) -> None:
        """Raises ConfigError naming the first invalid field."""
        require = functools.partial(check_field, self)
        require(self.dtype in DTYPES, "dtype", f"must be one of {sorted(DTYPES)}")
        require(self.param_dtype in DTYPES, "param_dtype", f"must be one of {sorted(DTYPES)}")
        require(isinstance(self.scan_unroll, int) and self.scan_unroll >= 1, "scan_unroll",
                "must be an integer >= 1")
        value = self.causal_block_size
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, "causal_block_size",
                "must be an integer >= 0 (0 = one block)")
        value = self.linear_chunk_size
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, "linear_chunk_size",
                "must be an integer >= 1")
        require(self.remat in REMAT_POLICIES, "remat", f"must be one of {REMAT_POLICIES}")
        require(self.moe_impl in MOE_IMPLS, "moe_impl", f"must be one of {MOE_IMPLS}")
        require(self.indexer_impl in KERNEL_IMPLS, "indexer_impl", f"must be one of {KERNEL_IMPLS}")
        require(self.linear_attention_impl in KERNEL_IMPLS, "linear_attention_impl",
                f"must be one of {KERNEL_IMPLS}")
        for field in ("attention_impl", "decode_attention_impl"):  # built in: KERNEL_IMPLS
            require(getattr(self, field) in backend_names(), field, f"must be one of {backend_names()}")
        require(self.quantized_matmul in QUANTIZED_MATMUL_IMPLS, "quantized_matmul",
                f"must be one of {QUANTIZED_MATMUL_IMPLS}")
        require(self.expert_dispatch in EXPERT_DISPATCHES, "expert_dispatch",
                f"must be one of {EXPERT_DISPATCHES}")
        require(self.dsa_stage in DSA_STAGES, "dsa_stage", f"must be one of {DSA_STAGES}")
        reference_kernels = (self.attention_impl, self.indexer_impl) == ("reference", "reference")
        require(self.dsa_stage == "off" or reference_kernels,
                "dsa_stage", "needs attention_impl and indexer_impl 'reference' (the indexer KL reads the "
                "dense attention distribution and indexer scores)")
        value = self.pipeline_microbatches
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                "pipeline_microbatches", "must be an integer >= 0 (0 = automatic)")
        value = self.expert_capacity_factor
        require(isinstance(value, (int, float)) and not isinstance(value, bool)
                and (value == 0 or value >= 1), "expert_capacity_factor", "must be 0 (dropless) or >= 1")
        # ragged_all_to_all writes each source's rows at fixed offsets of the receive buffer: a
        # capacity-bounded buffer would be written past its end when copies overflow.
        require(self.expert_dispatch != "ragged_all_to_all" or value == 0, "expert_capacity_factor",
                "must be 0 (dropless) with expert_dispatch='ragged_all_to_all'; use 'all_to_all' to "
                "bound the buffers with a capacity factor")


EXECUTION_FIELDS = tuple(f.name for f in dataclasses.fields(ExecutionOptions))


def split_saved_model_section(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A `model` section saved before the execution fields moved out -> (architecture fields,
    execution fields). For reading old run directories; new configs keep them apart."""
    if hasattr(values, "to_dict"):
        values = values.to_dict()
    model = {k: v for k, v in values.items() if k not in EXECUTION_FIELDS}
    execution = {k: v for k, v in values.items() if k in EXECUTION_FIELDS}
    return model, execution


def options_from_run_config(run_config: Mapping[str, Any]) -> ExecutionOptions:
    """The ExecutionOptions of a whole config (a train.py run_config.json dict or a get_config()
    ConfigDict): its `execution` section, plus execution fields an old `model` section still
    holds (the `execution` section wins)."""
    _, legacy = split_saved_model_section(run_config.get("model") or {})
    execution = run_config.get("execution") or {}
    if hasattr(execution, "to_dict"):
        execution = execution.to_dict()
    return ExecutionOptions.from_dict({**legacy, **execution})


def as_options(options, config=None) -> ExecutionOptions:
    """`options` as ExecutionOptions: None -> the `execution` section of `config` when `config` is
    a whole config file (ConfigDict with one), else the defaults; a mapping is validated."""
    if isinstance(options, ExecutionOptions):
        return options
    if options is None:
        whole_config = not isinstance(config, ModelConfig) and (
            isinstance(config, Mapping) or hasattr(config, "to_dict"))
        if whole_config and "execution" in config:
            return ExecutionOptions.from_dict(config["execution"])
        return ExecutionOptions()
    if isinstance(options, Mapping) or hasattr(options, "to_dict"):
        return ExecutionOptions.from_dict(options)
    raise TypeError(f"options must be an ExecutionOptions, a mapping of its fields or None, "
                    f"got {type(options).__name__}")
