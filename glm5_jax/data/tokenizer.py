"""Tokenizers: load a `tokenizer.json`, or train (and cache) a byte-level BPE on the configured sources.

Training uses Hugging Face `tokenizers` (ByteLevel pre-tokenizer and decoder, BpeTrainer seeded with the
256-symbol byte alphabet), so every byte string is encodable and decoding is lossless. The only special
token is `<|endoftext|>`, appended after every document as separator / EOS. To stay quick on small CPUs
the trainer sees a deterministic sample of at most `TRAINING_SAMPLE_BYTES` of text.

Also here: `token_byte_lengths` (UTF-8 bytes per token id, for bits-per-byte) and `check_vocab_fits`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from glm5_jax.data.sources import Document, SourceSpec, load_documents, sample_documents, source_fingerprint

logger = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT,)
# ~1.5 s of BPE training at vocab 4096 on 2 cores, and compression within 1% of training on 8 MB.
TRAINING_SAMPLE_BYTES = 4_000_000
# Bump when the training recipe changes so stale cached tokenizers are not reused.
TOKENIZER_RECIPE_VERSION = 1


class VocabularyTooLargeError(ValueError):
    """The tokenizer has more ids than the model's embedding table."""


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Loads a Hugging Face `tokenizer.json`.

    Args:
        path: file path.
    Returns:
        the tokenizers.Tokenizer.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
    return Tokenizer.from_file(str(path))


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE tokenizer.

    Args:
        texts: training texts.
        vocab_size: target number of ids including the special tokens (>= 257); a small corpus may
            yield fewer because BPE runs out of pairs to merge.
    Returns:
        the trained tokenizers.Tokenizer, `<|endoftext|>` at id 0.
    """
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} is below the byte alphabet + special tokens ({minimum})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even unseen ones
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def pooled_documents(sources: Sequence[SourceSpec]) -> list[Document]:
    """All documents of all sources; ids prefixed with the source index so equal paths stay distinct."""
    pool: list[Document] = []
    for index, spec in enumerate(sources):
        pool.extend(Document(f"{index}/{doc.doc_id}", doc.text) for doc in load_documents(spec))
    return pool


def tokenizer_training_texts(
    sources: Sequence[SourceSpec], max_bytes: int = TRAINING_SAMPLE_BYTES
) -> list[str]:
    """The deterministic text sample a tokenizer is trained on: about max_bytes pooled from all sources.

    Args:
        sources: the sources.
        max_bytes: sample budget in UTF-8 bytes.
    Returns:
        list of document texts.
    """
    return [document.text for document in sample_documents(pooled_documents(sources), max_bytes)]


def tokenizer_cache_path(
    sources: Sequence[SourceSpec], vocab_size: int, cache_dir: str | os.PathLike
) -> Path:
    """Where the tokenizer trained for these sources and vocab size is cached.

    The key covers the recipe version, vocab size, sample budget and what each source reads (files and
    sizes, ids independent of the install location); weights and names do not change the tokenizer.
    """
    key = {
        "version": TOKENIZER_RECIPE_VERSION,
        "vocab_size": vocab_size,
        "sample_bytes": TRAINING_SAMPLE_BYTES,
        "sources": [source_fingerprint(spec) for spec in sources],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"tokenizer-{digest}.json"


def load_or_train_tokenizer(
    tokenizer_path: str | None, sources: Sequence[SourceSpec], vocab_size: int, cache_dir: str
) -> Tokenizer:
    """Loads `tokenizer_path` if given; otherwise trains a byte-level BPE on the sources, cached on disk.

    Training is deterministic, so hosts training concurrently produce the same tokenizer; the cache
    file is written atomically (temporary file + os.replace).

    Args:
        tokenizer_path: a tokenizer.json, or None to train.
        sources: the training sources (used only when training).
        vocab_size: target vocab size (used only when training).
        cache_dir: folder holding `tokenizer-<hash>.json`.
    Returns:
        the tokenizers.Tokenizer.
    """
    if tokenizer_path:
        return load_tokenizer(tokenizer_path)
    cache_path = tokenizer_cache_path(sources, vocab_size, cache_dir)
    if cache_path.is_file():
        logger.info("loading cached tokenizer %s", cache_path)
        return load_tokenizer(cache_path)
    start = time.perf_counter()
    tokenizer = train_bpe_tokenizer(tokenizer_training_texts(sources), vocab_size)
    logger.info(
        "trained tokenizer (vocab %d) in %.1f s; caching at %s",
        tokenizer.get_vocab_size(), time.perf_counter() - start, cache_path,
    )
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=cache_path.parent, prefix=".tokenizer-", suffix=".tmp")
    os.close(handle)
    try:
        tokenizer.save(temporary)
        os.replace(temporary, cache_path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return tokenizer


def end_of_text_id(tokenizer: Tokenizer) -> int:
    """The id of `<|endoftext|>`, the document separator / EOS appended after every document."""
    token_id = tokenizer.token_to_id(END_OF_TEXT)
    if token_id is None:
        raise ValueError(f"tokenizer has no {END_OF_TEXT!r} token to separate documents")
    return token_id


def check_vocab_fits(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raises VocabularyTooLargeError if some token id would fall outside the model's embedding table.

    Args:
        tokenizer: the tokenizer.
        model_vocab_size: rows of the model's embedding / output layer.
    """
    tokenizer_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if tokenizer_size > model_vocab_size:
        raise VocabularyTooLargeError(
            f"tokenizer vocabulary ({tokenizer_size} ids) is larger than the model vocab_size "
            f"({model_vocab_size}); raise model vocab_size or use a smaller tokenizer"
        )


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the character ByteLevel uses for each byte -> byte value.

    Printable bytes map to themselves; the rest are shifted to code points 256+ in byte order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)
    ]
    table = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer decodes with ByteLevel, i.e. its vocabulary is written in the byte alphabet."""
    decoder = json.loads(tokenizer.to_str()).get("decoder")
    return '"ByteLevel"' in json.dumps(decoder)


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 byte count each token id stands for, to turn a loss in nats/token into bits per byte.

    Byte-level vocabulary tokens are mapped back through the ByteLevel alphabet (exact); special tokens
    count 0; added non-special tokens (matched in raw text) count their UTF-8 length. For tokenizers
    that are not byte-level the count is the UTF-8 length of the id decoded alone (approximate).

    Args:
        tokenizer: the tokenizer.
    Returns:
        int32 array [vocab] (vocab = get_vocab_size(with_added_tokens=True)).
    """
    alphabet = _byte_level_alphabet()
    byte_level = _is_byte_level(tokenizer)
    added = tokenizer.get_added_tokens_decoder()
    lengths = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int32)
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        if index in added:
            lengths[index] = 0 if added[index].special else len(token.encode("utf-8"))
        elif byte_level and all(character in alphabet for character in token):
            lengths[index] = len(token)  # one alphabet character per byte
        else:
            lengths[index] = len(tokenizer.decode([index], skip_special_tokens=False).encode("utf-8"))
    return lengths
