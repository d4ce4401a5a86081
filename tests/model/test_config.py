"""Config validation (errors name the field), execution options kept apart from the
architecture, and HF config.json conversion."""

import json
from pathlib import Path

import jax.numpy as jnp
import pytest
from transformers import GlmMoeDsaConfig

import glm5_jax
from glm5_jax import ConfigError, ModelConfig
from glm5_jax.checkpoint import config_from_hf, config_to_hf, options_from_hf
from glm5_jax.config_files import load_config_file, load_execution_options, load_model_config, split_overrides
from glm5_jax.model.config import MOVED_TO_EXECUTION
from glm5_jax.model.options import EXECUTION_FIELDS, ExecutionOptions, platform_moe_impl, platform_scan_unroll
from glm5_jax.train.runs import run_configs


@pytest.mark.parametrize("changes, field", [
    (dict(num_expert_groups=3), "num_expert_groups"),  # does not divide 8 experts
    (dict(index_topk=0), "index_topk"),
    (dict(num_experts_per_token=9), "num_experts_per_token"),
    (dict(num_selected_groups=3, num_expert_groups=2), "num_selected_groups"),
    (dict(num_expert_groups=4, num_selected_groups=1, num_experts_per_token=3),
     "num_experts_per_token"),
    (dict(indexer_types=["full", "full"]), "indexer_types"),
    (dict(indexer_types=["shared", "full", "full", "full"]), "indexer_types"),
    (dict(indexer_types=["full", "sparse", "full", "full"]), "indexer_types"),
    (dict(attention_types=["sliding_window"] * 4), "sliding_window"),
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
    (dict(num_dense_layers=5), "num_dense_layers"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_mtp_layers=2), "num_mtp_layers"),
])
def test_invalid_fields_are_named(tiny_config, changes, field):
    with pytest.raises(ConfigError, match=field):
        tiny_config.replace(**changes)


def test_unknown_field_is_named(tiny_config):
    with pytest.raises(ConfigError, match="num_expert"):
        ModelConfig.from_dict({**tiny_config.to_dict(), "num_expert": 4})


@pytest.mark.parametrize("changes, field", [
    (dict(dtype="float64"), "dtype"), (dict(param_dtype="int8"), "param_dtype"),
    (dict(remat="some"), "remat"), (dict(moe_impl="loop"), "moe_impl"),
    (dict(attention_impl="cuda"), "attention_impl"), (dict(indexer_impl="x"), "indexer_impl"),
    (dict(decode_attention_impl="x"), "decode_attention_impl"),
    (dict(expert_dispatch="gather"), "expert_dispatch"),
    (dict(expert_capacity_factor=0.5), "expert_capacity_factor"),
    (dict(expert_dispatch="ragged_all_to_all", expert_capacity_factor=1.25), "dropless.*ragged_all_to_all"),
    (dict(pipeline_microbatches=-1), "pipeline_microbatches"), (dict(no_such_option=1), "no_such_option"),
    (dict(causal_block_size=-64), "causal_block_size"),
])
def test_invalid_execution_options_are_named(changes, field):
    with pytest.raises(ConfigError, match=field):
        ExecutionOptions.from_dict(changes)


def test_execution_fields_are_not_architecture(tiny_config):
    assert set(MOVED_TO_EXECUTION) == set(EXECUTION_FIELDS)
    with pytest.raises(ConfigError, match="moe_impl.*`execution` section"):
        ModelConfig.from_dict({**tiny_config.to_dict(), "moe_impl": "blocked"})
    with pytest.raises(ConfigError, match="remat.*`execution` section"):
        tiny_config.replace(remat="full")
    options = ExecutionOptions().replace(dtype="bfloat16")
    assert options.compute_dtype == jnp.bfloat16 and options.weight_dtype == jnp.float32
    assert hash(options) == hash(ExecutionOptions(dtype="bfloat16"))
    assert load_execution_options("configs/glm5.py").param_dtype == "bfloat16"
    assert split_overrides({"remat": "full", "num_layers": 2}) == ({"num_layers": 2}, {"remat": "full"})


def test_old_run_config_with_execution_fields_in_model_still_loads(tiny_config):
    """Runs saved before the `execution` section kept its fields in `model`: they are split out."""
    old = {"model": {**tiny_config.to_dict(), "dtype": "bfloat16", "moe_impl": "blocked"}}
    config, options = run_configs(old)
    assert config == tiny_config
    assert options == ExecutionOptions(dtype="bfloat16", moe_impl="blocked")
    new = {"model": tiny_config.to_dict(), "execution": {"remat": "full"}}
    assert run_configs(new) == (tiny_config, ExecutionOptions(remat="full"))
    # causal_blocks (a block count, 2026-12-02) gave way to causal_block_size: same result, dropped.
    renamed = {"model": tiny_config.to_dict(), "execution": {"causal_blocks": 8}}
    assert run_configs(renamed) == (tiny_config, ExecutionOptions())


def test_entry_points_take_a_config_file_config_or_say_what_they_expect(tiny_config):
    whole = load_config_file("configs/tiny.py")
    whole.execution.param_dtype = "bfloat16"
    assert glm5_jax.count_params(whole) == glm5_jax.count_params(tiny_config)
    shapes = glm5_jax.model.param_shapes(whole)  # the `execution` section applies
    assert shapes["embed"].dtype == jnp.bfloat16
    assert shapes["moe_layers"]["moe"]["router"].dtype == jnp.float32
    with pytest.raises(TypeError, match="ModelConfig.*got ConfigDict without a `model` section"):
        glm5_jax.count_params(whole.model)
    with pytest.raises(TypeError, match="ModelConfig.*got str"):
        glm5_jax.forward("configs/tiny.py", {}, jnp.zeros((1, 2), jnp.int32))


