"""GRPO end to end on the tiny model (train.py's objective="grpo" path, in this process): the engine
samples, a user-supplied reward scores, the trainer steps; the engine's log-probs equal the
trainer's on-policy (< 1e-4), the off-policy step is one step stale, the reference KL is logged,
and a run resumed from a checkpoint (with sampled-ahead rollouts in it) repeats the uninterrupted
run's metrics."""

import json
import shutil

import ml_collections
import numpy as np
import pytest

from glm5_jax.data.tokenizer import train_bpe_tokenizer
from glm5_jax.model import init_params
from glm5_jax.rl.batches import grpo_batch, pack
from glm5_jax.rl.loop import prompt_order, run_grpo
from glm5_jax.rl.rollouts import Rollout
from glm5_jax.train.checkpoints import RunCheckpoints
from glm5_jax.train.optimizer import make_optimizer
from glm5_jax.train.settings import TrainSettings
from glm5_jax.train.step import init_train_state


def completion_length_reward(task: dict, completion: str) -> float:
    """A reward that varies between samples of a prompt (the tiny model never answers a sum)."""
    return float(len(completion) % 3)


def test_packing_and_batch_fields():
    assert pack([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]
    rollouts = [Rollout(task_index=0, sample=s, prompt_ids=[7, 8, 9], completion_ids=[1] * (s + 1),
                        log_probs=[-0.5] * (s + 1), finish_reason="stop", text="", version=0, reward=float(s))
                for s in range(2)]
    batch, statistics = grpo_batch(rollouts, group_size=2, seq_len=16, min_rows=2, advantage="none",
                                   advantage_eps=1e-6, aggregation="token", max_new_tokens=4)
    assert statistics["rows"] == 2 and batch["input_ids"].shape == (2, 16)
    np.testing.assert_array_equal(batch["segment_ids"][0, :9], [1, 1, 1, 1, 2, 2, 2, 2, 2])
    np.testing.assert_array_equal(batch["positions"][0, 4:9], [0, 1, 2, 3, 4])
    # Completion token 1 of sequence 2 sits at column 7: its fields at column 6 (aligned with logits).
    np.testing.assert_array_equal(np.flatnonzero(batch["token_weights"][0]), [2, 6, 7])
    np.testing.assert_allclose(batch["advantages"][0, [2, 6, 7]], [-0.5, 0.5, 0.5])
    np.testing.assert_allclose(batch["token_weights"][0, [2, 6, 7]], 1 / 3)
    np.testing.assert_array_equal(batch["loss_mask"][0, :9], [0, 0, 0, 1, 0, 0, 0, 1, 1])
    assert sorted(prompt_order(10, 0, 1, 5) + prompt_order(10, 0, 2, 5)) == list(range(10))  # an epoch


@pytest.fixture(scope="module")
def init_run(tiny_config, tmp_path_factory):
    """A train.py run directory of the tiny model with a byte-level BPE tokenizer."""
    config = tiny_config.replace(vocab_size=320, eos_token_ids=(0,), bos_token_id=None, pad_token_id=0)
    workdir = tmp_path_factory.mktemp("grpo_init")
    texts = ["What is 3 + 4? Answer with the number only. 7 12 19 <|user|><|assistant|></think>"] * 20
    train_bpe_tokenizer(texts, 300).save(str(workdir / "tokenizer.json"))
    run = RunCheckpoints(workdir)
    run.save(1, init_train_state(init_params(config, 0), make_optimizer(TrainSettings())), {},
             {"model": config.to_dict()})
    run.close()
    return workdir


def grpo_config(init_from, steps: int) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.init_from = str(init_from)
    config.objective = "grpo"
    config.tasks = [dict(kind="arithmetic", count=24, held_out=4, max_operand=5, ops="+")]
    config.rewards = [dict(kind="python", function=f"{__file__}:completion_length_reward")]
    config.grpo = ml_collections.ConfigDict(dict(
        prompts_per_step=2, group_size=3, max_new_tokens=4, kl_coef=0.05, off_policy=1, engine_slots=4,
        engine_token_budget=16, eval_prompts=4, eval_samples=2))
    config.execution = ml_collections.ConfigDict(dict(moe_impl="dense"))
    config.data = ml_collections.ConfigDict(dict(seq_len=64))
    config.num_train_steps = steps
    config.batch_size = 2
    config.learning_rate = 1e-2
    config.warmup_steps = 0
    config.log_every = 1
    config.eval_every = 100
    config.checkpoint_every = 2
    config.mtp_loss_weight = 0.1
    return config


def records(workdir) -> dict[int, dict]:
    merged = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        merged.setdefault(record["step"], {}).update(record)
    return merged


def test_grpo_runs_and_resumes_exactly(init_run, tmp_path):
    whole = tmp_path / "whole"
    run_grpo(grpo_config(init_run, 3), str(whole))
    metrics = records(whole)
    assert {"heldout/reward", "heldout/reward_low", "heldout/reward_high", "heldout/sampled_reward",
            "heldout/sampled_reward_low", "heldout/sampled_reward_high"} <= set(metrics[0])
    for step in (1, 2, 3):
        for key in ("loss", "pg_loss", "kl", "mtp_loss", "reward/mean", "reward/python", "staleness",
                    "rollout_tokens_per_second", "log_prob_gap"):
            assert key in metrics[step], (step, key)
    assert metrics[1]["staleness"] == 0 and metrics[2]["staleness"] == 1 == metrics[3]["staleness"]
    # Step 1 trains on rollouts of the weights it starts from: engine and trainer agree.
    assert metrics[1]["log_prob_gap"] < 1e-4 and abs(metrics[1]["ratio_mean"] - 1) < 1e-4
    assert metrics[1]["kl"] < 1e-6 < metrics[3]["kl"]  # the policy moved away from the reference
    assert metrics[1]["reward/std"] > 0  # the groups carry a signal

    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "3")
    run_grpo(grpo_config(init_run, 3), str(resumed))
    again = records(resumed)
    assert again[3]["staleness"] == 1  # step 3's rollouts, sampled ahead by step 1's weights, were saved
    for key in ("loss", "pg_loss", "kl", "reward/mean", "grad_norm", "log_prob_gap"):
        assert again[3][key] == pytest.approx(metrics[3][key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("change, message", [
    (lambda c: c.__delitem__("tasks"), "needs config.tasks"),
    (lambda c: c.__delitem__("data"), "data.seq_len must be an integer"),
    (lambda c: c.__setattr__("mesh", ml_collections.ConfigDict(dict(data=2))), "one process on one device"),
    (lambda c: c.__setattr__("rewards", [dict(kind="arithmetic", weight="x")]), "weight"),
])
def test_bad_grpo_configs_are_named(init_run, tmp_path, change, message):
    config = grpo_config(init_run, 1)
    with config.unlocked():
        change(config)
    with pytest.raises(SystemExit, match=message):
        run_grpo(config, str(tmp_path / "bad"))

