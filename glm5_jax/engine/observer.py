"""Engine lifecycle hooks: the engine calls these; subclasses record metrics.

Every method is a no-op here so the engine can always call them; the HTTP layer subclasses
EngineObserver (Prometheus metrics in glm5_jax/api/metrics.py). Methods are called from the
engine's scheduler thread, so they must be quick and must not raise.
"""

from __future__ import annotations


class EngineObserver:
    """No-op base class of the engine's metric hooks (times in seconds)."""

    def on_queued(self, request_id: str, prompt_tokens: int) -> None:
        """A request entered the waiting queue."""

    def on_admitted(self, request_id: str, queue_seconds: float, cached_tokens: int) -> None:
        """A request got a slot; cached_tokens of its prompt came from the prefix cache."""

    def on_first_token(self, request_id: str, ttft_seconds: float) -> None:
        """The first output token was produced (time since submit)."""

    def on_finished(self, request_id: str, finish_reason: str, prompt_tokens: int, cached_tokens: int,
                    output_tokens: int, e2e_seconds: float) -> None:
        """The request ended ("stop", "length" or "abort")."""

    def on_preempted(self, request_id: str) -> None:
        """The request lost its pages and was requeued for recompute."""

    def on_prefix_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        """A prompt was looked up in the prefix cache; hit_tokens were found (device or host)."""

    def on_step(self, pages_used: int, pages_total: int, host_pages_used: int, running: int, waiting: int,
                compile_count: int) -> None:
        """One engine step ran; a snapshot of cache occupancy and queue sizes."""

    def on_speculation(self, rounds: int, drafted: int, accepted: int) -> None:
        """A speculative decode call finished: verify rounds (rows x rounds), drafts verified and
        drafts accepted in it (mean acceptance length = (accepted + rounds) / rounds)."""
