"""Tests for glm5_jax.prepare on a planted corpus: every rule drops exactly its planted junk,
near-duplicates with known edits are found (and no pair below 0.5 Jaccard is), stats add up, the
learned scorer beats a constant, executors agree, the shards read back as a training source, every
input path ends with an outcome (binary, empty, dangling and looping symlinks, duplicate paths:
each real file and folder read once, in prepare and the training sources alike), every phase
says what it is doing on stderr (plain lines off a terminal), a missing quality classifier is
trained only when it would score something, and the difficulty stage stores a reference model's
bits per byte.

No JAX but in the last test (the difficulty stage's tiny reference model, ~5 s); the whole file runs
in a few seconds plus Ray's start-up (one test) and that one.
"""

import json
import os
import random
import re
import sysconfig

import numpy as np
import pytest

from glm5_jax.data import make_train_iterator, source_spec_from_dict, train_bpe_tokenizer
from glm5_jax.data.paths import SKIP_REASONS
from glm5_jax.data.prepared import read_prepared, shard_files
from glm5_jax.data.sources import DataSourceError, SourceSpec, load_documents, scan_documents
from glm5_jax.prepare import domains, normalise, quality, quality_data
from glm5_jax.prepare.config import PrepareConfigError, settings_from_config
from glm5_jax.prepare.dedup import shingles
from glm5_jax.prepare.executors import LocalExecutor
from glm5_jax.prepare.progress import Progress
from glm5_jax.prepare.readers import ReaderSpec, read_source, scan_source
from glm5_jax.prepare.run import prepare

pytestmark = pytest.mark.xdist_group("prepare")

STOP = ("the", "of", "and", "to", "with", "that")
COMMON = ("a", "in", "it", "for", "not", "on", "as", "at", "this", "but", "by", "from")  # no Gopher stop word


def _vocabulary(rng, count, low=4, high=8):
    letters = "bcdfghklmnprstvz"
    vowels = "aeiou"
    return [
        "".join(rng.choice(letters if i % 2 == 0 else vowels) for i in range(rng.randint(low, high)))
        for _ in range(count)
    ]


def _sentence(rng, vocabulary, glue=STOP, length=(9, 14)):
    words = [
        rng.choice(glue) if rng.random() < 0.3 else rng.choice(vocabulary)
        for _ in range(rng.randint(*length))
    ]
    return " ".join(words).capitalize() + "."


def _prose(rng, vocabulary, paragraphs=4, sentences=4, **kwargs):
    return "\n\n".join(
        " ".join(_sentence(rng, vocabulary, **kwargs) for _ in range(sentences)) for _ in range(paragraphs)
    )


def _edit(rng, text, substitutions, vocabulary):
    """text with `substitutions` words replaced, spread evenly (known edits for the near-dup test)."""
    words = text.split(" ")
    for position in np.linspace(0, len(words) - 1, substitutions).astype(int):
        words[position] = rng.choice(vocabulary) + "x"
    return " ".join(words)


def _code(rng, vocabulary, functions=4):
    parts = []
    for _ in range(functions):
        name, argument = rng.choice(vocabulary), rng.choice(vocabulary)
        parts.append(
            f'def {name}_{rng.randrange(1000)}({argument}):\n    """Return {argument} scaled."""\n'
            f"    total = {argument} * {rng.randrange(2, 9)}\n    return total + {rng.randrange(100)}\n"
        )
    return "\n\n".join(parts)


PLANTED_RULES = {
    "gopher_word_count",
    "gopher_mean_word_length",
    "gopher_symbol_ratio",
    "gopher_bullet_lines",
    "gopher_ellipsis_lines",
    "gopher_alpha_words",
    "gopher_stop_words",
    "gopher_line_repetition",
    "gopher_ngram_repetition",
    "c4_lorem_ipsum",
    "c4_curly_braces",
    "c4_javascript_notice",
    "code_max_line_length",
    "code_alphanumeric_fraction",
    "code_generated_marker",
}


