"""Chat SFT data: GLM-5-template rendering with loss only on assistant turns (real GLM tokenizer and
template), the mask through first-fit packing, truncation counts, clear errors, and the loss
ignoring targets outside the mask."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from glm_files import glm_data_dir, glm_tokenizer

from glm5_jax.chat.template import ChatRenderer
from glm5_jax.data import DataSourceError, Document, SourceSpec, make_train_iterator, make_validation_batches
from glm5_jax.data.chat import ChatStatistics, chat_examples
from glm5_jax.data.templated import stdlib_conversations
from glm5_jax.train.loss import language_model_losses

TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "add them"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "need the tool", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return glm_tokenizer()


@pytest.fixture(scope="module")
def glm5_renderer():
    return ChatRenderer((glm_data_dir() / "glm-5" / "chat_template.jinja").read_text())


def target_pieces(tokenizer, example) -> list[str]:
    """The decoded runs of consecutive target tokens."""
    pieces, run = [], []
    for token, target in zip(example["input_ids"].tolist(), example["loss_mask"].tolist(), strict=True):
        if target:
            run.append(token)
        elif run:
            pieces, run = pieces + [tokenizer.decode(run, skip_special_tokens=False)], []
    return pieces + ([tokenizer.decode(run, skip_special_tokens=False)] if run else [])


@pytest.mark.parametrize("template", ["glm5_jinja", "built_in"])
def test_assistant_turns_are_the_only_targets(tokenizer, glm5_renderer, template):
    renderer = glm5_renderer if template == "glm5_jinja" else ChatRenderer(None)
    documents = [Document("chat.jsonl:1", json.dumps({"messages": CONVERSATION})),
                 Document("chat.jsonl:2", json.dumps({"messages": CONVERSATION[:2]}))]
    examples, counts = chat_examples(documents, renderer, tokenizer, seq_len=512)
    assert counts.skipped_no_assistant == 1 and counts.examples == 2
    first, second = examples
    # One example per answered user turn: each turn as the model writes it (its reasoning shown).
    assert tokenizer.decode(first["input_ids"].tolist(), skip_special_tokens=False) == (
        "[gMASK]<sop><|system|>Be brief.<|user|>What is 2+2?"
        "<|assistant|><think>add them</think>4<|endoftext|>")
    assert target_pieces(tokenizer, first) == ["add them</think>4<|endoftext|>"]
    # The second example holds the first turn as context (reasoning cleared, no loss); the tool
    # call turn's target ends with <|observation|>, the token that stops it.
    assert "<|assistant|></think>4<|user|>Weather" in tokenizer.decode(second["input_ids"].tolist(),
                                                                        skip_special_tokens=False)
    assert target_pieces(tokenizer, second) == [
        "need the tool</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "</tool_call><|observation|>",
        "</think>It is sunny.<|endoftext|>"]
    assert counts.target_tokens == int(first["loss_mask"].sum() + second["loss_mask"].sum())


def test_truncation_is_counted_and_fully_cut_examples_dropped(tokenizer):
    long_answer = {"messages": [{"role": "user", "content": "Say it."},
                                {"role": "assistant", "content": "word " * 40}]}
    long_question = {"messages": [{"role": "user", "content": "word " * 40},
                                  {"role": "assistant", "content": "Yes."}]}
    documents = [Document(f"c:{i}", json.dumps(c)) for i, c in enumerate([long_answer, long_question])]
    examples, counts = chat_examples(documents, ChatRenderer(None), tokenizer, seq_len=24)
    assert counts.truncated_examples == 2 and counts.dropped_examples == 1 and counts.examples == 1
    assert len(examples[0]["input_ids"]) == 24 and counts.cut_target_tokens > 0
    assert counts.target_tokens == int(examples[0]["loss_mask"].sum())


@pytest.mark.parametrize("line, message", [
    ('{"messages": [', "c.jsonl:1: not valid JSON"),
    ('{"conversation": []}', "c.jsonl:1: field 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "c.jsonl:1: messages[0].role must be one of"),
    ('{"messages": [{"role": "user"}]}', "c.jsonl:1: messages[0].content is required"),
    ('{"messages": [{"role": "user", "content": "a"}], "tools": "x"}', "c.jsonl:1: field 'tools'"),
])
def test_malformed_lines_name_the_line_and_field(tokenizer, line, message):
    with pytest.raises(DataSourceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        chat_examples([Document("c.jsonl:1", line)], ChatRenderer(None), tokenizer, seq_len=64)


def test_packing_keeps_examples_whole_with_their_masks(tokenizer, tmp_path):
    conversations = stdlib_conversations(["bisect", "colorsys"])
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in conversations) + "\n")
    spec = SourceSpec(kind="chat_jsonl", paths=(str(path),))
    seq_len = 384
    documents = [Document(f"{path}:{i}", json.dumps(c)) for i, c in enumerate(conversations, 1)]
    wanted, _ = chat_examples(documents, ChatRenderer(None), tokenizer, seq_len)
    by_tokens = {tuple(e["input_ids"].tolist()): e["loss_mask"].tolist() for e in wanted}
    statistics = ChatStatistics()
    iterator = make_train_iterator([spec], tokenizer, seq_len=seq_len, batch_size=2, seed=0,
                                   validation_fraction=0.2, chat_statistics=statistics)
    seen = 0
    for _ in range(4):
        batch = next(iterator)
        for row in range(2):
            segments = batch["segment_ids"][row]
            assert np.all(batch["loss_mask"][row][segments == 0] == 0)
            for segment in set(segments.tolist()) - {0}:
                where = segments == segment
                tokens = tuple(batch["input_ids"][row][where].tolist())
                assert tokens in by_tokens, "an example was split across rows"
                assert batch["loss_mask"][row][where].tolist() == by_tokens[tokens]
                assert batch["positions"][row][where].tolist() == list(range(len(tokens)))
                seen += 1
    assert seen > 8 and statistics.examples > 0
    validation = make_validation_batches([spec], tokenizer, seq_len=seq_len, batch_size=2, seed=0,
                                         validation_fraction=0.2, max_batches=2)
    assert validation and all(0 < b["loss_mask"].sum() < (b["segment_ids"] > 0).sum() for b in validation)


def test_targets_outside_the_mask_change_nothing():
    """Changing a token that is not a target (loss_mask 0) leaves the loss as it was; changing an
    assistant token changes it. (Logits fixed: this is the label side of the loss.)"""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 12, 32)), jnp.float32)
    ids = rng.integers(1, 32, (1, 12))
    segments = np.ones((1, 12), np.int32)
    mask = np.asarray([[0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0]], np.int32)

    def loss(input_ids):
        value, metrics = language_model_losses(
            {"logits": logits}, jnp.asarray(input_ids), jnp.asarray(segments),
            z_loss_weight=0.0, mtp_loss_weight=0.0, balance_loss_weight=0.0,
            loss_mask=jnp.asarray(mask))
        return float(value), float(metrics["target_tokens"])

    base, targets = loss(ids)
    assert targets == 5.0
    for position in (1, 3, 7, 8, 11):  # user / context tokens
        changed = ids.copy()
        changed[0, position] = (changed[0, position] + 1) % 32
        assert loss(changed) == (base, targets)
    changed = ids.copy()
    changed[0, 5] = (changed[0, 5] + 1) % 32
    assert loss(changed)[0] != base
