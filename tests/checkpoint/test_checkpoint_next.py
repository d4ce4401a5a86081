"""GLM-5.3-Flash (glm5_next) checkpoints out: our save loads in transformers'
Glm5NextForConditionalGeneration with no missing or unexpected text tensors and the same logits,
and reloads exactly; every parameter has one checkpoint name. (Checkpoints in, from transformers'
own save with its vision tower: tests/model/test_parity_next.py; FP8: tests/quant.)"""

import jax
import numpy as np
import pytest
import torch
from next_models import random_next_params, tiny_next

import glm5_jax
from glm5_jax.checkpoint import checkpoint_names, config_to_hf

# A shared indexer layer right after a full one (transformers passes the selection to the next
# layer only) and 3 hyper-connection streams.
CONFIG = dict(attention_types=["linear", "dsa", "dsa", "linear"],
              indexer_types=["full", "full", "shared", "full"], hc_mult=3)


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    config = tiny_next(**CONFIG)
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
