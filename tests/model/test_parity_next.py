"""Parity with transformers 5.24's Glm5NextForConditionalGeneration (GLM-5.3-Flash, `glm5_next`)
text path, float32: random hazard-aware weights (tests/reference.py's: non-trivial norms, gates,
biases, hyper-connection scales), saved by transformers with its vision tower, loaded by
`glm5_jax.load_pretrained` (which skips the tower and says so), logits compared.

Variants cover several hc_mult and index_kpool values, a shared indexer layer, sequences shorter
and longer than index_topk, and a SwiGLU clamp that bites. transformers runs glm5_next on a single
sequence per row (padding only, no packed documents); packing is checked against each document
alone in tests/model/test_model_next.py.
"""

import logging

import numpy as np
import pytest
from next_models import tiny_next
from reference import randomize_

import glm5_jax
from glm5_jax.checkpoint import config_to_hf
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.transformer import sown_values

MAX_LOGIT_ERROR = 1e-4
MIN_SELECTION_GAP = 1e-5  # a top-k tie lets two correct implementations pick different pools

def next_config(**changes) -> ModelConfig:
    return tiny_next(**changes)


def build_next_reference(config: ModelConfig, seed: int):
    """transformers' model of `config` with a tiny vision tower, random hazard-aware weights."""
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    text = config_to_hf(config)["text_config"]
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                  out_hidden_size=config.hidden_size, projection_intermediate_size=32)
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration._from_config(
        Glm5NextConfig(text_config=text, vision_config=vision), attn_implementation="eager")
    randomize_(model, seed)
    return model.eval()


def check_parity(config: ModelConfig, tmp_path, lengths: tuple[int, ...], seed: int = 1, batch: int = 2):
    """One reference model, saved and loaded once, compared at each sequence length."""
    import torch

    reference = build_next_reference(config, seed)
    reference.save_pretrained(tmp_path)
    loaded, params = glm5_jax.load_pretrained(tmp_path)
    assert loaded == config
    for seq_len in lengths:
        input_ids = np.random.default_rng(seed).integers(2, config.vocab_size, (batch, seq_len))
        with torch.no_grad():
            want = reference(torch.as_tensor(input_ids)).logits.numpy()
        outputs = glm5_jax.apply_model(loaded, params, input_ids, collect_intermediates=True)
        gaps = [float(np.min(value)) for _, value in sown_values(outputs["intermediates"], "selection_gap")]
        assert min(gaps) > MIN_SELECTION_GAP, f"pooled top-k boundary tie (gaps {gaps}); choose another seed"
        error = float(np.max(np.abs(np.asarray(outputs["logits"]) - want)))
        print(f"T={seq_len}: max |logit error| = {error:.3g} (logits up to {np.abs(want).max():.3g}), "
              f"gaps {gaps}")
        assert error <= MAX_LOGIT_ERROR


VARIANTS = {
    # name: (config changes, sequence lengths: longer and shorter than index_topk 8)
    "hc2_pool2": (dict(), (24, 6)),
    "hc1_pool1": (dict(hc_mult=1, index_kpool=1), (20,)),
    "hc4_pool4_no_tail": (dict(hc_mult=4, index_kpool=4, index_kpool_always_select_tail=False), (23,)),
    "shared_indexer": (dict(attention_types=["linear", "dsa", "dsa", "linear"],
                            indexer_types=["full", "full", "shared", "full"], num_dense_layers=2), (21,)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_glm5_next(variant, tmp_path, caplog):
    changes, lengths = VARIANTS[variant]
    with caplog.at_level(logging.WARNING, logger="glm5_jax.checkpoint.hf_io"):
        check_parity(next_config(**changes), tmp_path, lengths)
    assert "skipped the vision tower" in caplog.text


def test_released_parameter_count_equals_transformers():
    """count_params of configs/glm5_next.py == transformers' Glm5NextTextModel of the default
    Glm5NextTextConfig (built on the meta device: shapes only) plus its LM head, counting the
    router's selection bias, which transformers holds as a buffer."""
    import torch
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    from glm5_jax.checkpoint.hf_config import config_from_hf
    from glm5_jax.config_files import load_model_config

    reference = Glm5NextTextConfig()
    with torch.device("meta"):
        text_model = Glm5NextTextModel(reference)
    want = sum(t.numel() for t in list(text_model.parameters()) + list(text_model.buffers()))
    want += reference.vocab_size * reference.hidden_size  # lm_head
    config = load_model_config("configs/glm5_next.py")
    # The same architecture as transformers' defaults (whose config.json names no eos token).
    from_hf = config_from_hf({"model_type": "glm5_next", "text_config": reference.to_dict()})
    assert config == from_hf.replace(eos_token_ids=config.eos_token_ids)
    counts = glm5_jax.count_params(config)
    assert counts["total"] == want == 313_326_828_862
    assert counts["active"] == 16_742_350_142 and counts["mtp"] == 0
