"""The shared base of the configs: every field with its default value. Other configs load it
(`load_config_file(Path(__file__).with_name("base.py"))`) and state only what differs.

    model       the architecture (glm5_jax/model/config.py): a ~10M-parameter GLM-5 (MLA, DSA with
                index_topk below the sequence length, a dense prefix, MoE with a shared expert, an
                MTP head)
    execution   how it runs (glm5_jax/model/options.py): the defaults, spelled out to be overridable
    data, mesh and the training fields (train.py, docs/training.md)
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = ml_collections.ConfigDict(dict(
        vocab_size=4096,
        hidden_size=256,
        dense_intermediate_size=768,
        moe_intermediate_size=256,
        num_layers=4,
        num_dense_layers=1,
        num_heads=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        num_expert_groups=1,
        num_selected_groups=1,
        normalize_topk_weights=True,
        routed_scaling_factor=2.5,
        index_num_heads=8,
        index_head_dim=32,
        index_topk=64,
        indexer_types=[],  # empty: every layer "full"
        attention_types=[],  # empty: every layer "dsa"
        sliding_window=0,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        num_mtp_layers=1,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_ids=[0],  # "<|endoftext|>", the first special token of the trained tokenizer
        pad_token_id=0,
    ))
    # How it runs; override with e.g. --config.execution.remat=full.
    config.execution = ml_collections.ConfigDict(dict(
        dtype="float32",
        param_dtype="float32",
        remat="none",
        moe_impl="ragged",
        attention_impl="reference",
        indexer_impl="reference",
        decode_attention_impl="reference",
        expert_dispatch="all_to_all",
        expert_capacity_factor=0.0,
        pipeline_microbatches=0,
    ))
    config.data = ml_collections.ConfigDict(dict(
        sources=[dict(kind="python_stdlib", name="python_stdlib", weight=1.0)],
        tokenizer_path="",  # "" trains a byte-level BPE on the sources (cached)
        vocab_size=4096,
        cache_dir="~/.cache/glm5_jax",
        seq_len=256,
        validation_fraction=0.02,
        seed=0,
    ))
    # Device mesh (glm5_jax.parallel.mesh): sizes multiply to the device count, -1 fills. One CPU
    # gives all ones; on a GPU node or TPU slice e.g. dict(fsdp=-1) or dict(data=2, expert=4).
    config.mesh = ml_collections.ConfigDict(dict(pipeline=1, data=-1, fsdp=1, context=1, expert=1, tensor=1))
    config.num_train_steps = 400
    config.batch_size = 8
    config.grad_accum_steps = 1
    config.learning_rate = 2e-3
    config.warmup_steps = 30
    config.min_learning_rate_ratio = 0.1
    config.weight_decay = 0.1
    config.adam_b1 = 0.9
    config.adam_b2 = 0.95
    config.adam_eps = 1e-8
    config.clip_grad_norm = 1.0
    config.z_loss_weight = 1e-4
    config.mtp_loss_weight = 0.3
    config.balance_loss_weight = 0.0
    config.router_bias_update_rate = 1e-2  # fast enough to balance within a short run
    config.seed = 0
    config.log_every = 10
    config.eval_every = 100
    config.eval_batches = 8
    config.checkpoint_every = 100
    config.keep_checkpoints = 3
    config.max_bad_steps = 5
    # DSA training stages (docs/training.md): "off", "dense_warmup" or "sparse".
    config.dsa_stage = "off"
    config.indexer_kl_weight = 1.0
    # Fine-tuning (train.py's docs): --config.init_from=PATH starts from an HF checkpoint or run.
    config.init_from = ""
    config.trainable = ()
    config.frozen = ()
    return config
