"""Attention backends: how a layer's queries meet their keys, by source of keys.

A decoder layer (model/decoder.py) projects its queries and per-token keys the same way in
training and serving (model/mla.py); what differs is where the keys come from, a *key source*:

  SequenceKeys (sequence.py)  the sequence itself: training and `forward`, [B, T] rows, packed
                              documents, context parallelism;
  PagedKeys (pages.py)        the page pool of the serving step: the new tokens' keys are written
                              to their pages first, then each row reads its own pages.

An attention *backend* computes the attention for a source: `over_sequence` and `over_pages`
(the `AttentionBackend` protocol below). Built in: "reference" (plain jnp, reference.py) and
"pallas" (kernels_pallas through model/kernel_calls.py, pallas.py). ExecutionOptions picks one per
source: `attention_impl` for sequences, `decode_attention_impl` for pages. A new backend or
attention variant is one module with a class of those two methods plus one `register_backend`
call: tests/toy_attention.py is one, registered in tests/model/test_paged_decode.py and run
through `forward` and the serving step.

This module imports nothing heavy: options.py validates names against the registry.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

# name -> a backend object, or "module:attribute" resolved on first use (no import cycle with
# the model modules the backends build on).
_BACKENDS: dict[str, Any] = {
    "reference": "glm5_jax.model.attention.reference:ReferenceAttention",
    "pallas": "glm5_jax.model.attention.pallas:PallasAttention",
}


class AttentionBackend(Protocol):
    """The attention of one layer over one source of keys. Both methods take the layer's
    `AttentionSpec`, its attention weights (checkpoint names, model/mla.py `attention_weights`),
    the normalised input x, the `Projected` queries and per-token keys, the source, the layer's
    `LayerKinds` and the previous DSA layer's selection (IndexShare), and return
    (per-head outputs [.., N, Hv] before o_proj, this layer's selection, the selection's boundary
    gap [B, T] or None, {name: diagnostic to sow})."""

    def over_sequence(self, spec, weights, x, projected, keys, kinds, previous): ...

    def over_pages(self, spec, weights, x, projected, keys, kinds, previous): ...


def register_backend(name: str, backend: AttentionBackend | str) -> None:
    """Makes `backend` (an object, or "module:attribute") selectable as `name` in
    ExecutionOptions.attention_impl / decode_attention_impl."""
    _BACKENDS[name] = backend


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    """The backend registered as `name` (KeyError naming the known ones otherwise)."""
    if name not in _BACKENDS:
        raise KeyError(f"no attention backend {name!r} (registered: {', '.join(_BACKENDS)})")
    backend = _BACKENDS[name]
    if isinstance(backend, str):
        module, _, attribute = backend.partition(":")
        backend = _BACKENDS[name] = getattr(importlib.import_module(module), attribute)()
    return backend
