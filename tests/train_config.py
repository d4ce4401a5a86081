"""A tiny training config for the train.py tests: `--config tests/train_config.py:<data glob>`, or
`tests/train_config.py:chat:<path>` for chat_jsonl data, `...:pairs:<path>` for preference pairs;
`tests/train_config.py:mesh:<data glob>` adds a mesh section (data=-1, the other axes 1) for
`--config.mesh.<axis>=<size>` overrides."""

import ml_collections

KINDS = {"chat": "chat_jsonl", "pairs": "preference_jsonl"}


def source(data: str) -> dict:
    prefix, _, path = data.partition(":")
    if prefix in KINDS:
        return dict(kind=KINDS[prefix], name=f"test_{prefix}", paths=[path], weight=1.0)
    return dict(kind="files", name="test_files", paths=[data], weight=1.0)


def get_config(data_glob: str = "") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    if data_glob.startswith("mesh:"):
        data_glob = data_glob.removeprefix("mesh:")
        config.mesh = ml_collections.ConfigDict(dict(pipeline=1, data=-1, fsdp=1, context=1, expert=1,
                                                     tensor=1))
    config.model = ml_collections.ConfigDict(dict(
        vocab_size=512, hidden_size=32, dense_intermediate_size=64, moe_intermediate_size=16,
        num_layers=2, num_dense_layers=1, num_heads=2, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_experts=4,
        num_experts_per_token=2, num_shared_experts=1, index_num_heads=4, index_head_dim=16,
        index_topk=16, rope_theta=10000.0, max_position_embeddings=1024, num_mtp_layers=1,
        eos_token_ids=[0], pad_token_id=0, bos_token_id=None, initializer_range=0.02))
    config.execution = ml_collections.ConfigDict(dict(moe_impl="dense"))
    config.data = ml_collections.ConfigDict(dict(
        sources=[source(data_glob)],
        tokenizer_path="", vocab_size=512, cache_dir="", seq_len=32, validation_fraction=0.2,
        seed=0))
    config.num_train_steps = 12
    config.batch_size = 4
    config.learning_rate = 3e-3
    config.warmup_steps = 2
    config.log_every = 1
    config.eval_every = 6
    config.eval_batches = 2
    config.checkpoint_every = 4
    config.keep_checkpoints = 2
    config.max_bad_steps = 2
    config.init_from = ""  # fine-tuning: set by --config.init_from=PATH
    config.frozen = ()
    config.objective = "lm"
    config.dpo_beta = 0.1
    return config