def _junk(rng, vocabulary):
    """{rule: text} with one document failing only that rule (first in rule order)."""
    sentences = [_sentence(rng, vocabulary) for _ in range(12)]
    fresh = lambda count: [_sentence(rng, vocabulary) for _ in range(count)]  # no junk shares sentences
    long_words = _vocabulary(rng, 200, 14, 16)
    return {
        "gopher_word_count": " ".join(sentences[:2]),
        "gopher_mean_word_length": _prose(rng, long_words),
        "gopher_symbol_ratio": " ".join(
            w + (" #tag" if i % 5 == 0 else "") for i, w in enumerate(" ".join(fresh(12)).split())
        ),
        "gopher_bullet_lines": "\n".join(f"- {sentence}" for sentence in fresh(12)),
        "gopher_ellipsis_lines": "\n".join(
            " ".join(fresh(3)).rstrip(".") + ("..." if i % 2 else ".") for i in range(8)
        ),
        "gopher_alpha_words": " ".join(
            w if i % 3 else str(1000 + i) for i, w in enumerate(" ".join(fresh(12)).split())
        ),
        "gopher_stop_words": _prose(rng, vocabulary, glue=COMMON),
        "gopher_line_repetition": "\n".join(sentences[:6] + sentences[:4]),
        "gopher_ngram_repetition": "\n".join(
            f"{s} Nobody koloma serat vinu bela daro here." for s in fresh(12)
        ),
        "c4_lorem_ipsum": _prose(rng, vocabulary) + "\n\nLorem ipsum dolor sit amet, consectetur adipiscing.",
        "c4_curly_braces": _prose(rng, vocabulary) + "\n\nDear {customer_name}, thanks for the order.",
        "c4_javascript_notice": _prose(rng, vocabulary) + "\n\nPlease enable JavaScript in your browser.",
    }


