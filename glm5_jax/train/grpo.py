"""Group relative policy optimisation (GRPO; Shao et al., 2024) on rollout batches.

A step trains on G sampled completions of each of N prompts (glm5_jax/rl/ builds the batch from the
serving engine's rollouts). With r_i the verifier reward of completion i of a group:

    advantage A_i = (r_i - mean(r)) / (std(r) + eps)          advantage = "std" (GRPO)
                  =  r_i - mean(r)                             advantage = "none" (Dr. GRPO)

and, per completion token t, with log pi the trained policy's log-probability of the token at
the rollout temperature, log pi_old the rollout engine's (the behaviour policy's: the engine
reports the log-softmax of the logits it drew from) and log ref the frozen reference's:

    ratio_t   = exp(log pi - log pi_old)
    pg_t      = -min(ratio_t * A_i, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A_i)
    kl_t      = exp(log ref - log pi) - (log ref - log pi) - 1       (k3: unbiased, >= 0)
    loss      = sum_t w_t * (pg_t + kl_coef * kl_t)  [+ mtp_loss_weight * the MTP head's CE]

The weights w_t (`token_weights`) set the aggregation: "token" = 1 / (completion tokens in the
batch) (DAPO's token mean: every token counts the same, long answers weigh more), "sequence" =
1 / (N G |o_i|) (GRPO's mean of per-completion means), "sequence_sum" = 1 / (N G max_new_tokens)
(Dr. GRPO: no length normalisation bias). The ratio corrects for the rollout policy being older
than the trained one (one-step off-policy) and for any engine / trainer numerical difference.

Batches are packed rows (segment_ids per completion; glm5_jax/rl/batches.py); every per-token
field is aligned with the logits: column t belongs to the token at t + 1 (last column unused).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.model.config import check_field
from glm5_jax.train.loss import targets_for, token_cross_entropy

ADVANTAGES = ("std", "none")
AGGREGATIONS = ("token", "sequence", "sequence_sum")


@dataclasses.dataclass(frozen=True)
class GRPOSettings:
    """`config.grpo`: rollouts, the loss and its staleness. Rollouts: prompts_per_step prompts,
    group_size samples each at temperature / top_p, up to max_new_tokens; off_policy 0 generates
    a step's rollouts with the weights it trains (on-policy), 1 generates step n + 1's while step
    n trains (one step stale, the ratio corrects for it)."""

    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    advantage: str = "std"
    advantage_eps: float = 1e-6
    aggregation: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0  # 0: no reference model is loaded
    off_policy: int = 0
    # Render prompts with thinking on (the generation prompt opens <think>; rewards read the
    # answer after </think>) or off (the answer follows the prompt directly).
    enable_thinking: bool = False
    # The rollout engine (glm5_jax/engine/engine.py): slots, prefill tokens per step, page size.
    engine_slots: int = 32
    engine_token_budget: int = 256
    engine_page_size: int = 16
    # Held-out evaluation every eval_every steps: greedy answers to this many held-out prompts, and
    # eval_samples sampled ones each at the rollout temperature (0: greedy only).
    eval_prompts: int = 100
    eval_samples: int = 0

    @classmethod
    def from_dict(cls, values) -> GRPOSettings:
        values = dict(values or {})
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"grpo: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raises ConfigError naming the first invalid field."""
        require = functools.partial(check_field, self)
        for field in ("prompts_per_step", "max_new_tokens", "engine_slots", "engine_token_budget",
                      "engine_page_size", "eval_prompts"):
            value = getattr(self, field)
            require(isinstance(value, int) and value >= 1, field, "must be a positive integer")
        require(isinstance(self.group_size, int) and self.group_size >= 2, "group_size",
                "must be an integer >= 2 (advantages compare the samples of a prompt)")
        require(self.temperature > 0, "temperature", "must be > 0 (rollouts sample)")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        require(self.advantage in ADVANTAGES, "advantage", f"must be one of {ADVANTAGES}")
        require(self.advantage_eps > 0, "advantage_eps", "must be > 0")
        require(self.aggregation in AGGREGATIONS, "aggregation", f"must be one of {AGGREGATIONS}")
        require(0 <= self.clip_low < 1 and self.clip_high >= 0, "clip_low",
                "clip_low must be in [0, 1) and clip_high >= 0")
        require(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        require(isinstance(self.eval_samples, int) and self.eval_samples >= 0, "eval_samples",
                "must be an integer >= 0 (0: greedy evaluation only)")
        require(self.off_policy in (0, 1), "off_policy", "must be 0 (on-policy) or 1 (one step stale)")
        require(isinstance(self.enable_thinking, bool), "enable_thinking", "must be True or False")


# ---------------------------------------------------------------- host side (numpy)
def group_advantages(rewards: np.ndarray, advantage: str = "std", eps: float = 1e-6) -> np.ndarray:
    """rewards [N, G] (G samples of each of N prompts) -> advantages [N, G] f32. "std": centred on
    the group mean, divided by the group's sample standard deviation (ddof 1, as TRL and verl) +
    eps; "none": centred only (Dr. GRPO). A group whose samples all score the same gets 0."""
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, samples >= 2], got shape {rewards.shape}")
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    if advantage == "none":
        return centred.astype(np.float32)
    if advantage != "std":
        raise ValueError(f"advantage must be one of {ADVANTAGES}, got {advantage!r}")
    return (centred / (rewards.std(axis=1, ddof=1, keepdims=True) + eps)).astype(np.float32)