def test_hf_dtype_is_storage(tiny_config):
    hf = config_to_hf(tiny_config, "bfloat16")
    assert hf["dtype"] == "bfloat16" and config_from_hf(hf) == tiny_config
    platform = dict(moe_impl=platform_moe_impl(tiny_config.num_experts, tiny_config.num_experts_per_token),
                    scan_unroll=platform_scan_unroll(tiny_config.num_layers))
    assert options_from_hf(hf) == ExecutionOptions(dtype="bfloat16", param_dtype="bfloat16", **platform)
    assert options_from_hf(hf, "float32") == ExecutionOptions(**platform)


def test_routed_experts_default_follows_the_platform():
    # ragged_dot is a grouped matmul on accelerators and a masked loop over every expert on a CPU.
    assert platform_moe_impl(256, 8, "gpu") == platform_moe_impl(8, 2, "tpu") == "ragged"
    assert platform_moe_impl(8, 2, "cpu") == "dense"  # 4x the chosen experts' FLOPs at most
    assert platform_moe_impl(256, 8, "cpu") == "blocked"
    # Scanned weights are sliced by copying on a CPU: small models run unrolled there.
    assert platform_scan_unroll(4, "cpu") == 4 and platform_scan_unroll(78, "cpu") == 1
    assert platform_scan_unroll(4, "gpu") == platform_scan_unroll(4, "tpu") == 1


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_config("configs/no_such_model.py")


@pytest.mark.parametrize("name", ["tiny", "glm5", "glm5_2"])
def test_hf_config_round_trip(name):
    config = load_model_config(f"configs/{name}.py")
    assert config_from_hf(config_to_hf(config)) == config


def test_glm5_values_match_the_published_config():
    config = load_model_config("configs/glm5.py")
    hf = GlmMoeDsaConfig()  # transformers' defaults are the GLM-5 values
    ours = config_to_hf(config)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                  "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor",
                  "index_topk", "index_head_dim", "index_n_heads", "first_k_dense_replace",
                  "max_position_embeddings", "rms_norm_eps", "norm_topk_prob"):
        assert ours[field] == getattr(hf, field), field
    assert config.rope_theta == 1e6 and config.eos_token_ids == (154820, 154827, 154829)


def test_glm5_2_indexer_pattern_matches_transformers():
    ours = load_model_config("configs/glm5_2.py").indexer_types
    theirs = GlmMoeDsaConfig(index_topk_freq=4, index_skip_topk_offset=3).indexer_types
    assert ours == tuple(theirs)
    assert ours.count("shared") > 0 and ours[:3] == ("full",) * 3


def test_reads_hf_pattern_fields_and_legacy_rope_theta(tiny_config):
    hf = config_to_hf(tiny_config)
    del hf["indexer_types"], hf["rope_parameters"]
    hf.update(index_topk_freq=2, index_skip_topk_offset=1, rope_theta=5000.0)
    config = config_from_hf(hf)
    assert config.indexer_types == ("full", "shared", "full", "shared")
    assert config.rope_theta == 5000.0


@pytest.mark.parametrize("field, value", [
    ("hidden_act", "gelu"), ("tie_word_embeddings", True), ("num_key_value_heads", 2),
    ("mlp_layer_types", ["sparse", "dense", "sparse", "sparse"]),
])
def test_unsupported_hf_fields_are_named(tiny_config, field, value):
    hf = config_to_hf(tiny_config)
    hf[field] = value
    with pytest.raises(ConfigError, match=field):
        config_from_hf(hf)


def test_unsupported_rope_type(tiny_config):
    hf = config_to_hf(tiny_config)
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ConfigError, match="rope_type"):
        config_from_hf(hf)


# ---------------------------------------------------------------- configs/ derive from configs/base.py
CONFIG_SNAPSHOT = Path(__file__).parent / "config_snapshot.json"


def _typed(value):
    """`value` with the type of every leaf spelled out (tuple vs list, int vs float, None)."""
    if isinstance(value, dict):
        return {key: _typed(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_typed(item) for item in value]]
    return [type(value).__name__, value]


@pytest.mark.parametrize("name", sorted(json.loads(CONFIG_SNAPSHOT.read_text())))
def test_configs_equal_their_snapshot(name):
    """Each configs/*.py that derives from base.py gives exactly the values (and types) the full
    copies gave before (tests/model/config_snapshot.json, written from them)."""
    snapshot = json.loads(CONFIG_SNAPSHOT.read_text())[name]
    assert json.loads(json.dumps(_typed(load_config_file(f"configs/{name}.py").to_dict()))) == snapshot


def test_configs_state_only_what_differs_from_the_base():
    base = load_config_file("configs/base.py").to_dict()
    demo = load_config_file("configs/demo.py").to_dict()
    demo["execution"] = {k: v for k, v in demo["execution"].items() if k in base["execution"]}
    demo["execution"]["moe_impl"] = base["execution"]["moe_impl"]
    assert demo == base  # demo.py changes three execution fields, nothing else
    assert "hidden_size" not in Path("configs/demo.py").read_text()  # stated once, in base.py
    assert set(json.loads(CONFIG_SNAPSHOT.read_text())) == {"demo", "demo_prepared", "glm5", "glm5_2", "tiny"}
