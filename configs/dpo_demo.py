"""Preference tuning (DPO) of the chat fine-tuned demo run (runs/sft_demo, configs/sft_demo.py) on
templated pairs: the right answer about a stdlib function chosen, another function's answer to
the same kind of question rejected (glm5_jax/data/templated.py). Pairs exported from served
feedback (`python -m glm5_jax.data.feedback --pairs`, docs/feedback.md) have the same format.

    python train.py --config configs/dpo_demo.py                 # -> runs/dpo_demo
"""

import ml_collections

from glm5_jax.data.templated import ensure_chat_set


def get_config(argument: str = "runs/sft_demo") -> ml_collections.ConfigDict:
    """argument: "CHECKPOINT" or "CHECKPOINT,DATA.jsonl"
    (e.g. `--config configs/dpo_demo.py:runs/x,data.jsonl`)."""
    init_from, _, data_path = argument.partition(",")
    config = ml_collections.ConfigDict()
    config.init_from = init_from  # the starting weights and the frozen DPO reference
    config.objective = "dpo"
    config.dpo_beta = 0.1
    config.trainable = ()
    config.frozen = ()
    config.execution = ml_collections.ConfigDict(dict(moe_impl="blocked"))
    config.data = ml_collections.ConfigDict(dict(
        sources=[dict(kind="preference_jsonl", name="stdlib_pairs", weight=1.0,
                      paths=[data_path or ensure_chat_set("~/.cache/glm5_jax/stdlib_pairs.jsonl",
                                                          pairs=True)])],
        tokenizer_path="", vocab_size=4096, cache_dir="~/.cache/glm5_jax",
        seq_len=384, validation_fraction=0.1, seed=0))
    config.num_train_steps = 40
    config.batch_size = 8  # 4 pairs
    config.grad_accum_steps = 1
    config.learning_rate = 1e-4
    config.warmup_steps = 5
    config.min_learning_rate_ratio = 0.1
    config.weight_decay = 0.0
    config.clip_grad_norm = 1.0
    config.router_bias_update_rate = 0.0  # the reference's routing stays comparable
    config.log_every = 5
    config.eval_every = 10
    config.eval_batches = 10
    config.checkpoint_every = 20
    config.keep_checkpoints = 2
    config.max_bad_steps = 5
    return config
