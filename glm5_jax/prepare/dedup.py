"""Level 1 duplicate removal: exact (content hash) and near duplicates (MinHash LSH, datasketch).

Per document (in the workers): `content_hash` of the normalised text, and `minhash_signature`: the
MinHash of its word n-gram shingles (lower-cased `\\w+` words, `ngram` per shingle). Shingles are
hashed to 32 bits in numpy (crc32 per word, a polynomial over each window of n words), which is
~50x faster than hashing each shingle string; datasketch applies the MinHash permutations.
Global (in the driver, over all documents in input order): the first document of each group is
kept and later ones are dropped. A near-duplicate is a later document whose estimated Jaccard
similarity with a kept document, among the LSH candidates, reaches `threshold`: the LSH bands only
propose candidates, and the estimate (the share of equal MinHash values) decides, which keeps
false positives away from pairs well below the threshold. Nothing is downloaded or trained.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Sequence

import numpy as np

from glm5_jax.prepare.config import DedupSettings
from glm5_jax.prepare.progress import Progress

_WORD = re.compile(r"\w+")
_SCHEME = "affine32"  # datasketch >= 2.0's default hashing scheme, named so stored signatures stay valid
_SHINGLE_CHUNK = 4096  # shingles per update: bounds the [shingles, num_perm] temporary
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant (golden ratio) for the window polynomial


def content_hash(text: str) -> str:
    """sha256 of the text (hex), the exact-duplicate key."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def shingles(text: str, ngram: int) -> list[bytes]:
    """The distinct word n-grams of a text, as UTF-8 bytes, sorted (a text shorter than n: one shingle)."""
    words = _WORD.findall(text.lower())
    n = max(1, min(ngram, len(words)))
    return sorted({" ".join(words[i : i + n]).encode("utf-8") for i in range(max(1, len(words) - n + 1))})


def shingle_hashes(text: str, ngram: int) -> np.ndarray:
    """32-bit hashes of the distinct word n-grams of `shingles` (equal shingles, equal hashes):
    uint32 [distinct shingles], sorted."""
    words = _WORD.findall(text.lower())
    n = max(1, min(ngram, len(words)))
    table = {word: zlib.crc32(word.encode("utf-8")) for word in set(words)}  # each distinct word once
    word_hashes = np.fromiter(map(table.__getitem__, words), np.uint64, len(words))
    windows = max(1, len(words) - n + 1)
    combined = np.zeros(windows, np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        for offset in range(n):
            combined = combined * _MULTIPLIER + word_hashes[offset : offset + windows] + np.uint64(offset + 1)
        for shift, factor in ((33, 0xFF51AFD7ED558CCD), (33, 0xC4CEB9FE1A85EC53)):  # murmur3's fmix64:
            combined = (combined ^ (combined >> np.uint64(shift))) * np.uint64(factor)  # every input bit
        combined ^= combined >> np.uint64(33)  # reaches the top 32 bits kept below
    return np.unique((combined >> np.uint64(32)).astype(np.uint32))


def minhash_signature(text: str, settings: DedupSettings) -> np.ndarray:
    """The document's MinHash signature: uint32 [num_perm]."""
    from datasketch import MinHash

    minhash = MinHash(num_perm=settings.num_perm, seed=settings.seed, scheme=_SCHEME, hashfunc=int)
    values = shingle_hashes(text, settings.ngram)
    for start in range(0, len(values), _SHINGLE_CHUNK):
        minhash.update_batch(values[start : start + _SHINGLE_CHUNK])
    return np.asarray(minhash.hashvalues, dtype=np.uint32)


def exact_duplicates(hashes: Sequence[str]) -> list[int | None]:
    """For each document, the index of the earlier document with the same hash, or None (kept)."""
    first: dict[str, int] = {}
    result = []
    for index, key in enumerate(hashes):
        result.append(first.get(key))
        first.setdefault(key, index)
    return result


def near_duplicates(
    signatures: Sequence[np.ndarray], settings: DedupSettings, progress: bool = False
) -> list[int | None]:
    """For each document, the kept document it nearly duplicates (the lowest such index), or None.

    Args:
        signatures: uint32 [num_perm] per document, in input order.
        settings: threshold (on the estimated Jaccard similarity), num_perm and seed.
        progress: report the documents done on stderr (glm5_jax/prepare/progress.py).
    Returns:
        list as long as signatures.
    """
    from datasketch import LeanMinHash, MinHashLSH

    lsh = MinHashLSH(threshold=settings.threshold, num_perm=settings.num_perm)
    kept: dict[int, np.ndarray] = {}
    result: list[int | None] = []
    with Progress("near dedup (LSH)", len(signatures), "docs", progress) as bar:
        for index, signature in enumerate(signatures):
            minhash = LeanMinHash(seed=settings.seed, hashvalues=signature, scheme=_SCHEME)
            candidates = sorted(int(key) for key in lsh.query(minhash))
            match = next(
                (other for other in candidates if np.mean(kept[other] == signature) >= settings.threshold),
                None,
            )
            if match is None:
                lsh.insert(str(index), minhash)
                kept[index] = signature
            result.append(match)
            bar.update()
    return result
