"""Tests for glm5_jax.data: sources, split, tokenizer, and the grain packing pipeline.

Small synthetic text files and a ~400-token BPE keep the file fast; one test reads the stdlib source.
"""

import json
import random

import numpy as np
import pytest

from glm5_jax.data import (
    DataPathNotFoundError,
    DataSourceError,
    Document,
    SourceSpec,
    VocabularyTooLargeError,
    check_vocab_fits,
    end_of_text_id,
    load_documents,
    load_or_train_tokenizer,
    make_train_iterator,
    make_validation_batches,
    source_spec_from_dict,
    split_documents,
    token_byte_lengths,
    train_bpe_tokenizer,
    training_documents,
)
from glm5_jax.data import tokenizer as tokenizer_module

# One xdist worker runs this module, so its fixtures (a trained tokenizer and corpus) are built once.
pytestmark = pytest.mark.xdist_group("data")

SEQ_LEN = 32
BATCH = 4


def _words(rng: random.Random, count: int, upper: bool) -> str:
    letters = "ABCDEFGHIJ" if upper else "abcdefghij"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(1, 6))) for _ in range(count))


def _write_corpus(folder, name: str, num_docs: int, upper: bool = False, seed: int = 0) -> list[str]:
    """Writes num_docs text files of varied length (some longer than a row); returns their texts."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for index in range(num_docs):
        text = f"{name}{index} " + _words(rng, rng.choice([3, 8, 20, 60]), upper)
        (folder / f"{name}_{index:03d}.txt").write_text(text)
        texts.append(text)
    return texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    lower = _write_corpus(root / "lower", "doc", 40)
    upper = _write_corpus(root / "upper", "DOC", 40, upper=True, seed=1)
    tokenizer = train_bpe_tokenizer(lower + upper + ["héllo wörld 日本 🎉"], vocab_size=400)
    return {
        "lower": SourceSpec(kind="files", paths=(str(root / "lower" / "*.txt"),), name="lower"),
        "upper": SourceSpec(kind="files", paths=(str(root / "upper" / "*.txt"),), name="upper"),
        "lower_texts": lower,
        "tokenizer": tokenizer,
    }


def _train(corpus, sources, seed=0, **kwargs):
    return make_train_iterator(sources, corpus["tokenizer"], seq_len=SEQ_LEN, batch_size=BATCH, seed=seed,
                               validation_fraction=0.2, **kwargs)


def _take(iterator, count):
    return [next(iterator) for _ in range(count)]


def _stream(batches, row):
    """The non-padding tokens of row `row` of each batch, as one list: each row position of a
    batch is fed by its own packed stream of documents."""
    tokens = []
    for batch in batches:
        ids, segments = batch["input_ids"][row], batch["segment_ids"][row]
        tokens.extend(ids[segments > 0].tolist())
    return tokens


def _rows_in_order(batches):
    """The non-padding tokens of all rows, batch by batch (validation is one stream)."""
    return [token for batch in batches for ids, segments in zip(batch["input_ids"], batch["segment_ids"],
                                                                 strict=True)
            for token in ids[segments > 0].tolist()]


def _pieces(tokens, end_of_text):
    """Token lists between end-of-text tokens (complete documents only)."""
    pieces, current = [], []
    for token in tokens:
        if token == end_of_text:
            pieces.append(current)
            current = []
        else:
            current.append(token)
    return pieces


def test_same_seed_same_batches_and_other_seed_differs(corpus):
    first = _take(_train(corpus, [corpus["lower"]], seed=3), 5)
    again = _take(_train(corpus, [corpus["lower"]], seed=3), 5)
    other = _take(_train(corpus, [corpus["lower"]], seed=4), 5)
    for a, b in zip(first, again, strict=True):
        assert all(np.array_equal(a[key], b[key]) for key in a)
    assert not all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, other, strict=True))
    assert set(first[0]) == {"input_ids", "segment_ids", "positions", "loss_mask"}
    assert all(np.array_equal(b["loss_mask"], b["segment_ids"] > 0) for b in first)  # text: every real token
    assert all(value.dtype == np.int32 and value.shape == (BATCH, SEQ_LEN) for value in first[0].values())


def test_packing_segments_positions_and_document_order(corpus):
    tokenizer = corpus["tokenizer"]
    end_of_text = end_of_text_id(tokenizer)
    train_docs = training_documents([corpus["lower"]], seed=0, validation_fraction=0.2)[0]
    expected = sorted(tokenizer.encode(document.text).ids for document in train_docs)
    epoch_tokens = sum(len(ids) + 1 for ids in expected)
    batches = _take(_train(corpus, [corpus["lower"]]), 4 * epoch_tokens // (SEQ_LEN * BATCH) + 4)

    split_across_rows = 0
    for batch in batches:
        for ids, segments, positions in zip(*(batch[k] for k in ("input_ids", "segment_ids", "positions")),
                                            strict=True):
            assert segments[0] == 1 and np.all(np.diff(segments) >= 0)  # 1-based, contiguous segments
            for segment in np.unique(segments[segments > 0]):
                run = positions[segments == segment]
                assert np.array_equal(run, np.arange(len(run)))  # positions restart at 0 per segment
            assert np.all(positions[segments == 0] == 0)
            split_across_rows += ids[-1] != end_of_text  # the row ends inside a document
    assert split_across_rows > 0

    # Every stream, cut at end-of-text, holds whole training documents in order; together the
    # streams cover all of them; a stream's second epoch is its first in another order.
    expected_set = {tuple(ids) for ids in expected}
    seen, reshuffled = set(), 0
    for row in range(BATCH):
        pieces = [tuple(piece) for piece in _pieces(_stream(batches, row), end_of_text)]
        assert pieces and all(piece in expected_set for piece in pieces)
        seen.update(pieces)
        epoch = next(i for i, piece in enumerate(pieces) if piece in pieces[:i])  # first repeat
        if len(pieces) >= 2 * epoch:
            assert sorted(pieces[:epoch]) == sorted(pieces[epoch:2 * epoch])
            reshuffled += pieces[:epoch] != pieces[epoch:2 * epoch]
    assert seen == expected_set
    assert reshuffled > 0


def test_split_by_document_is_stable_and_disjoint():
    documents = [Document(f"file{index}.txt", f"text {index}") for index in range(200)]
    train, validation = split_documents(documents, 0.25, seed=7)
    assert {d.doc_id for d in train}.isdisjoint({d.doc_id for d in validation})
    assert len(train) + len(validation) == 200 and 25 <= len(validation) <= 75
    shuffled = list(reversed(documents))
    assert split_documents(shuffled, 0.25, seed=7) == (train, validation)
    assert split_documents(documents, 0.25, seed=8) != (train, validation)
    tiny_train, tiny_validation = split_documents(documents[:2], 0.01, seed=0)
    assert len(tiny_train) == len(tiny_validation) == 1  # each side keeps a document


def test_validation_batches_use_only_validation_documents(corpus):
    tokenizer = corpus["tokenizer"]
    kwargs = dict(seq_len=SEQ_LEN, batch_size=BATCH, seed=0, validation_fraction=0.2, max_batches=100)
    batches = make_validation_batches([corpus["lower"]], tokenizer, **kwargs)
    assert 0 < len(batches) < 100
    again = make_validation_batches([corpus["lower"]], tokenizer, **kwargs)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(batches, again, strict=True) for k in a)
    _, validation = split_documents(load_documents(corpus["lower"]), 0.2, seed=0)
    pieces = _pieces(_rows_in_order(batches), end_of_text_id(tokenizer))
    assert sorted(pieces) == sorted(tokenizer.encode(d.text).ids for d in validation)  # each once
    # Padding (segment 0, no loss) only after the stream's last real token, so every batch has one
    # shape. Whether any is needed depends on the split, which hashes the corpus's absolute paths.
    segments = np.concatenate([batch["segment_ids"].reshape(-1) for batch in batches])
    real = sum(len(ids) + 1 for ids in pieces)
    assert np.all(segments[:real] > 0) and np.all(segments[real:] == 0)
    assert all(not batch["loss_mask"][batch["segment_ids"] == 0].any() for batch in batches)
    assert all(value.shape == (BATCH, SEQ_LEN) for batch in batches for value in batch.values())


def _aligned_source(folder, tokenizer) -> tuple[SourceSpec, int]:
    """Documents that all tokenise to the same length, and seq_len = that length + EOS: every row ends
    exactly at a document boundary, so the packer's checkpoint has no partial document."""
    rng = random.Random(5)
    by_length: dict[int, list[str]] = {}
    for _ in range(400):
        text = _words(rng, 6, upper=False)
        by_length.setdefault(len(tokenizer.encode(text).ids), []).append(text)
    length, texts = max(by_length.items(), key=lambda item: len(item[1]))
    folder.mkdir()
    for index, text in enumerate(texts[:30]):
        (folder / f"{index:02d}.txt").write_text(text)
    return SourceSpec(kind="files", paths=(str(folder / "*.txt"),)), length + 1


