"""Parity with transformers' GlmMoeDsaForCausalLM (the pinned reference) in float32.

Each variant builds a randomly initialised reference model with the hazard-aware init of
glm5-reference.md, saves it with transformers, loads it with `glm5_jax.load_pretrained` and
compares logits. A top-k tie at the DSA selection boundary makes two correct implementations
legitimately disagree, so each test first checks the smallest boundary gap and fails with it
(rather than passing or failing by luck) when it is too small to trust.
"""

import json

import numpy as np
import pytest
import torch
from reference import build_reference, hf_config, randomize_, reference_logits
from safetensors.torch import load_file, save_file
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

import glm5_jax
from glm5_jax.model import indexer_pattern
from glm5_jax.model.transformer import sown_values

MAX_LOGIT_ERROR = 1e-4
MIN_SELECTION_GAP = 1e-5  # far above float32 score differences between implementations

VARIANTS = {
    "groups_1_1": dict(),
    "groups_2_1": dict(num_expert_groups=2, num_selected_groups=1),
    "groups_4_2": dict(num_expert_groups=4, num_selected_groups=2),
    "no_topk_norm": dict(normalize_topk_weights=False),
    "indexshare_mix": dict(indexer_types=list(indexer_pattern(4, frequency=2, offset=1))),
}


def selection_gaps(intermediates) -> list[float]:
    return [float(np.min(value)) for _, value in sown_values(intermediates, "selection_gap")]


def check_parity(config, tmp_path, seq_len=24, batch=2, seed=1):
    reference = build_reference(config, seed=seed)
    reference.save_pretrained(tmp_path)
    loaded_config, params = glm5_jax.load_pretrained(tmp_path)
    assert loaded_config.replace(num_mtp_layers=config.num_mtp_layers) == config.replace(
        num_mtp_layers=config.num_mtp_layers)
    assert config.index_topk < seq_len, "sparsity must matter"
    input_ids = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq_len))
    outputs = glm5_jax.apply_model(loaded_config, params, input_ids, collect_intermediates=True)
    gap = min(selection_gaps(outputs["intermediates"]))
    assert gap > MIN_SELECTION_GAP, f"DSA top-k boundary tie (gap {gap:.3g}); choose another seed"
    error = float(np.max(np.abs(np.asarray(outputs["logits"]) - reference_logits(reference,
                                                                                 input_ids))))
    print(f"max |logit error| = {error:.3g}, smallest top-k boundary gap = {gap:.3g}")
    assert error <= MAX_LOGIT_ERROR
    return error, gap


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_reference(variant, tiny_config, tmp_path):
    check_parity(tiny_config.replace(num_mtp_layers=0, **VARIANTS[variant]), tmp_path)


def test_odd_sequence_length(tiny_config, tmp_path):
    check_parity(tiny_config.replace(num_mtp_layers=0), tmp_path, seq_len=17, batch=3, seed=2)


def test_mtp_head_matches_reference_blocks(tiny_config, tmp_path):
    """The MTP head against the reference's own blocks: a decoder layer built by transformers
    at index num_hidden_layers, with enorm/hnorm/eh_proj/shared_head.norm applied around it."""
    config = tiny_config
    reference = build_reference(config.replace(num_mtp_layers=0), seed=3)
    extended = hf_config(config.replace(
        num_layers=config.num_layers + 1, indexer_types=list(config.indexer_types) + ["full"],
        attention_types=list(config.attention_types) + ["dsa"], num_mtp_layers=0))
    extended._attn_implementation = "eager"
    mtp = torch.nn.ModuleDict({
        "enorm": hf.GlmMoeDsaRMSNorm(config.hidden_size, config.rms_norm_eps),
        "hnorm": hf.GlmMoeDsaRMSNorm(config.hidden_size, config.rms_norm_eps),
        "eh_proj": torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False),
        "layer": hf.GlmMoeDsaDecoderLayer(extended, config.num_layers),
        "head_norm": hf.GlmMoeDsaRMSNorm(config.hidden_size, config.rms_norm_eps),
    })
    randomize_(mtp, seed=4)
    state = {f"model.layers.{config.num_layers}.{k}": v for k, v in mtp.state_dict().items()}
    state = {k.replace("head_norm", "shared_head.norm").replace(".layer.", "."): v
             for k, v in state.items()}
    state = {k.replace("mlp.experts.gate_up_proj", "GATE_UP").replace(
        "mlp.experts.down_proj", "DOWN"): v for k, v in state.items()}
    unpacked = {}
    for key, value in state.items():
        if key.endswith("GATE_UP"):
            gate, up = value.chunk(2, dim=1)
            for expert in range(config.num_experts):
                base = key.replace("GATE_UP", f"mlp.experts.{expert}")
                unpacked[f"{base}.gate_proj.weight"] = gate[expert]
                unpacked[f"{base}.up_proj.weight"] = up[expert]
        elif key.endswith("DOWN"):
            for expert in range(config.num_experts):
                unpacked[key.replace("DOWN", f"mlp.experts.{expert}.down_proj.weight")] = value[
                    expert]
        else:
            unpacked[key] = value
    reference.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.update({k: v.contiguous() for k, v in unpacked.items()})
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config_json = json.loads((tmp_path / "config.json").read_text())
    config_json["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config_json))

    loaded_config, params = glm5_jax.load_pretrained(tmp_path)
    assert loaded_config.num_mtp_layers == 1
    input_ids = np.random.default_rng(5).integers(0, config.vocab_size, (2, 20))
    ours = glm5_jax.apply_model(loaded_config, params, input_ids, with_mtp=True)

    with torch.no_grad():
        ids = torch.as_tensor(input_ids)
        hidden = reference.model(ids).last_hidden_state[:, :-1]
        embedded = reference.model.embed_tokens(ids[:, 1:])
        x = mtp["eh_proj"](torch.cat([mtp["enorm"](embedded), mtp["hnorm"](hidden)], dim=-1))
        positions = torch.arange(x.shape[1])[None]
        rotary = reference.model.rotary_emb(x, positions)
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        x, _ = mtp["layer"](x, attention_mask=mask.expand(2, 1, -1, -1),
                            position_embeddings=rotary, position_ids=positions)
        expected = reference.lm_head(mtp["head_norm"](x)).numpy()
    error = np.max(np.abs(np.asarray(ours["mtp_logits"]) - expected))
    print(f"MTP max |logit error| = {error:.3g}")
    assert error <= MAX_LOGIT_ERROR
