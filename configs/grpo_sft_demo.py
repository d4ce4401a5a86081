"""Arithmetic SFT of the demo run, the starting point of configs/grpo_demo.py: the training split
of grpo_demo's task set as chat conversations (question -> the exact answer). The held-out
prompts GRPO evaluates on are not in it.

    python train.py --config configs/grpo_sft_demo.py            # from runs/demo -> runs/grpo_sft_demo
"""

from pathlib import Path

import ml_collections

from glm5_jax.pyconfig import load_config_file


def get_config(argument: str = "runs/demo") -> ml_collections.ConfigDict:
    from glm5_jax.rl.tasks import ensure_sft_set

    grpo = load_config_file(Path(__file__).with_name("grpo_demo.py"))
    data_path = ensure_sft_set(grpo.tasks, grpo.seed)
    config = load_config_file(Path(__file__).with_name("sft_demo.py"), f"{argument},{data_path}")
    config.data.sources[0]["name"] = "arithmetic"
    config.data.seq_len = 64
    config.batch_size = 16
    config.num_train_steps = 400  # ~20 epochs of the 258 training questions: 88% of them right, 51%
    config.learning_rate = 1e-3  # of the held-out ones (greedy), docs/finetuning.md
    config.eval_every = 100
    config.checkpoint_every = 400
    return config