@pytest.mark.parametrize("sources", ["single", "mixture", "aligned"])
def test_iterator_state_restores_after_json_round_trip(corpus, sources, tmp_path):
    seq_len = SEQ_LEN
    if sources == "aligned":
        aligned, seq_len = _aligned_source(tmp_path / "aligned", corpus["tokenizer"])
        specs = [aligned]
    else:
        specs = [corpus["lower"]] if sources == "single" else [corpus["lower"], corpus["upper"]]
    make = lambda: make_train_iterator(specs, corpus["tokenizer"], seq_len=seq_len, batch_size=BATCH,
                                       seed=0, validation_fraction=0.2)
    for taken in (1, 2, 5):
        iterator = make()
        _take(iterator, taken)
        state = json.loads(json.dumps(iterator.get_state()))
        expected = _take(iterator, 6)
        restored = make()
        restored.set_state(state)
        for a, b in zip(expected, _take(restored, 6), strict=True):
            assert all(np.array_equal(a[key], b[key]) for key in a)
    if sources == "aligned":
        assert np.all(expected[0]["segment_ids"] == 1)  # one whole document per row


def test_mixture_follows_weights(corpus):
    lower = SourceSpec(kind="files", paths=corpus["lower"].paths, weight=3.0)
    upper = SourceSpec(kind="files", paths=corpus["upper"].paths, weight=1.0)
    tokens = {"lower": 0, "upper": 0}
    for batch in _take(_train(corpus, [lower, upper]), 40):
        for ids, segments in zip(batch["input_ids"], batch["segment_ids"], strict=True):
            text = corpus["tokenizer"].decode(ids[segments > 0].tolist())
            assert not (any(c.isupper() for c in text) and any(c.islower() for c in text))  # one source a row
            tokens["upper" if any(c.isupper() for c in text) else "lower"] += int((segments > 0).sum())
    assert 2.5 < tokens["lower"] / tokens["upper"] < 3.5


