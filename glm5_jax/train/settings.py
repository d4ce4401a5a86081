"""Training settings: the top-level fields of a training config file, validated once."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from glm5_jax.model.config import check_field
from glm5_jax.model.dsa_training import DSA_STAGES
from glm5_jax.train.grpo import GRPOSettings

DENSE_WARMUP_TRAINABLE = ("*/indexer/*",)
GRAD_REDUCE_DTYPES = ("", "float32", "bfloat16")
OBJECTIVES = ("lm", "dpo", "grpo")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    num_train_steps: int = 1000
    batch_size: int = 16  # rows per optimizer step (all microbatches together)
    grad_accum_steps: int = 1  # microbatches per step; batch_size must divide evenly
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    min_learning_rate_ratio: float = 0.1  # cosine decays to learning_rate * this
    weight_decay: float = 0.1  # not applied to norms, biases or the router bias
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad_norm: float = 1.0
    z_loss_weight: float = 1e-4
    mtp_loss_weight: float = 0.3
    balance_loss_weight: float = 0.0  # optional sequence-level auxiliary loss
    router_bias_update_rate: float = 1e-3  # aux-loss-free balancing; 0 disables
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    max_bad_steps: int = 5  # consecutive NaN/Inf steps before stopping
    # Fine-tuning: start from an HF checkpoint or a train.py run (glm5_jax/train/init_from.py);
    # train only parameters matching `trainable` (all when empty) and not matching `frozen`
    # (fnmatch patterns on "/"-joined parameter paths, e.g. "moe_layers/moe/*", "*experts*").
    init_from: str = ""
    trainable: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    # "lm": next-token loss (on loss_mask tokens); "dpo": direct preference optimisation on
    # preference_jsonl pairs against the frozen init_from weights (glm5_jax/train/dpo.py);
    # "grpo": RL from verifier rewards on the serving engine's rollouts (glm5_jax/rl/, settings in
    # config.grpo: glm5_jax/train/grpo.py).
    objective: str = "lm"
    dpo_beta: float = 0.1
    grpo: GRPOSettings = GRPOSettings()
    # DSA training stage (glm5_jax/model/dsa_training.py): "off", "dense_warmup" (dense attention,
    # only the indexer trains, on its KL to the attention) or "sparse" (top-k attention, the whole
    # model on the LM loss plus the indexer's KL).
    dsa_stage: str = "off"
    indexer_kl_weight: float = 1.0
    # Cross-device gradient reduction (glm5_jax/train/step.py). "": XLA sums each weight's gradient
    # where it is computed (every microbatch, in the compute dtype). "float32" / "bfloat16": each
    # replica of the mesh's `data` axis accumulates its own gradient over the microbatches, and the
    # replicas are summed once per step in this dtype ("bfloat16" halves those bytes).
    grad_reduce_dtype: str = ""

    @classmethod
    def from_config(cls, config) -> TrainSettings:
        """Takes this class's fields from a config (ConfigDict); other sections are ignored."""
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if field.name in config:
                value = config[field.name]
                if field.name == "grpo":
                    value = GRPOSettings.from_dict(value)
                values[field.name] = tuple(value) if field.name in ("trainable", "frozen") else value
        if values.get("dsa_stage") == "dense_warmup" and not values.get("trainable"):
            values["trainable"] = DENSE_WARMUP_TRAINABLE  # the warm-up trains the indexer alone
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raises ConfigError naming the first invalid field."""
        require = functools.partial(check_field, self)

        for field in ("num_train_steps", "batch_size", "grad_accum_steps", "log_every",
                      "eval_every", "checkpoint_every", "keep_checkpoints", "max_bad_steps"):
            value = getattr(self, field)
            require(isinstance(value, int) and value >= 1, field, "must be a positive integer")
        require(self.batch_size % self.grad_accum_steps == 0, "grad_accum_steps",
                f"must divide batch_size={self.batch_size}")
        require(self.learning_rate > 0, "learning_rate", "must be > 0")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(0 <= self.min_learning_rate_ratio <= 1, "min_learning_rate_ratio", "must be in [0, 1]")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(0 <= self.adam_b1 < 1 and 0 <= self.adam_b2 < 1, "adam_b1", "betas must be in [0, 1)")
        require(self.clip_grad_norm > 0, "clip_grad_norm", "must be > 0")
        for field in ("trainable", "frozen"):
            require(all(isinstance(p, str) and p for p in getattr(self, field)), field,
                    "must be a list of parameter-path patterns (strings)")
        require(self.objective in OBJECTIVES, "objective", f"must be one of {OBJECTIVES}")
        require(self.dsa_stage in DSA_STAGES, "dsa_stage", f"must be one of {DSA_STAGES}")
        require(self.indexer_kl_weight >= 0, "indexer_kl_weight", "must be >= 0")
        require(self.dpo_beta > 0, "dpo_beta", "must be > 0")
        require(self.grad_reduce_dtype in GRAD_REDUCE_DTYPES, "grad_reduce_dtype",
                f"must be one of {GRAD_REDUCE_DTYPES} ('' = where XLA computes each gradient)")
        require(self.objective == "lm" or bool(self.init_from), "objective",
                f"{self.objective!r} needs init_from: the starting weights (and the frozen reference)")
        require(self.objective != "dpo" or (self.batch_size // self.grad_accum_steps) % 2 == 0, "batch_size",
                "must give an even number of rows per microbatch for 'dpo' "
                "(a chosen and a rejected row per pair)")
        for field in ("z_loss_weight", "mtp_loss_weight", "balance_loss_weight",
                      "router_bias_update_rate", "eval_batches"):
            require(getattr(self, field) >= 0, field, "must be >= 0")
