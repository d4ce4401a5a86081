"""GRPO on templated arithmetic: the chat model answers "What is 7 + 12? ..." and the verifier
rewards the exact integer (glm5_jax/rl/). Starts from an arithmetic SFT of the demo run, so the
initial reward is not zero (a 10M model trained on Python source never answers a sum):

    python train.py --config configs/demo.py                                    # runs/demo
    python train.py --config configs/grpo_sft_demo.py                           # runs/grpo_sft_demo
    python train.py --config configs/grpo_demo.py                               # runs/grpo_demo

`python bench/grpo.py` runs the last two and reports held-out reward before and after with its
95% interval, the reward curve, rollout tokens/s and the rollout / training share of wall time
(docs/finetuning.md, "GRPO"). The held-out prompts are never trained on, by SFT or GRPO.
"""

import ml_collections

# The task set, shared with configs/grpo_sft_demo.py (the SFT trains on its training split only).
ARITHMETIC = dict(kind="arithmetic", count=258, held_out=80, max_operand=12, ops="+-")
SEED = 0


def get_config(argument: str = "runs/grpo_sft_demo") -> ml_collections.ConfigDict:
    """argument: the checkpoint to start from (its weights are also the KL reference)."""
    config = ml_collections.ConfigDict()
    config.init_from = argument
    config.objective = "grpo"
    config.seed = SEED
    config.tasks = [ARITHMETIC]
    config.rewards = [dict(kind="arithmetic", weight=1.0)]
    config.grpo = ml_collections.ConfigDict(dict(
        prompts_per_step=16, group_size=8, max_new_tokens=8, temperature=1.0, top_p=1.0,
        advantage="std", aggregation="token", clip_low=0.2, clip_high=0.28, kl_coef=0.0,
        off_policy=0, engine_slots=64, engine_token_budget=256, engine_page_size=16, eval_prompts=200,
        eval_samples=8))
    config.execution = ml_collections.ConfigDict(dict(moe_impl="blocked"))
    config.data = ml_collections.ConfigDict(dict(seq_len=128))  # packed row length
    config.trainable = ()
    config.frozen = ()
    config.num_train_steps = 100
    config.batch_size = 8  # the least rows per step (more when the rollouts need them)
    config.grad_accum_steps = 1
    config.learning_rate = 1e-4
    config.warmup_steps = 5
    config.min_learning_rate_ratio = 1.0
    config.weight_decay = 0.0
    config.clip_grad_norm = 1.0
    config.mtp_loss_weight = 0.1
    config.router_bias_update_rate = 0.0
    config.log_every = 1
    config.eval_every = 25
    config.checkpoint_every = 50
    config.keep_checkpoints = 2
    config.max_bad_steps = 5
    return config