def _code_junk(rng, vocabulary):
    return {
        "code_max_line_length": _code(rng, vocabulary) + "\nTABLE = '" + "ab " * 600 + "'\n",
        "code_alphanumeric_fraction": "PATTERN = (\n"
        + "\n".join("    '+-*/ <>=!~ |&^ %$@ ;:,. ?'" for _ in range(30))
        + ")\n",
        "code_generated_marker": "# This file is auto-generated. DO NOT EDIT.\n" + _code(rng, vocabulary),
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Planted files; returns paths and the expected fate of each planted document."""
    rng = random.Random(0)
    vocabulary = _vocabulary(rng, 3000)
    root = tmp_path_factory.mktemp("planted")
    (root / "text").mkdir()
    (root / "code").mkdir()
    expected, texts = {}, {}

    def write(folder, name, text, fate):
        path = root / folder / name
        path.write_text(text, encoding="utf-8", newline="")
        texts[path.as_posix()] = text
        expected[path.as_posix()] = fate

    for index in range(30):
        write("text", f"good_{index:02d}.txt", _prose(rng, vocabulary), "kept")
    for index in range(12):
        write("code", f"good_{index:02d}.py", _code(rng, vocabulary), "kept")
    for rule, text in _junk(rng, vocabulary).items():
        write("text", f"junk_{rule}.txt", text, rule)
    for rule, text in _code_junk(rng, vocabulary).items():
        write("code", f"junk_{rule}.py", text, rule)
    # Normalisation: a CRLF / no-break-space / decomposed-accent copy of good_00 is an exact duplicate.
    base = texts[(root / "text" / "good_00.txt").as_posix()]
    variant = base.replace("\n", "\r\n").replace(" ", "\u00a0", 3).replace("\r\n", "  \r\n", 2) + "  \r\n"
    write("text", "zz_exact_copy.txt", variant, "exact_duplicate")
    write("text", "zz_nothing.txt", "\u200b\u200b\n", "empty")
    # Quality: keyword spam that no rule catches (the planted model penalises "cheap" and "buy").
    write("text", "spam.txt", _prose(rng, vocabulary) + " Cheap buy cheap buy now.", "low_quality")
    # Level 3: a code file that is only a licence header is empty after cleaning.
    write(
        "code",
        "licence_only.py",
        "# Copyright 2020 Example Corp.\n# Licensed under the MIT License.\n",
        "empty_after_cleaning",
    )
    write(
        "code",
        "with_licence.py",
        "# Copyright 2020 Example Corp. All rights reserved.\n\n\n\n" + _code(rng, vocabulary),
        "kept",
    )
    # Near duplicates: copies of good_01..good_20 with known substitutions (high and low similarity).
    pairs = []
    for index in range(1, 21):
        original = texts[(root / "text" / f"good_{index:02d}.txt").as_posix()]
        substitutions = 3 if index <= 12 else 40  # ~0.9 Jaccard / ~0.1-0.45 Jaccard
        copy = _edit(rng, original, substitutions, vocabulary)
        name = f"zz_edit_{index:02d}.txt"
        high = substitutions == 3
        write("text", name, copy, "near_duplicate" if high else "kept")
        pairs.append(
            ((root / "text" / name).as_posix(), (root / "text" / f"good_{index:02d}.txt").as_posix())
        )
    return {"root": root, "expected": expected, "texts": texts, "pairs": pairs}


def _spam_model(path):
    """A hand-set QualityModel: bias +4, the buckets of "cheap", "buy" and their bigrams very negative."""
    weights = np.zeros(1 << 16, np.float32)
    indices, _ = quality.hashed_features("cheap buy cheap", 1 << 16)
    weights[indices] = -60.0
    quality.save_model(quality.QualityModel(weights, 4.0), path)
    return str(path)


def _config(corpus, **overrides):
    root = corpus["root"]
    config = {
        "sources": [
            dict(kind="files", paths=[f"{root}/text/*.txt"], name="text"),
            dict(kind="code_dir", paths=[f"{root}/code"], extensions=[".py"], name="code"),
        ],
        "dedup": dict(threshold=0.7),
        "quality": dict(model_path=_spam_model(root / "spam_model.npz"), threshold=0.5),
        "output": dict(docs_per_shard=16),
        "batch_docs": 8,
        "seed": 0,
    }
    config.update(overrides)
    return settings_from_config(config)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    output = tmp_path_factory.mktemp("prepared")
    with LocalExecutor(workers=1, progress=False) as executor:
        stats = prepare(_config(corpus), output, executor=executor, review=2)
    decisions = {
        row["id"]: row for row in map(json.loads, (output / "decisions.jsonl").read_text().splitlines())
    }
    return {"output": output, "stats": stats, "decisions": decisions}


def test_each_rule_drops_exactly_its_planted_junk(corpus, prepared):
    fates = {doc_id: row.get("reason", "kept") for doc_id, row in prepared["decisions"].items()}
    assert fates == corpus["expected"]
    dropped_rules = {rule for rule, entry in prepared["stats"]["rules"].items() if entry["documents"]}
    assert dropped_rules == PLANTED_RULES
    assert all(
        entry["documents"] == 1 for rule, entry in prepared["stats"]["rules"].items() if rule in PLANTED_RULES
    )


def test_near_duplicates_found_without_false_positives(corpus, prepared):
    decisions = prepared["decisions"]
    similarity = {}
    for copy, original in corpus["pairs"]:
        a, b = set(shingles(corpus["texts"][copy], 5)), set(shingles(corpus["texts"][original], 5))
        similarity[copy] = len(a & b) / len(a | b)
    above = [copy for copy, value in similarity.items() if value >= 0.7]
    below = [copy for copy, value in similarity.items() if value < 0.5]
    assert len(above) >= 10 and len(below) >= 5, similarity  # the planted edits span both sides
    found = [copy for copy in above if decisions[copy].get("duplicate_of") == dict(corpus["pairs"])[copy]]
    assert len(found) / len(above) >= 0.9
    assert not [copy for copy in below if decisions[copy].get("reason") == "near_duplicate"]
    # No document is called a near-duplicate of one it shares under half its shingles with.
    for doc_id, row in decisions.items():
        if row.get("reason") == "near_duplicate":
            a = set(shingles(corpus["texts"][doc_id], 5))
            b = set(shingles(corpus["texts"][row["duplicate_of"]], 5))
            assert len(a & b) / len(a | b) >= 0.5, doc_id


def test_stats_add_up(prepared):
    stats = prepared["stats"]
    assert json.loads((prepared["output"] / "stats.json").read_text()) == stats
    stages = stats["stages"]
    assert [stage["name"] for stage in stages] == [
        "normalise",
        "exact_dedup",
        "near_dedup",
        "rules",
        "quality",
        "domain",
    ]
    for stage, following in zip(stages, stages[1:], strict=False):
        assert stage["documents_out"] == following["documents_in"]
        assert stage["tokens_out"] == following["tokens_in"]
    for stage in stages:
        dropped = stage["dropped"].values()
        assert stage["documents_in"] == stage["documents_out"] + sum(entry["documents"] for entry in dropped)
        assert (
            stage["tokens_in"]
            == stage["tokens_out"] + sum(e["tokens"] for e in dropped) + stage["tokens_changed"]
        )
    assert stats["documents_in"] == len(prepared["decisions"])
    assert stats["documents_out"] == sum(row["kept"] for row in prepared["decisions"].values())
    assert stats["duplicates"]["exact"] == {"documents": 1, "groups": 1}
    assert sum(entry["documents"] for entry in stats["domains"].values()) == stats["documents_out"]
    assert sum(entry["token_share"] for entry in stats["domains"].values()) == pytest.approx(1.0)
    assert set(stats["domains"]) == {"code", "prose"}
    assert stats["kept_fraction"]["documents"] == pytest.approx(
        stats["documents_out"] / stats["documents_in"]
    )
    assert stats["timing"]["seconds_per_1k_documents"] > 0
    review = (prepared["output"] / "review.md").read_text()
    assert "## rules" in review and "### dropped (2)" in review and "### kept (2)" in review


def test_prepared_shards_read_back_as_a_source(prepared, corpus):
    import grain

    output = prepared["output"]
    kept = [doc_id for doc_id, row in prepared["decisions"].items() if row["kept"]]
    records = list(read_prepared(output))
    assert [record["id"] for record in records] == kept
    documents = load_documents(SourceSpec(kind="prepared", paths=(str(output),)))
    assert [document.doc_id for document in documents] == kept
    cleaned = next(record for record in records if record["id"].endswith("with_licence.py"))
    assert "Copyright" not in cleaned["text"] and cleaned["text"].startswith("def ")
    assert cleaned["domain"] == "code" and cleaned["quality"] is None
    shards = [str(path) for path in shard_files(output)]
    assert len(shards) == -(-len(kept) // 16) > 1
    source = grain.sources.ArrayRecordDataSource(shards)  # random access, as grain reads it
    assert len(source) == len(kept)
    assert json.loads(source[len(kept) - 1])["id"] == kept[-1]
    # train.py's data path: a `prepared` source through the grain packing pipeline.
    spec = source_spec_from_dict({"kind": "prepared", "paths": [str(output)]})
    tokenizer = train_bpe_tokenizer([record["text"] for record in records], vocab_size=300)
    batches = make_train_iterator(
        [spec], tokenizer, seq_len=32, batch_size=2, seed=0, validation_fraction=0.1
    )
    assert next(batches)["input_ids"].shape == (2, 32)


def _outputs(output):
    """Everything a run writes but its timing."""
    stats = json.loads((output / "stats.json").read_text())
    stats.pop("timing")
    return (
        [path.read_bytes() for path in shard_files(output)],
        (output / "decisions.jsonl").read_text(),
        stats,
        (output / "review.md").read_text(),
    )


def test_worker_count_does_not_change_the_output(corpus, prepared, tmp_path):
    with LocalExecutor(workers=2, progress=False) as executor:
        prepare(_config(corpus, batch_docs=3), tmp_path, executor=executor, review=2)
    assert _outputs(tmp_path) == _outputs(prepared["output"])


def test_ray_executor_matches_local(corpus, prepared, tmp_path):
    ray = pytest.importorskip("ray")
    from glm5_jax.prepare.executors import RayExecutor

    # One Ray worker: Ray's start (~10 s here) and its worker importing glm5_jax (and so JAX) are
    # most of this test's cost; more workers add start-up without testing anything more.
    with RayExecutor(workers=1, progress=False) as executor:
        prepare(_config(corpus, batch_docs=5), tmp_path, executor=executor, review=2)
    assert not ray.is_initialized()
    assert _outputs(tmp_path) == _outputs(prepared["output"])


def test_output_directory_is_not_overwritten_by_accident(corpus, prepared):
    with (
        LocalExecutor(workers=1, progress=False) as executor,
        pytest.raises(FileExistsError, match="overwrite"),
    ):
        prepare(_config(corpus), prepared["output"], executor=executor)


def test_learned_scorer_beats_a_constant(tmp_path):
    stdlib = sysconfig.get_paths()["stdlib"]
    documents = read_source(ReaderSpec(kind="files", paths=(f"{stdlib}/[a-c]*.py",)))
    passages = quality_data.positive_passages(documents)
    model = quality.train_model(passages, seed=0, dims=1 << 14, holdout_fraction=0.3)
    held_out = model.metrics["held_out"]
    assert held_out["examples"] >= 40
    assert held_out["accuracy"] >= held_out["constant_accuracy"] + 0.2
    assert held_out["precision"] >= 0.7 and held_out["recall"] >= 0.7
    quality.save_model(model, tmp_path / "model.npz")
    loaded = quality.load_model(tmp_path / "model.npz")
    text = passages[0].text
    assert loaded.score(text) == pytest.approx(model.score(text), abs=1e-6)
    assert loaded.metrics == json.loads(json.dumps(model.metrics))


def test_progress_writes_lines_off_a_terminal(capsys):
    """Off a terminal (pytest's capture, a CI log) a phase's progress is a start line, a line per
    `interval` and a done line, never tqdm's carriage-return redraws; disabled, nothing."""
    bar = Progress("phase", 4, "docs", interval=0.0)
    for _ in range(4):
        bar.update()
    bar.close("note")
    quiet = Progress("quiet", 4, "docs", enabled=False)
    quiet.update(4)
    quiet.close()
    with Progress("unknown total", None, "files") as counted:  # the default interval: no line between
        counted.update(3)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == "phase: started, 4 docs"
    assert re.fullmatch(r"phase: 1/4 docs \(25%\), [\d.,]+ docs/s, [\d.]+ s elapsed, ETA [\d.]+ s", lines[1])
    assert re.fullmatch(r"phase: done, 4 docs in [\d.]+ s \([\d.,]+ docs/s\); note", lines[5])
    assert lines[6] == "unknown total: started" and lines[7].startswith("unknown total: done, 3 files")
    assert len(lines) == 8
    assert "\r" not in err and "quiet" not in err


def test_every_phase_says_what_it_is_doing(corpus, tmp_path, capsys):
    """A run with progress on and stderr not a terminal: each phase writes what it does and its count
    (read per source, normalise, near dedup, the classifier's training, the filters, writing), the
    summary's stdout gets none of it. The classifier is missing and the prose would be scored, so
    it is trained (saying each step) and scores."""
    root = corpus["root"]
    model = tmp_path / "trained.npz"
    curated = [dict(kind="files", paths=[f"{root}/text/good_*.txt"], name="curated")]
    settings = _config(corpus, quality=dict(model_path=str(model), positive_sources=curated))
    with LocalExecutor(workers=1, progress=True) as executor:
        stats = prepare(settings, tmp_path / "out", executor=executor)
    captured = capsys.readouterr()
    assert "\r" not in captured.err and not captured.out
    out = {stage["name"]: stage["documents_out"] for stage in stats["stages"]}
    counts = {
        "read text": rf"\d+ files in [\d.]+ s .*; {stats['sources']['text']['documents_in']} documents",
        "read code": rf"{stats['sources']['code']['documents_in']} files in .*; \d+ documents",
        "read curated": r"30 files in .*; 30 documents",
        "normalise \\+ dedup keys": rf"{stats['documents_in']} docs in .*",
        "near dedup \\(LSH\\)": rf"{out['exact_dedup']} docs in .*",
        "quality: curated passages": r"30 docs in .*; \d+ passages",
        "quality: Newton-CG fit": r"\d+ steps in .*",
        "filter \\(domain, rules, quality, cleaning\\)": rf"{out['near_dedup']} docs in .*",
        "write shards": rf"{stats['documents_out']} records in .*",
    }
    for phase, count in counts.items():
        assert re.search(rf"^{phase}: started", captured.err, re.MULTILINE), phase
        assert re.search(rf"^{phase}: done, {count}$", captured.err, re.MULTILINE), phase
    training = r"^quality: training the classifier \(no model at .*trained\.npz yet\)$"
    assert re.search(training, captured.err, re.MULTILINE)
    assert re.search(r"^quality: held-out precision .* saved .*trained\.npz$", captured.err, re.MULTILINE)
    assert model.is_file() and stats["quality"]["skipped"] is None
    assert stats["quality"]["model"] == str(model) and stats["quality"]["scored"] > 0


def test_quality_classifier_is_skipped_when_it_would_score_nothing(corpus, tmp_path, capsys):
    """A missing model is not trained when no document left would be scored (code only, and prose
    that fails the rules), nor when its labelled data cannot be built: one line says why, level 2
    is off for the run, and stats.json records it."""
    root = corpus["root"]
    model = tmp_path / "never.npz"
    curated = [dict(kind="files", paths=[f"{root}/text/good_*.txt"], name="curated")]
    sources = [
        dict(kind="code_dir", paths=[f"{root}/code"], extensions=[".py"], name="code"),
        dict(kind="files", paths=[f"{root}/text/junk_gopher_word_count.txt"], name="short"),  # prose, fails
    ]
    settings = _config(corpus, sources=sources, quality=dict(model_path=str(model), positive_sources=curated))
    with LocalExecutor(workers=1, progress=False) as executor:
        stats = prepare(settings, tmp_path / "a", executor=executor)
        err = capsys.readouterr().err
        assert not model.exists()
        assert stats["quality"]["model"] is None and stats["quality"]["scored"] == 0
        assert stats["quality"]["skipped"] == "nothing_to_score"
        code = stats["sources"]["code"]["documents_in"]
        assert err.splitlines() == [
            f"quality: not training the classifier: none of the {code + 1} documents left after dedup "
            f"(code {code}, prose 1) is of quality.domains (prose, docs, other) and passes the rules, "
            f"so it would score nothing; level 2 skipped, {model} not written"
        ]
        # Prose that would be scored, but no curated source to learn from: skipped, saying why.
        text = [dict(kind="files", paths=[f"{root}/text/good_0[0-3].txt"], name="text")]
        settings = _config(corpus, sources=text, quality=dict(model_path=str(model)))
        stats = prepare(settings, tmp_path / "b", executor=executor)
        err = capsys.readouterr().err
        assert err.splitlines() == [
            "quality: level 2 skipped, the classifier cannot be trained: "
            "quality.positive_sources is empty: nothing to learn curated text from"
        ]
        assert stats["quality"]["skipped"] == "no_training_data" and stats["documents_out"] == 4
        assert not model.exists()


def test_normalise_and_domain_cleaning():
    assert normalise.normalise_text("\ufeff\n\ncafe\u0301\u00a0bar\r\nx\x07y\u200b\n\n") == "café bar\nxy"
    code = (
        "#!/usr/bin/env python\n# Copyright (c) 2001 PSF\n# Licensed under the PSF licence.\n\n"
        "import os  \n\n\n\n\nx = 1\n"
    )
    settings = settings_from_config({"sources": [dict(kind="python_stdlib")]}).domains
    assert domains.clean_text(code, "code", settings) == "#!/usr/bin/env python\nimport os\n\n\nx = 1"
    assert domains.clean_text("A  b.\n\n\n\nC   d.  ", "prose", settings) == "A b.\n\nC d."
    assert domains.tag_domain("lib/x.py", "anything") == "code"
    assert domains.tag_domain("docs/x.rst.txt", "anything") == "docs"
    assert domains.tag_domain("data.jsonl:3", "int main() {\n  return 0;\n}\n") == "code"
    assert domains.tag_domain("a.txt", "Title\n=====\n\nSee :func:`os.path` and ``x``.\n") == "docs"
    assert (
        domains.tag_domain(
            "a.txt", "This is a sentence with the words of it and a few more to read in the text for you."
        )
        == "prose"
    )
    assert domains.tag_domain("a.txt", "1 2 3 4 | 5 6") == "other"


def test_config_errors_name_the_key():
    with pytest.raises(PrepareConfigError, match="thresold"):
        settings_from_config({"sources": [dict(kind="python_stdlib")], "dedup": dict(thresold=0.5)})
    with pytest.raises(PrepareConfigError, match="no sources"):
        settings_from_config({"sources": []})
    with pytest.raises(ValueError, match="reader kind"):
        settings_from_config({"sources": [dict(kind="nope", paths=["x"])]})


@pytest.fixture
def awkward_tree(tmp_path):
    """A tree with every kind of input path a source skips, and four real text files (one of them
    outside, reached through a symlinked folder); returns (tree, {path: expected read outcome})."""
    rng = random.Random(1)
    vocabulary = _vocabulary(rng, 3000)
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    (tree / "sub").mkdir(parents=True)
    outside.mkdir()
    for path in (
        tree / "good_a.txt",
        tree / "good_b.txt",
        tree / "sub" / "good_c.txt",
        outside / "good_d.txt",
    ):
        path.write_text(_prose(rng, vocabulary))
    (tree / "nul.txt").write_bytes(b"text with a \x00 byte")
    (tree / "empty.txt").write_bytes(b"")
    (tree / "blank.txt").write_text("  \n\t\n")
    (tree / "dangling.txt").symlink_to(tree / "missing.txt")
    (tree / "link_to_a.txt").symlink_to("good_a.txt")  # a second name for a file already read
    (tree / "ext").symlink_to(outside)  # a symlinked folder: followed, once
    (tree / "again").symlink_to("sub")  # a second name for a folder already walked
    (tree / "sub" / "loop").symlink_to("..")  # glob would read the tree again 40 levels deep
    os.mkfifo(tree / "fifo.txt")
    expected = {
        f"{tree}/good_a.txt": "kept",
        f"{tree}/good_b.txt": "kept",
        f"{tree}/sub/good_c.txt": "kept",
        f"{tree}/ext/good_d.txt": "kept",
        f"{tree}/nul.txt": "binary",
        f"{tree}/empty.txt": "empty",
        f"{tree}/blank.txt": "whitespace_only",
        f"{tree}/dangling.txt": "dangling_symlink",
        f"{tree}/link_to_a.txt": "duplicate_path",
        f"{tree}/again": "duplicate_path",
        f"{tree}/sub/loop": "symlink_loop",
        f"{tree}/fifo.txt": "special_file",
    }
    if os.geteuid() != 0:  # root reads any file
        locked = tree / "locked.txt"
        locked.write_text(_prose(rng, vocabulary))
        locked.chmod(0)
        expected[str(locked)] = "unreadable"
    yield tree, expected
    if os.geteuid() != 0:
        (tree / "locked.txt").chmod(0o644)


def test_every_input_path_gets_an_outcome_and_symlinks_are_followed_once(awkward_tree, tmp_path):
    tree, expected = awkward_tree
    settings = settings_from_config(
        {"sources": [dict(kind="files", paths=[f"{tree}/**/*.txt"], name="tree")], "batch_docs": 8}
    )
    output = tmp_path / "prepared"
    with LocalExecutor(workers=1, progress=False) as executor:
        stats = prepare(settings, output, executor=executor)
    decisions = [json.loads(line) for line in (output / "decisions.jsonl").read_text().splitlines()]
    outcomes = {row["id"]: row.get("reason", "kept") for row in decisions}
    assert outcomes == expected  # every path, once; the loop read nothing twice
    read_rows = {row["id"]: row for row in decisions if row.get("stage") == "read"}
    assert read_rows[f"{tree}/link_to_a.txt"]["duplicate_of"] == f"{tree}/good_a.txt"
    assert read_rows[f"{tree}/again"]["duplicate_of"] == f"{tree}/sub"
    assert all(row["source"] == "tree" and row["kept"] is False for row in read_rows.values())
    skipped = [reason for reason in expected.values() if reason != "kept"]
    assert stats["read"] == {
        "files_in": len(expected),
        "files_read": 4,
        "skipped": {reason: skipped.count(reason) for reason in SKIP_REASONS},
    }
    assert stats["documents_in"] == 4  # documents read == real files
    assert stats["sources"]["tree"] == {
        "documents_in": 4,
        "documents_out": 4,
        "files_read": 4,
        "files_skipped": len(skipped),
    }
    assert json.loads((output / "stats.json").read_text())["read"] == stats["read"]


def test_training_sources_and_code_dir_follow_the_same_rule(awkward_tree):
    tree, expected = awkward_tree
    kept = sorted(path for path, outcome in expected.items() if outcome == "kept")
    spec = SourceSpec(kind="files", paths=(f"{tree}/**/*.txt",))
    assert [document.doc_id for document in load_documents(spec)] == kept
    scan = scan_documents(spec)
    assert scan.files_read == 4
    assert {entry.path: entry.reason for entry in scan.skipped} == {
        path: outcome for path, outcome in expected.items() if outcome != "kept"
    }
    # code_dir: the same walk (it used not to enter symlinked folders, and crashed on a dangling link).
    code = scan_source(ReaderSpec(kind="code_dir", paths=(str(tree),), extensions=(".txt",)))
    assert [document.doc_id for document in code.documents] == kept
    assert {entry.path: entry.reason for entry in code.skipped} == {
        path: outcome for path, outcome in expected.items() if outcome != "kept"
    }
    # Nothing readable at all: the error says what was skipped.
    with pytest.raises(DataSourceError, match=r"no non-empty documents \(skipped: binary 1, empty 1\)"):
        load_documents(SourceSpec(kind="files", paths=(f"{tree}/nul.txt", f"{tree}/empty.txt")))


def test_parquet_and_code_dir_readers(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    parquet.write_table(pa.table({"body": ["first text", None, "", "third text"]}), tmp_path / "t.parquet")
    documents = read_source(ReaderSpec(kind="parquet", paths=(str(tmp_path / "*.parquet"),), field="body"))
    assert [(d.doc_id.rsplit("/", 1)[1], d.text) for d in documents] == [
        ("t.parquet:1", "first text"),
        ("t.parquet:4", "third text"),
    ]
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / ".venv").mkdir()
    for name in ("pkg/a.py", "pkg/sub/b.c", "pkg/sub/c.txt", "pkg/.venv/d.py"):
        (tmp_path / name).write_text(f"// {name}\n")
    documents = read_source(
        ReaderSpec(kind="code_dir", paths=(str(tmp_path / "pkg"),), extensions=(".py", ".c"))
    )
    assert [d.doc_id.rsplit("/pkg/", 1)[1] for d in documents] == ["a.py", "sub/b.c"]


# The file's last test: it starts JAX's runtime in this worker (later pools there would need a forkserver).
def _byte_tokenizer():
    """256 byte tokens, no merges: fits the tiny model's vocabulary; ASCII text is one token a byte."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def test_difficulty_stage_stores_the_reference_models_bits_per_byte(corpus, tmp_path, tiny_config):
    """A one-layer random model (a dense layer, no MTP head: the least to trace and compile) as the
    reference, eight planted documents (one forward batch): every record gets its bits per byte,
    equal to the model's loss on the document computed directly, and a schedule's difficulty
    reader sees the same scores."""
    from reference import random_params

    import glm5_jax
    from glm5_jax.data.schedule import document_difficulties
    from glm5_jax.train.runs import checkpoint_options

    config = tiny_config.replace(
        num_layers=1, num_dense_layers=1, indexer_types=["full"], attention_types=["dsa"], num_mtp_layers=0
    )
    params = random_params(config, 3)
    checkpoint = tmp_path / "reference"
    glm5_jax.save_pretrained(config, params, checkpoint)
    tokenizer = _byte_tokenizer()
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    max_bytes, max_length = 60, 64  # every kept document is longer: one [8, 64] program
    difficulty = dict(checkpoint=str(checkpoint), max_bytes=max_bytes, max_length=max_length, batch_size=8)
    root = corpus["root"]
    sources = [
        dict(kind="files", paths=[f"{root}/text/good_0[0-5].txt"], name="text"),
        dict(kind="files", paths=[f"{root}/code/good_0[01].py"], name="code"),
    ]
    missing = {**difficulty, "checkpoint": str(tmp_path / "missing")}
    with LocalExecutor(workers=1, progress=False) as executor:
        with pytest.raises(FileNotFoundError, match="neither"):  # before any work
            prepare(_config(corpus, sources=sources, difficulty=missing), tmp_path / "bad", executor=executor)
        settings = _config(corpus, sources=sources, difficulty=difficulty)
        stats = prepare(settings, tmp_path / "out", executor=executor)

    records = list(read_prepared(tmp_path / "out"))
    assert len(records) == 8 and {record["domain"] for record in records} == {"prose", "code"}
    scores = np.array([record["difficulty"] for record in records])
    assert np.isfinite(scores).all() and (scores > 0).all() and len(set(scores.tolist())) == len(scores)
    summary = stats["difficulty"]
    assert summary["unit"] == "bits per byte" and summary["documents"] == len(records)
    assert summary["bytes"] == summary["tokens"] == max_bytes * len(records)
    assert summary["mean"] == pytest.approx(scores.mean())
    assert summary["p50"] == pytest.approx(np.median(scores))
    assert sum(entry["documents"] for entry in summary["domains"].values()) == len(records)
    decisions = [json.loads(line) for line in (tmp_path / "out" / "decisions.jsonl").read_text().splitlines()]
    assert [row["difficulty"] for row in decisions if row["kept"]] == scores.tolist()
    assert "difficulty" in stats["timing"]["wall_seconds"]

    # The loss on one document's first max_bytes bytes: its logits in the backend's [8, 64] shape
    # (the same compiled program), the cross-entropy by hand in float64.
    record = records[len(records) // 2]
    text = record["text"][:max_bytes]
    assert text.isascii() and len(record["text"]) > max_bytes
    ids = [config.bos_token_id, *tokenizer.encode(text, add_special_tokens=False).ids]  # [max_bytes + 1]
    inputs = np.full((8, max_length), config.pad_token_id, np.int32)  # [B, T]
    inputs[0, :max_bytes] = ids[:-1]
    logits = glm5_jax.forward(config, params, inputs, options=checkpoint_options(checkpoint))  # [B, T, V]
    logits = np.asarray(logits, np.float64)[0, :max_bytes]  # [T, V]
    log_normalizer = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    mean_loss = float((log_normalizer - logits[np.arange(max_bytes), ids[1:]]).mean())  # nats per byte
    assert record["difficulty"] == pytest.approx(mean_loss / np.log(2), rel=1e-5)

    # data.schedule's difficulty_weight reads the same scores.
    spec = source_spec_from_dict({"kind": "prepared", "name": "scored", "paths": [str(tmp_path / "out")]})
    documents = load_documents(spec)
    by_id = {record["id"]: record["difficulty"] for record in records}
    assert document_difficulties(spec, documents).tolist() == [by_id[d.doc_id] for d in documents]
