"""HF checkpoint round trips and the errors bad checkpoint directories must give."""

import json
import os
import stat

import jax
import numpy as np
import pytest
import torch
from reference import build_reference, perturbed_params, random_params, reference_logits
from safetensors.numpy import load_file, save_file
from transformers import GlmMoeDsaForCausalLM

import glm5_jax
from glm5_jax import CheckpointError, ConfigError
from glm5_jax.checkpoint import checkpoint_names, read_options
from glm5_jax.model.options import platform_moe_impl, platform_scan_unroll
from glm5_jax.train.runs import checkpoint_options


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_config):
    """Our params saved by glm5_jax.save_pretrained, sharded into several files."""
    path = tmp_path_factory.mktemp("ours")
    params = perturbed_params(tiny_config, 0)
    glm5_jax.save_pretrained(tiny_config, params, path, max_shard_size="200KB")
    return path, params


def test_our_save_loads_in_transformers_with_same_logits(saved, tiny_config):
    path, params = saved
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    model, info = GlmMoeDsaForCausalLM.from_pretrained(
        path, output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    mtp_prefix = f"model.layers.{tiny_config.num_layers}."
    assert not info["missing_keys"], info["missing_keys"]
    assert all(k.startswith(mtp_prefix) for k in info["unexpected_keys"]), info["unexpected_keys"]
    assert not info["mismatched_keys"]
    input_ids = np.random.default_rng(0).integers(0, tiny_config.vocab_size, (2, 21))
    ours = np.asarray(glm5_jax.forward(tiny_config, params, input_ids))
    error = np.max(np.abs(ours - reference_logits(model.eval(), input_ids)))
    print(f"our save -> transformers: max |logit error| = {error:.3g}")
    assert error <= 1e-4


def test_our_save_reloads_exactly(saved, tiny_config):
    path, params = saved
    config, loaded = glm5_jax.load_pretrained(path)
    assert config == tiny_config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, loaded)


def test_transformers_save_loads_with_same_logits(tiny_config, tmp_path):
    config = tiny_config.replace(num_mtp_layers=0)
    reference = build_reference(config, seed=7)
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded_config, params = glm5_jax.load_pretrained(tmp_path)
    input_ids = np.random.default_rng(1).integers(0, config.vocab_size, (2, 19))
    error = np.max(np.abs(np.asarray(glm5_jax.forward(loaded_config, params, input_ids))
                          - reference_logits(reference, input_ids)))
    assert error <= 1e-4


def test_load_with_dtype_override(saved):
    path, _ = saved
    config, params = glm5_jax.load_pretrained(path, dtype="bfloat16")
    options = read_options(path, "bfloat16")
    assert options.param_dtype == "bfloat16" and options.dtype == "bfloat16"
    routed = platform_moe_impl(config.num_experts, config.num_experts_per_token)  # this platform's
    unroll = platform_scan_unroll(config.num_layers)
    assert checkpoint_options(path) == glm5_jax.ExecutionOptions(moe_impl=routed, scan_unroll=unroll)
    assert params["moe_layers"]["attention"]["q_b_proj"].dtype == np.dtype("bfloat16")
    assert params["moe_layers"]["moe"]["router"].dtype == np.float32  # router stays float32
    logits = glm5_jax.forward(config, params, np.zeros((1, 5), np.int32), options=options)
    assert logits.dtype == np.float32 and np.isfinite(np.asarray(logits)).all()


def test_names_cover_every_parameter_once(tiny_config):
    names = checkpoint_names(tiny_config)
    assert len({n.hf_name for n in names}) == len(names)
    shapes = glm5_jax.model.param_shapes(tiny_config)
    covered = {tuple(n.path) for n in names}
    leaves = {tuple(k.key for k in path) for path, _ in
              jax.tree_util.tree_flatten_with_path(shapes)[0]}
    assert covered == leaves


# ------------------------------------------------------------------ bad checkpoints
@pytest.fixture
def single_file_checkpoint(tmp_path, tiny_config):
    glm5_jax.save_pretrained(tiny_config, random_params(tiny_config, 1), tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    return tmp_path


def test_missing_shard_file_is_named(saved, tmp_path):
    path, _ = saved
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        glm5_jax.load_pretrained(tmp_path)


def test_missing_weights_file(tmp_path, single_file_checkpoint):
    (single_file_checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        glm5_jax.load_pretrained(single_file_checkpoint)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        glm5_jax.load_pretrained(tmp_path)


def _rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_wrong_shape_is_named(single_file_checkpoint):
    name = "model.layers.2.self_attn.q_b_proj.weight"
    _rewrite(single_file_checkpoint, lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.q_b_proj\.weight"):
        glm5_jax.load_pretrained(single_file_checkpoint)


def test_unexpected_key_is_named(single_file_checkpoint):
    _rewrite(single_file_checkpoint,
             lambda t: t.update({"model.layers.1.mlp.surprise.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match="surprise"):
        glm5_jax.load_pretrained(single_file_checkpoint)


def test_missing_tensor_is_named(single_file_checkpoint):
    _rewrite(single_file_checkpoint, lambda t: t.pop("model.layers.3.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"experts\.5\.up_proj"):
        glm5_jax.load_pretrained(single_file_checkpoint)


def test_other_model_type_is_named(single_file_checkpoint):
    config_path = single_file_checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    config["model_type"] = "deepseek_v3"
    config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model_type"):
        glm5_jax.load_pretrained(single_file_checkpoint)


def test_saved_files_take_the_umask_mode_like_config_json(saved, tmp_path, tiny_config):
    """safetensors alone writes 0600: every file of a save gets the mode the umask gives a new
    file (0644 under 022, as config.json always had and Hub downloads have); a 077 umask keeps
    the whole checkpoint private."""
    path, params = saved
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in path.iterdir()}
    assert len(modes) > 3 and set(modes.values()) == {0o666 & ~umask}, modes
    previous = os.umask(0o077)
    try:
        glm5_jax.save_pretrained(tiny_config, params, tmp_path)
    finally:
        os.umask(previous)
    assert {stat.S_IMODE(f.stat().st_mode) for f in tmp_path.iterdir()} == {0o600}


def test_resave_replaces_previous_shards(saved, tmp_path, tiny_config):
    path, params = saved
    glm5_jax.save_pretrained(tiny_config, params, tmp_path, max_shard_size="200KB")
    glm5_jax.save_pretrained(tiny_config, params, tmp_path)  # now a single file
    assert sorted(f.name for f in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    glm5_jax.load_pretrained(tmp_path)
