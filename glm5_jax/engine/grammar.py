"""Constrained decoding: a request's `Constraint` (JSON object, JSON schema, regex) becomes a
token bitmask per step, with llguidance as the grammar engine.

Why llguidance (bench/structured.py, a JSON schema of 3 fields, the real GLM tokenizer of
154,856 tokens): computing the mask and advancing cost 0.13 ms per token (xgrammar: 0.06 ms),
both far under 1% of a decode step; llguidance installs with no dependencies and fills numpy
bitmasks, while xgrammar pulls in torch, transformers and triton. The mask is `[ceil(V / 32)]`
int32 (bit v % 32 of word v // 32 allows token v), applied to the logits on the device
(`apply_allowed_bits`).

A `Constraint` with `after` (e.g. "</think>") starts once that text has been generated: the
thinking block stays free, the answer is constrained.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

from glm5_jax.engine.types import Constraint, InvalidRequestError

ALL_ALLOWED = -1  # an int32 word with every bit set
# JSON as `json.dumps(..., separators=(",", ":"))` writes it: no token is spent on whitespace.
COMPACT = {"whitespace_flexible": False}


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def apply_allowed_bits(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits [R, V] with the tokens whose bit is clear in allowed [R, ceil(V/32)] int32 set to
    -inf (rows of all-set words are unchanged)."""
    vocab = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    words = jnp.take(allowed, vocab // 32, axis=1)  # [R, V]
    keep = (jax.lax.shift_right_logical(words, jnp.broadcast_to(vocab % 32, words.shape)) & 1) != 0
    return jnp.where(keep, logits, -jnp.inf)


@functools.cache
def _byte_of_symbol() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) printable stand-in for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable},
            **{chr(256 + n): byte for n, byte in enumerate(others)}}


class _ByteLevelVocabulary:
    """The token bytes llguidance matches grammars against, for a byte-level BPE tokenizer.

    Built here rather than by llguidance from tokenizer.json because llguidance treats every added
    token as special (never text), while GLM's `<think>`, `<tool_call>`, `<arg_key>` ... are added
    tokens that are text (`special: false`): a regex for GLM's tool-call markup must be able to
    emit them. Special added tokens get llguidance's 0xFF marker; encoding is the tokenizer's own,
    so text a grammar forces is tokenized as the model saw it in training."""

    def __init__(self, spec: dict, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos: list[int]):
        byte_of = _byte_of_symbol()
        tokens = [b""] * vocab_size
        for symbols, index in spec["model"]["vocab"].items():
            if index < vocab_size:
                tokens[index] = bytes(byte_of[symbol] for symbol in symbols)
        self.special_token_ids = []
        for added in spec["added_tokens"]:
            if added["id"] < vocab_size:
                tokens[added["id"]] = (b"\xff" if added["special"] else b"") + added["content"].encode()
                if added["special"]:
                    self.special_token_ids.append(added["id"])
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, (eos[0] if eos else None), None
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


class GrammarCompiler:
    """Turns Constraints into matchers for one tokenizer and vocabulary (built once per engine)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids):
        import llguidance

        self._llguidance = llguidance
        eos = list(eos_token_ids)
        self.vocab_size = vocab_size
        try:
            spec = json.loads(tokenizer.to_str())
            source = (llguidance.TokenizerWrapper(_ByteLevelVocabulary(spec, tokenizer, vocab_size, eos))
                      if (spec.get("decoder") or {}).get("type") == "ByteLevel" else tokenizer.to_str())
            self.tokenizer = llguidance.LLTokenizer(source, n_vocab=vocab_size,
                                                    eos_token=eos[0] if eos else None)
        except ValueError as error:
            raise InvalidRequestError(f"constrained output is not available for this tokenizer: {error}") \
                from None

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one compiler per engine; requests repeat grammars
    def grammar(self, kind: str, spec: str) -> str:
        """The llguidance grammar of a constraint; InvalidRequestError naming the problem."""
        matcher = self._llguidance.LLMatcher
        try:
            if kind == "json_object":
                grammar = matcher.grammar_from_json_schema('{"type": "object"}', defaults=COMPACT)
            elif kind == "json_schema":
                grammar = matcher.grammar_from_json_schema(spec, defaults=COMPACT)
            elif kind == "regex":
                grammar = matcher.grammar_from_regex(spec)
            else:
                raise InvalidRequestError(f"unknown constraint kind {kind!r}")
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(f"the {kind} constraint is invalid: {error}") from None
        problem = matcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise InvalidRequestError(f"the {kind} constraint is invalid: {problem.strip()}")
        return grammar

    def start(self, constraint: Constraint, tokenizer: tokenizers.Tokenizer) -> ConstrainedOutput:
        return ConstrainedOutput(self, constraint, tokenizer)


class ConstrainedOutput:
    """One request's constraint state: inactive until `after` has been generated, then a
    matcher that every sampled token advances."""

    def __init__(self, compiler: GrammarCompiler, constraint: Constraint, tokenizer: tokenizers.Tokenizer):
        self._compiler = compiler
        self._grammar = compiler.grammar(constraint.kind, constraint.spec)
        self._after = constraint.after
        self._tokenizer = tokenizer
        self._free: list[int] = []  # tokens generated before the constraint started
        self.matcher = None if self._after else self._new_matcher()

    def _new_matcher(self):
        return self._compiler._llguidance.LLMatcher(self._compiler.tokenizer, self._grammar)

    @property
    def active(self) -> bool:
        return self.matcher is not None

    def fill(self, row: np.ndarray) -> None:
        """Writes the allowed-token bits of the next token into row [ceil(V/32)] int32."""
        if self.matcher is None or self.matcher.is_error():
            row[:] = ALL_ALLOWED
            return
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, row[None, :], 0)

    def advance(self, token: int) -> bool:
        """Takes a generated token; True once the constraint is complete (output must end)."""
        if self.matcher is None:
            self._free.append(token)
            if self._after in self._tokenizer.decode(self._free[-64:], skip_special_tokens=False):
                self.matcher = self._new_matcher()
            return False
        if not self.matcher.consume_token(token):
            return True  # cannot happen under the mask; end rather than emit unconstrained text
        return self.matcher.is_stopped()
