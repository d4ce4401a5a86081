"""Prometheus metrics of the server: the engine's observer hooks plus what the HTTP layer sees.

Every ServerMetrics owns its own CollectorRegistry (never prometheus_client's global one), so a
process can hold several apps (the tests do). The names, their meaning and example PromQL are in
docs/serving.md. Rates (QPS, tokens/s) are not computed here: Prometheus derives them from the
counters with rate(), e.g. `sum(rate(glm5_requests_total[1m]))` is the QPS.

Engine hooks run on the engine's scheduler thread and HTTP hooks on the event loop; the
prometheus_client metrics are thread-safe and the one dict kept here has its own lock.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from glm5_jax.engine.observer import EngineObserver

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Bucket edges in seconds: CPU tests sit at the top, accelerators at the bottom.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics(EngineObserver):
    """All metrics of one server; pass it to the Engine as `observer` and to create_app as `metrics`."""

    def __init__(self, prefix: str = "glm5"):
        self.registry = registry = CollectorRegistry(auto_describe=True)

        def counter(name, doc, labels=()):
            return Counter(f"{prefix}_{name}", doc, labels, registry=registry)

        def gauge(name, doc):
            return Gauge(f"{prefix}_{name}", doc, registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(f"{prefix}_{name}", doc, buckets=buckets, registry=registry)

        # HTTP layer
        self.requests = counter("requests", "HTTP requests by endpoint and status code (QPS: rate())",
                                ("endpoint", "status"))
        self.finished = counter("finished_requests", "Generation requests by the finish_reason the "
                                "client received (length = output budget exhausted)", ("finish_reason",))
        self.rejected = counter("prompts_rejected", "Prompts refused before generation", ("reason",))
        self.truncated = counter("prompts_truncated", "Prompts cut to their last truncate_prompt_tokens "
                                 "tokens")
        self.rate_limited = counter("rate_limited_requests", "Requests answered 429, by the limit hit and "
                                    "the API key's name", ("limit", "key_name"))
        # engine: latencies
        self.ttft = histogram("time_to_first_token_seconds", "Submit to first output token",
                              LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Submit to the request's end", E2E_BUCKETS)
        self.queue_time = histogram("queue_time_seconds", "Submit to first admission",
                                    LATENCY_BUCKETS)
        # engine: tokens and the prefix cache
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.cached_tokens = counter("cached_prompt_tokens", "Prompt tokens of finished requests that came "
                                     "from the prefix cache")
        self.output_tokens = counter("output_tokens", "Output tokens of finished requests")
        self.lookup_tokens = counter("prefix_cache_lookup_tokens", "Prompt tokens looked up in the prefix "
                                     "cache")
        self.hit_tokens = counter("prefix_cache_hit_tokens", "Looked-up tokens found in the prefix cache "
                                  "(device or host)")
        self.hit_rate = gauge("prefix_cache_hit_rate", "hit tokens / looked-up tokens since the start")
        self.preemptions = counter("preemptions", "Requests that lost their cache pages and were requeued")
        # engine: speculative decoding (vLLM's spec_decode_num_* counters)
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verify rounds (one per row "
                                   "and round)")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted "
                                            "(acceptance rate = accepted / draft tokens; mean acceptance "
                                            "length = 1 + accepted / drafts)")
        # engine: occupancy
        self.pages_used = gauge("cache_pages_used", "Device cache pages in use")
        self.pages_total = gauge("cache_pages_total", "Device cache pages in all")
        self.host_pages_used = gauge("host_cache_pages_used", "Host (offloaded) cache pages in use")
        self.running = gauge("running_requests", "Requests holding a batch slot")
        self.waiting = gauge("waiting_requests", "Requests waiting for admission")
        self.compile_count = gauge("compile_count", "XLA compilations since the engine started (flat in "
                                   "steady state)")
        self._lock = threading.Lock()
        self._ttft: dict[str, float] = {}  # request id -> TTFT, until the request finishes
        self._looked_up = self._hit = 0

    # ---------------------------------------------------------------- engine hooks
    def on_admitted(self, request_id: str, queue_seconds: float, cached_tokens: int) -> None:
        self.queue_time.observe(queue_seconds)

    def on_first_token(self, request_id: str, ttft_seconds: float) -> None:
        self.ttft.observe(ttft_seconds)
        with self._lock:
            self._ttft[request_id] = ttft_seconds

    def on_finished(self, request_id: str, finish_reason: str, prompt_tokens: int, cached_tokens: int,
                    output_tokens: int, e2e_seconds: float) -> None:
        with self._lock:
            ttft = self._ttft.pop(request_id, None)
        self.e2e.observe(e2e_seconds)
        if ttft is not None and output_tokens > 1:
            self.tpot.observe(max(0.0, e2e_seconds - ttft) / (output_tokens - 1))
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.output_tokens.inc(output_tokens)

    def on_preempted(self, request_id: str) -> None:
        self.preemptions.inc()

    def on_speculation(self, rounds: int, drafted: int, accepted: int) -> None:
        self.spec_drafts.inc(rounds)
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted_tokens.inc(accepted)

    def on_prefix_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.lookup_tokens.inc(prompt_tokens)
        self.hit_tokens.inc(hit_tokens)
        with self._lock:
            self._looked_up += prompt_tokens
            self._hit += hit_tokens
            rate = self._hit / self._looked_up if self._looked_up else 0.0
        self.hit_rate.set(rate)

    def on_step(self, pages_used: int, pages_total: int, host_pages_used: int, running: int, waiting: int,
                compile_count: int) -> None:
        self.pages_used.set(pages_used)
        self.pages_total.set(pages_total)
        self.host_pages_used.set(host_pages_used)
        self.running.set(running)
        self.waiting.set(waiting)
        self.compile_count.set(compile_count)

    # ---------------------------------------------------------------- reading
    def in_flight(self) -> int:
        """Requests with a first token and no end yet (bounded by what is running; a leak shows here)."""
        with self._lock:
            return len(self._ttft)

    def prefix_cache_tokens(self) -> tuple[int, int]:
        """(hit tokens, looked-up tokens) since the start."""
        with self._lock:
            return self._hit, self._looked_up

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting responses by endpoint (one of `endpoints`, else "other") and status:
    `app.add_middleware(RequestCounter, metrics=..., endpoints=...)`. Plain ASGI rather than
    BaseHTTPMiddleware, which would get between the endpoints and the client's disconnect message.
    An exception that escapes the app (answered by the outermost error handler) counts as 500."""

    def __init__(self, app, metrics: ServerMetrics, endpoints: tuple[str, ...]):
        self.app, self.metrics, self.endpoints = app, metrics, frozenset(endpoints)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        status = []

        async def send_recording(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_recording)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0] if status else 500)).inc()
