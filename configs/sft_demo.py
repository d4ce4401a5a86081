"""Chat fine-tuning of the demo run: `configs/demo.py`'s weights, trained on assistant turns of
templated conversations about the standard library (glm5_jax/data/templated.py: "what does X do",
code -> explanation, signatures), rendered in the GLM-5 chat format.

    python train.py --config configs/demo.py                 # the run it starts from (runs/demo)
    python train.py --config configs/sft_demo.py             # -> runs/sft_demo

The chat set is written on first use to ~/.cache/glm5_jax/stdlib_chat.jsonl; 10% of its
conversations are held out, and val_loss is their assistant tokens' loss (docs/finetuning.md).
Peak memory: 6.4 GB resident, 2.9 GB with --noreuse_host_memory (docs/finetuning.md, "Memory").
"""

import ml_collections

from glm5_jax.data.templated import ensure_chat_set


def get_config(argument: str = "runs/demo") -> ml_collections.ConfigDict:
    """argument: "CHECKPOINT" or "CHECKPOINT,DATA.jsonl"
    (e.g. `--config configs/sft_demo.py:runs/x,data.jsonl`)."""
    init_from, _, data_path = argument.partition(",")
    config = ml_collections.ConfigDict()
    config.init_from = init_from  # the architecture, weights and tokenizer come from here
    config.trainable = ()
    config.frozen = ()
    config.execution = ml_collections.ConfigDict(dict(moe_impl="blocked"))
    config.data = ml_collections.ConfigDict(dict(
        sources=[dict(kind="chat_jsonl", name="stdlib_chat", weight=1.0,
                      paths=[data_path or ensure_chat_set("~/.cache/glm5_jax/stdlib_chat.jsonl")])],
        tokenizer_path="", vocab_size=4096, cache_dir="~/.cache/glm5_jax",
        seq_len=384, validation_fraction=0.1, seed=0))
    config.num_train_steps = 120
    config.batch_size = 8
    config.grad_accum_steps = 1
    config.learning_rate = 5e-4
    config.warmup_steps = 10
    config.min_learning_rate_ratio = 0.1
    config.weight_decay = 0.0
    config.clip_grad_norm = 1.0
    config.z_loss_weight = 1e-4
    config.mtp_loss_weight = 0.3
    config.router_bias_update_rate = 1e-3
    config.log_every = 10
    config.eval_every = 30
    config.eval_batches = 8
    config.checkpoint_every = 60
    config.keep_checkpoints = 2
    config.max_bad_steps = 5
    return config
