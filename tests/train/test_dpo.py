"""DPO: preference pairs as chosen/rejected rows with the answer's tokens as targets, the loss and
its metrics against a direct numpy computation, and clear errors for bad pair lines and configs."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from glm_files import glm_tokenizer

from glm5_jax.chat.template import ChatRenderer
from glm5_jax.data import DataSourceError, Document, SourceSpec, make_train_iterator, make_validation_batches
from glm5_jax.data.preference import preference_pairs
from glm5_jax.data.templated import stdlib_conversations, wrong_answer_pairs
from glm5_jax.model import ConfigError
from glm5_jax.train.dpo import dpo_loss
from glm5_jax.train.settings import TrainSettings


@pytest.fixture(scope="module")
def tokenizer():
    return glm_tokenizer()


def test_pairs_render_answers_after_the_prompt(tokenizer):
    line = json.dumps({"prompt": "Capital of France?", "chosen": "Paris.", "rejected": {"role": "assistant",
                                                                                     "content": "Rome."}})
    (pair,), counts = preference_pairs([Document("p.jsonl:1", line)], ChatRenderer(None), tokenizer, 32)
    assert counts.examples == 1 and pair["input_ids"].shape == (2, 32)
    # train.py logs them as pairs and answers, not as chat's conversations and examples.
    assert counts.as_dict(pairs=True) == {"pairs": 1, "pairs_kept": 1, "truncated_answers": 0,
                                          "cut_target_tokens": 0, "dropped_answers": 0,
                                          "target_tokens": int(pair["loss_mask"].sum())}
    for row, answer in enumerate(("Paris.", "Rome.")):
        length = int(pair["segment_ids"][row].sum())
        assert tokenizer.decode(pair["input_ids"][row, :length].tolist(), skip_special_tokens=False) == (
            f"[gMASK]<sop><|user|>Capital of France?<|assistant|></think>{answer}<|endoftext|>")
        targets = pair["input_ids"][row][pair["loss_mask"][row] > 0].tolist()
        assert tokenizer.decode(targets, skip_special_tokens=False) == f"</think>{answer}<|endoftext|>"


@pytest.mark.parametrize("line, message", [
    ('{"chosen": "a", "rejected": "b"}', "p.jsonl:1: needs 'messages'"),
    ('{"prompt": "q", "chosen": "a"}', "p.jsonl:1: field 'rejected' is missing"),
    ('{"prompt": "q", "chosen": {"role": "user", "content": "a"}, "rejected": "b"}',
     "p.jsonl:1: field 'chosen' must be a string or an assistant message"),
])
def test_bad_pair_lines_name_the_line_and_field(tokenizer, line, message):
    with pytest.raises(DataSourceError, match=message):
        preference_pairs([Document("p.jsonl:1", line)], ChatRenderer(None), tokenizer, 32)


def test_pair_batches_alternate_chosen_and_rejected(tokenizer, tmp_path):
    path = tmp_path / "pairs.jsonl"
    pairs = wrong_answer_pairs(stdlib_conversations(["bisect", "colorsys", "fnmatch"]))
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    spec = SourceSpec(kind="preference_jsonl", paths=(str(path),))
    batch = next(make_train_iterator([spec], tokenizer, seq_len=256, batch_size=4, seed=0,
                                     validation_fraction=0.2))
    assert batch["input_ids"].shape == (4, 256)
    for chosen, rejected in ((0, 1), (2, 3)):  # one prompt, two different answers
        first = np.flatnonzero(batch["loss_mask"][chosen])[0]
        assert first == np.flatnonzero(batch["loss_mask"][rejected])[0]
        assert np.array_equal(batch["input_ids"][chosen, :first], batch["input_ids"][rejected, :first])
    validation = make_validation_batches([spec], tokenizer, seq_len=256, batch_size=4, seed=0,
                                         validation_fraction=0.2, max_batches=3)
    assert validation and all(b["input_ids"].shape == (4, 256) for b in validation)
    with pytest.raises(ValueError, match="even"):
        make_train_iterator([spec], tokenizer, seq_len=256, batch_size=3, seed=0, validation_fraction=0.2)


def test_dpo_loss_equals_numpy():
    rng = np.random.default_rng(0)
    rows, length, vocab, beta = 4, 7, 11, 0.3
    logits = rng.normal(size=(rows, length, vocab)).astype(np.float32)
    ids = rng.integers(0, vocab, (rows, length))
    mask = np.zeros((rows, length), np.int32)
    mask[:, 3:6] = 1
    mask[3, 5] = 0  # answers of different lengths
    segments = np.ones((rows, length), np.int32)
    reference = np.pad(rng.normal(size=(rows, length - 1)), ((0, 0), (0, 1))).astype(np.float32)
    batch = {"input_ids": jnp.asarray(ids), "segment_ids": jnp.asarray(segments),
             "loss_mask": jnp.asarray(mask), "reference_log_probs": jnp.asarray(reference)}
    loss, metrics = dpo_loss(jnp.asarray(logits), batch, beta)

    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    policy = np.array([sum(log_softmax[r, t - 1, ids[r, t]] for t in range(1, length) if mask[r, t])
                       for r in range(rows)])
    ref = np.array([sum(reference[r, t - 1] for t in range(1, length) if mask[r, t]) for r in range(rows)])
    rewards = beta * (policy - ref)
    margins = rewards[0::2] - rewards[1::2]
    np.testing.assert_allclose(float(loss), np.mean(np.log1p(np.exp(-margins))), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["reward_margin"]), margins.mean(), rtol=1e-5)
    assert float(metrics["reward_accuracy"]) == np.mean(margins > 0)
    assert float(metrics["pairs"]) == 2


def test_dpo_config_is_checked():
    with pytest.raises(ConfigError, match="init_from"):
        TrainSettings(objective="dpo").validate()
    with pytest.raises(ConfigError, match="objective"):
        TrainSettings(objective="ppo").validate()
    with pytest.raises(ConfigError, match="even"):
        TrainSettings(objective="dpo", init_from="x", batch_size=6, grad_accum_steps=2).validate()
