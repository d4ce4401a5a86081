"""GLM-5.3-Flash (glm5_next) checkpoints out: our save loads in transformers'
Glm5NextForConditionalGeneration with no missing or unexpected text tensors and the same logits,
and reloads exactly; every parameter has one checkpoint name. (Checkpoints in, from transformers'
own save with its vision tower: tests/model/test_parity_next.py; FP8: tests/quant.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import glm5_jax
from glm5_jax.checkpoint import checkpoint_names, config_to_hf
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.transformer import param_shapes

CONFIG = dict(
    vocab_size=64, hidden_size=32, dense_intermediate_size=48, moe_intermediate_size=16, num_layers=4,
    num_dense_layers=1, num_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=0,
    v_head_dim=8, num_experts=4, num_experts_per_token=2, index_num_heads=8, index_head_dim=16, index_topk=8,
    attention_types=["linear", "dsa", "dsa", "linear"], indexer_types=["full", "full", "shared", "full"],
    linear_num_heads=2, linear_head_dim=8, hc_mult=3, index_kpool=2, swiglu_limit=0.5, num_mtp_layers=0,
    pad_token_id=0, bos_token_id=None, eos_token_ids=[1])


def random_next_params(config: ModelConfig, seed: int):
    """normal(0, 0.1) weights and biases, norm scales 1 + uniform(-0.3, 0.3): every tensor matters."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = str(path[-1].key)
        if name == "scale" and "hc" not in str(path[-2].key):
            values = 1 + rng.uniform(-0.3, 0.3, shape.shape)
        else:
            values = 0.1 * rng.standard_normal(shape.shape)
        return jnp.asarray(values, shape.dtype)

    return jax.tree_util.tree_map_with_path(leaf, param_shapes(config))


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    config = ModelConfig.from_dict(CONFIG)
    path = tmp_path_factory.mktemp("next")
    params = random_next_params(config, 0)
    glm5_jax.save_pretrained(config, params, path, max_shard_size="100KB")
    return config, params, path


def test_our_save_loads_in_transformers_with_same_logits(saved):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    config, params, path = saved
    # Our config.json names no vision tower (transformers would build its default one, randomly
    # initialised); a tiny one keeps this test fast. The text tensors must all be there.
    text = config_to_hf(config)["text_config"]
    tiny_vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                       out_hidden_size=config.hidden_size, projection_intermediate_size=32)
    model, info = Glm5NextForConditionalGeneration.from_pretrained(
        path, config=Glm5NextConfig(text_config=text, vision_config=tiny_vision), output_loading_info=True,
        attn_implementation="eager", dtype=torch.float32)
    assert all(key.startswith("model.visual.") for key in info["missing_keys"]), info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    input_ids = np.random.default_rng(0).integers(2, config.vocab_size, (2, 21))
    ours = np.asarray(glm5_jax.forward(config, params, input_ids))
    with torch.no_grad():
        want = model.eval()(torch.as_tensor(input_ids)).logits.numpy()
    error = float(np.max(np.abs(ours - want)))
    print(f"our glm5_next save -> transformers: max |logit error| = {error:.3g}")
    assert error <= 1e-4


def test_our_save_reloads_exactly_and_names_cover_every_parameter_once(saved):
    config, params, path = saved
    loaded_config, loaded = glm5_jax.load_pretrained(path)
    assert loaded_config == config
    names = checkpoint_names(config)
    for name in names:  # every stored slice (a "shared" layer's placeholder indexer is not stored)
        np.testing.assert_array_equal(np.asarray(_at(loaded, name.path))[name.index],
                                      np.asarray(_at(params, name.path))[name.index], err_msg=name.hf_name)
    assert len({n.hf_name for n in names}) == len(names)
    leaves = {tuple(k.key for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert {tuple(n.path) for n in names} == leaves
