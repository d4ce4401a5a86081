"""Tests for glm5_jax.data.structured_pairs: function <-> docstring and section -> summary pairs,
their chat and text renderings (readable by the chat_jsonl and jsonl sources), and the CLI."""

import json
import textwrap

from glm5_jax.data import structured_pairs as sp
from glm5_jax.data.chat import parse_conversation
from glm5_jax.data.sources import SourceSpec, load_documents

CODE = textwrap.dedent('''\
    """Module summary line.

    The module body says a good deal more about what the module is for, so that it has well over
    twenty words and becomes a section to summary pair.
    """


    @decorator
    def scale(value, factor=2):
        """Multiply a value by a factor.

        Both arguments are numbers; the result is their product, which callers use to rescale
        measurements before they are written to the report at the end of a run.
        """
        return value * factor


    def only_docstring():
        """Nothing else here, so there is nothing to explain."""


    def _private(x):
        """Private helpers are skipped."""
        return x


    class Box:
        def area(self, width, height):
            """Area of the box."""
            result = width * height
            return result
    ''')

DOCS = textwrap.dedent("""\
    =====
    Guide
    =====

    Installing the tool
    -------------------

    Run the installer from the project's folder, then check that the command answers with its
    version; a missing compiler shows up here first, with a message that names the package.

    Examples
    --------

    These are examples that are skipped although they have more than twenty words in their body,
    because a generic title like this one says nothing about the section.

    ## Tuning the cache size

    The cache keeps recent answers in memory; raise its size when the hit rate stays low, and lower
    it when the process runs short of memory on small machines.
    """)


def test_code_pairs():
    pairs = list(sp.code_pairs("m.py", CODE))
    by_kind = {kind: [pair for pair in pairs if pair.kind == kind] for kind in sp.KINDS}
    assert [pair.answer for pair in by_kind["function_docstring"]] == [
        "Multiply a value by a factor.\n\nBoth arguments are numbers; the result is their product, "
        "which callers use to rescale\nmeasurements before they are written to the report at the end "
        "of a run.",
        "Area of the box.",
    ]
    scale = by_kind["function_docstring"][0]
    assert scale.prompt == "@decorator\ndef scale(value, factor=2):\n    return value * factor"
    assert scale.source_id == "m.py:9"
    area = by_kind["docstring_function"][1]
    assert area.prompt == 'def area(self, width, height):\n    """Area of the box."""'  # dedented method
    assert area.answer == "def area(self, width, height):\n    result = width * height\n    return result"
    summaries = {pair.answer for pair in by_kind["section_summary"]}
    assert summaries == {"Module summary line.", "Multiply a value by a factor."}
    assert not [pair for pair in pairs if "only_docstring" in pair.prompt or "_private" in pair.prompt]


def test_doc_pairs():
    pairs = list(sp.doc_pairs("guide.rst", DOCS))
    assert [(pair.answer, pair.source_id) for pair in pairs] == [
        ("Installing the tool", "guide.rst:5"),
        ("Tuning the cache size", "guide.rst:17"),
    ]
    assert pairs[0].prompt.startswith("Run the installer") and pairs[0].prompt.endswith("names the package.")


def test_renderings_load_as_training_sources(tmp_path):
    pairs = sp.document_pairs([sp.Document("m.py", CODE), sp.Document("guide.md", DOCS)])
    assert sp.write_pairs(tmp_path / "chat.jsonl", pairs, "chat") == len(pairs)
    for index, line in enumerate((tmp_path / "chat.jsonl").read_text().splitlines()):
        messages, _ = parse_conversation(line, f"chat.jsonl:{index}")
        assert [message["role"] for message in messages] == ["user", "assistant"]
    sp.write_pairs(tmp_path / "text.jsonl", pairs, "text")
    documents = load_documents(SourceSpec(kind="jsonl", paths=(str(tmp_path / "text.jsonl"),)))
    assert len(documents) == len(pairs)
    assert documents[0].text.endswith(pairs[0].answer)
    assert load_documents(SourceSpec(kind="chat_jsonl", paths=(str(tmp_path / "chat.jsonl"),)))


def test_cli_is_deterministic_and_samples(tmp_path):
    (tmp_path / "m.py").write_text(CODE)
    (tmp_path / "guide.rst").write_text(DOCS)
    arguments = ["--code", str(tmp_path / "*.py"), "--docs", str(tmp_path / "*.rst"), "--format", "text"]
    sp.main(arguments + ["--output", str(tmp_path / "a.jsonl")])
    sp.main(arguments + ["--output", str(tmp_path / "b.jsonl")])
    first = (tmp_path / "a.jsonl").read_text()
    assert first == (tmp_path / "b.jsonl").read_text() and len(first.splitlines()) == 8
    sp.main(
        arguments + ["--output", str(tmp_path / "c.jsonl"), "--max-pairs", "3", "--kinds", "section_summary"]
    )
    sampled = [json.loads(line)["text"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert len(sampled) == 3 and all(text.startswith("Summarise") for text in sampled)