def token_weights(lengths: np.ndarray, aggregation: str, max_new_tokens: int) -> np.ndarray:
    """Each completion's per-token weight in the loss sum. lengths [S] (completion tokens trained)
    -> [S] f32 so that sum over completions of lengths * weight is 1 ("token", "sequence") or the
    share of max_new_tokens the completions used ("sequence_sum")."""
    lengths = np.asarray(lengths, np.float64)
    count = len(lengths)
    if aggregation == "token":
        weights = np.full(count, 1.0 / max(lengths.sum(), 1.0))
    elif aggregation == "sequence":
        weights = 1.0 / (count * np.maximum(lengths, 1.0))
    elif aggregation == "sequence_sum":
        weights = np.full(count, 1.0 / (count * max_new_tokens))
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    return np.where(lengths > 0, weights, 0.0).astype(np.float32)


# ---------------------------------------------------------------- the loss (jax)
def policy_log_probs(logits: jax.Array, input_ids: jax.Array, temperature: float) -> jax.Array:
    """log pi(token at t + 1 | tokens <= t) at `temperature`. logits [B, T, V], input_ids [B, T]
    -> f32 [B, T] (last column: a padding target, weight 0 wherever used)."""
    segment = jnp.ones_like(input_ids)
    targets, _ = targets_for(logits, input_ids, segment, 1)
    nats, _ = token_cross_entropy(logits.astype(jnp.float32) / temperature, targets)
    return -nats


def grpo_token_loss(log_probs, rollout_log_probs, advantages, weights, *, clip_low: float,
                    clip_high: float, kl_coef: float = 0.0, reference_log_probs=None):
    """The clipped surrogate (+ k3 KL) summed with `weights`. Every argument [B, T] f32 (weights 0
    off completion tokens). Returns (loss scalar, metrics: pg_loss, kl, clip_fraction (weighted
    share of tokens whose clipped term was the minimum and differs), ratio_mean, ratio_max,
    log_prob_gap (weighted mean |log pi - log pi_old|))."""
    ratio = jnp.exp(log_probs - rollout_log_probs)
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    unclipped_term, clipped_term = ratio * advantages, clipped * advantages
    pg = -jnp.minimum(unclipped_term, clipped_term)
    total = jnp.maximum(weights.sum(), 1e-12)
    mean = lambda values: jnp.sum(values * weights) / total  # noqa: E731  per-token means
    on = weights > 0
    metrics = {"pg_loss": jnp.sum(pg * weights),
               "clip_fraction": mean((clipped_term < unclipped_term).astype(jnp.float32)),
               "ratio_mean": mean(ratio), "ratio_max": jnp.max(jnp.where(on, ratio, 0.0)),
               "log_prob_gap": mean(jnp.abs(log_probs - rollout_log_probs))}
    per_token = pg
    if kl_coef:
        delta = reference_log_probs - log_probs
        kl = jnp.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
        metrics["kl"] = mean(kl)
    loss = jnp.sum(per_token * weights)
    return loss, metrics


def grpo_loss(outputs, batch, settings: GRPOSettings, mtp_loss_weight: float = 0.0):
    """The GRPO loss of one batch from `apply_model`'s outputs (logits [B, T, V], and mtp_logits
    when the MTP head ran). batch: input_ids, segment_ids, positions, loss_mask (1 on completion
    tokens), rollout_log_probs, advantages, token_weights [, reference_log_probs], all [B, T].
    Returns (loss, metrics). The MTP head keeps learning its next-next-token loss on the
    completions (its drafts stay good for speculative decoding of the trained policy)."""
    log_probs = policy_log_probs(outputs["logits"], batch["input_ids"], settings.temperature)
    loss, metrics = grpo_token_loss(
        log_probs, batch["rollout_log_probs"], batch["advantages"], batch["token_weights"],
        clip_low=settings.clip_low, clip_high=settings.clip_high, kl_coef=settings.kl_coef,
        reference_log_probs=batch.get("reference_log_probs"))
    metrics["target_tokens"] = jnp.sum((batch["token_weights"] > 0).astype(jnp.float32))
    if "mtp_logits" in outputs and mtp_loss_weight:
        targets, weights = targets_for(outputs["mtp_logits"], batch["input_ids"], batch["segment_ids"], 2,
                                       batch["loss_mask"])
        nats, _ = token_cross_entropy(outputs["mtp_logits"], targets)
        mtp_loss = jnp.sum(nats * weights) / jnp.maximum(weights.sum(), 1.0)
        loss = loss + mtp_loss_weight * mtp_loss
        metrics["mtp_loss"] = mtp_loss
    metrics["loss"] = loss
    return loss, metrics
