"""The numerical reference: transformers' GlmMoeDsaForCausalLM built from our configs.

Random weights follow the parity hazards of glm5-reference.md: std 0.1 matrices, non-trivial
norm weights and biases, a non-zero router selection bias.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.checkpoint import config_to_hf
from glm5_jax.model.config import ModelConfig

if TYPE_CHECKING:
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

# torch and transformers are imported where the reference model is built: importing them costs
# ~9 s, which the subprocesses that only need `random_params` (mesh checks) should not pay.


def hf_config(config: ModelConfig) -> GlmMoeDsaConfig:
    from transformers import GlmMoeDsaConfig

    values = config_to_hf(config)
    values.pop("architectures")
    values.pop("model_type")
    values["dtype"] = "float32"
    return GlmMoeDsaConfig(**values)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Fills every weight with hazard-aware random values (in place)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                values = 0.5 + torch.rand(tensor.shape, generator=generator)
            elif name.endswith("bias"):  # indexer k_norm bias, router selection bias
                values = 0.1 * torch.randn(tensor.shape, generator=generator)
            else:
                values = std * torch.randn(tensor.shape, generator=generator)
            tensor.copy_(values.to(tensor.dtype))


def build_reference(config: ModelConfig, seed: int = 0) -> GlmMoeDsaForCausalLM:
    import torch
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM._from_config(hf_config(config), attn_implementation="eager")
    randomize_(model, seed)
    return model.eval()


def reference_logits(model: GlmMoeDsaForCausalLM, input_ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(input_ids), dtype=torch.long)).logits.float().numpy()


def random_params(config: ModelConfig, seed: int, spread: float = 0.0):
    """Random parameters like `init_params` (normal(initializer_range) matrices, unit norm scales,
    zero biases) drawn with numpy from the traced shapes: compiling `init_params` costs ~9 s even
    for the tiny model, tracing the shapes well under one. With spread > 0, every norm scale and
    bias is moved by uniform(-spread, spread), so ones/zeros cannot hide a mistake in their use."""
    from glm5_jax.model.transformer import param_shapes

    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = str(path[-1].key)
        if name.endswith("bias"):
            values = np.zeros(shape.shape)
        elif "norm" in name or name == "scale":
            values = np.ones(shape.shape)
        else:
            values = config.initializer_range * rng.standard_normal(shape.shape)
        if spread and ("scale" in name or "bias" in name):
            values = values + rng.uniform(-spread, spread, shape.shape)
        return jnp.asarray(values, shape.dtype)

    return jax.tree_util.tree_map_with_path(leaf, param_shapes(config))


def perturbed_params(config: ModelConfig, seed: int, spread: float = 0.3):
    """`random_params` with every norm scale and bias perturbed by uniform(-spread, spread)."""
    return random_params(config, seed, spread)


def greedy_chain(config: ModelConfig, params, prompt, max_tokens: int, length: int = 0) -> list[int]:
    """The argmax chain of the full forward (no cache), stopping at the config's EOS ids.

    Every forward runs on one padded shape, [1, length] (default len(prompt) + max_tokens):
    causal attention (and the indexer's causal top-k) make row i independent of the padding
    after it, so chains of any length share one compilation instead of one per length.
    """
    import glm5_jax

    eos = config.eos_token_ids
    ids = np.zeros((1, max(length, len(prompt) + max_tokens)), np.int32)
    ids[0, :len(prompt)] = prompt
    generated = []
    for index in range(len(prompt), len(prompt) + max_tokens):
        logits = np.asarray(glm5_jax.forward(config, params, ids))
        token = int(np.argmax(logits[0, index - 1]))
        generated.append(token)
        ids[0, index] = token
        if token in eos:
            break
    return generated