def test_jsonl_source_and_clear_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"content": "first"}\n\n{"content": "second", "other": 1}\n{"content": ""}\n')
    documents = load_documents(SourceSpec(kind="jsonl", paths=(str(good),), field="content"))
    assert [(d.doc_id, d.text) for d in documents] == [(f"{good}:1", "first"), (f"{good}:3", "second")]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "ok"}\n{"text": "no content"}\n')
    with pytest.raises(DataSourceError, match=r"bad.jsonl:2.*'content'"):
        load_documents(SourceSpec(kind="jsonl", paths=(str(bad),), field="content"))
    with pytest.raises(DataPathNotFoundError, match="missing.txt"):
        load_documents(SourceSpec(kind="files", paths=(str(tmp_path / "missing.txt"),)))
    with pytest.raises(DataPathNotFoundError, match=r"nothing/\*\*/\*.txt"):
        load_documents(SourceSpec(kind="files", paths=(str(tmp_path / "nothing/**/*.txt"),)))
    with pytest.raises(DataSourceError, match="wieght"):
        source_spec_from_dict({"kind": "files", "paths": ["a"], "wieght": 2})
    with pytest.raises(DataSourceError, match="kind"):
        source_spec_from_dict({"kind": "parquet"})
    spec = source_spec_from_dict({"kind": "jsonl", "paths": ["x.jsonl"], "field": "body"})
    assert spec.paths == ("x.jsonl",) and spec.name == "x.jsonl"


def test_token_byte_lengths_match_utf8(corpus):
    tokenizer = corpus["tokenizer"]
    lengths = token_byte_lengths(tokenizer)
    assert lengths.shape == (tokenizer.get_vocab_size(),) and lengths[end_of_text_id(tokenizer)] == 0
    for text in ["héllo wörld 日本 🎉 tabs\tand\nnewlines", corpus["lower_texts"][0], "ÿ\x00\x7f ~"]:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == text
        assert int(lengths[ids].sum()) == len(text.encode("utf-8"))


def test_tokenizer_cache_and_vocab_check(corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = load_or_train_tokenizer(None, [corpus["lower"]], 300, str(cache))
    (cached,) = cache.glob("tokenizer-*.json")

    def no_training(*args, **kwargs):
        raise AssertionError("retrained instead of loading the cache")

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", no_training)
    second = load_or_train_tokenizer(None, [corpus["lower"]], 300, str(cache))
    assert second.get_vocab() == first.get_vocab()
    assert load_or_train_tokenizer(str(cached), [], 0, "unused").get_vocab() == first.get_vocab()
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_or_train_tokenizer(str(tmp_path / "nope.json"), [], 0, "unused")

    size = first.get_vocab_size()
    check_vocab_fits(first, size)
    with pytest.raises(VocabularyTooLargeError, match=rf"{size} ids.*\(100\)"):
        check_vocab_fits(first, 100)


def test_python_stdlib_source_runs_end_to_end(corpus):
    documents = load_documents(SourceSpec(kind="python_stdlib"))
    assert len(documents) > 500
    assert not any("site-packages" in d.doc_id or "dist-packages" in d.doc_id for d in documents)
    assert all(d.doc_id.startswith(("stdlib/", "python3-doc/")) for d in documents)
    batch = next(make_train_iterator([SourceSpec()], corpus["tokenizer"], seq_len=64, batch_size=2, seed=0,
                                     validation_fraction=0.01))
    assert batch["input_ids"].shape == (2, 64) and batch["segment_ids"][0, 0] == 1
