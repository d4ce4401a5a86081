"""Command line: train a byte-level BPE tokenizer on the data sources and save it as tokenizer.json.

    python -m glm5_jax.data.train_tokenizer --output tokenizer.json --vocab-size 4096 \
        [--source-glob GLOB ...] [--jsonl PATH ... --field text]

Without --source-glob / --jsonl it trains on the local Python standard library (source python_stdlib).
Prints the vocab size, the training time and the compression (UTF-8 bytes per token) on documents
held out of the training sample. Uses the same recipe as load_or_train_tokenizer.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from glm5_jax.data.sources import SourceSpec, sample_documents
from glm5_jax.data.tokenizer import TRAINING_SAMPLE_BYTES, pooled_documents, train_bpe_tokenizer

HELD_OUT_BYTES = 1_000_000


def _parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="path of the tokenizer.json to write")
    parser.add_argument("--vocab-size", type=int, default=4096, help="target vocabulary size (default 4096)")
    parser.add_argument("--source-glob", action="append", default=[], metavar="GLOB",
                        help="plain-text files to train on (repeatable; ** recurses)")
    parser.add_argument("--jsonl", action="append", default=[], metavar="PATH",
                        help="JSON-lines file or glob to train on (repeatable)")
    parser.add_argument("--field", default="text", help="JSON field holding the text (default 'text')")
    parser.add_argument("--sample-bytes", type=int, default=TRAINING_SAMPLE_BYTES,
                        help=f"train on a deterministic sample of about this many bytes "
                             f"(default {TRAINING_SAMPLE_BYTES})")
    return parser.parse_args(argv)


def sources_from_arguments(arguments: argparse.Namespace) -> list[SourceSpec]:
    """SourceSpecs named on the command line; the python_stdlib source when none is."""
    sources = [SourceSpec(kind="files", paths=tuple(arguments.source_glob))] if arguments.source_glob else []
    if arguments.jsonl:
        sources.append(SourceSpec(kind="jsonl", paths=tuple(arguments.jsonl), field=arguments.field))
    return sources or [SourceSpec(kind="python_stdlib")]


def main(argv: Sequence[str] | None = None) -> None:
    """Trains, saves, and reports vocab size, time and held-out bytes per token."""
    arguments = _parse_arguments(argv)
    pool = pooled_documents(sources_from_arguments(arguments))
    sample = sample_documents(pool, arguments.sample_bytes)
    start = time.perf_counter()
    tokenizer = train_bpe_tokenizer([document.text for document in sample], arguments.vocab_size)
    seconds = time.perf_counter() - start
    tokenizer.save(arguments.output)

    sampled = {document.doc_id for document in sample}
    rest = [document for document in pool if document.doc_id not in sampled]
    held_out = sample_documents(rest, HELD_OUT_BYTES, seed=1)
    label = "held-out"
    if not held_out:  # every document went into training; report training compression instead
        held_out, label = sample[:100], "training (nothing held out)"
    encoded = tokenizer.encode_batch_fast([document.text for document in held_out])
    num_tokens = sum(len(encoding.ids) for encoding in encoded)
    num_bytes = sum(len(document.text.encode("utf-8")) for document in held_out)
    print(f"wrote {arguments.output}")
    print(f"vocab size: {tokenizer.get_vocab_size()}")
    print(f"trained on {len(sample)} documents ({sum(len(d.text.encode()) for d in sample) / 1e6:.1f} MB) "
          f"in {seconds:.2f} s")
    print(f"compression on {label} text ({num_bytes / 1e6:.2f} MB): {num_bytes / max(num_tokens, 1):.2f} "
          f"bytes per token")


if __name__ == "__main__":
    main()
