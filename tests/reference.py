"""The numerical reference: transformers' GlmMoeDsaForCausalLM built from our configs.

Random weights follow the parity hazards of glm5-reference.md: std 0.1 matrices, non-trivial
norm weights and biases, a non-zero router selection bias.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from glm5_jax.checkpoint import config_to_hf
from glm5_jax.model.config import ModelConfig


def hf_config(config: ModelConfig) -> GlmMoeDsaConfig:
    values = config_to_hf(config)
    values.pop("architectures")
    values.pop("model_type")
    values["dtype"] = "float32"
    return GlmMoeDsaConfig(**values)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Fills every weight with hazard-aware random values (in place)."""
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
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM._from_config(hf_config(config), attn_implementation="eager")
    randomize_(model, seed)
    return model.eval()


def reference_logits(model: GlmMoeDsaForCausalLM, input_ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(input_ids), dtype=torch.long)).logits.float().numpy()


def perturbed_params(config: ModelConfig, seed: int, spread: float = 0.3):
    """Our random init with every norm scale and bias moved by uniform(-spread, spread), so
    ones/zeros cannot hide a mistake in how they are used."""
    import jax

    import glm5_jax

    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf + rng.uniform(-spread, spread, leaf.shape).astype(leaf.dtype)
        if "scale" in str(path[-1]) or "bias" in str(path[-1]) else leaf,
        glm5_jax.init_params(config, seed))
