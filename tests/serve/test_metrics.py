"""Prometheus metrics and cached-token usage through the HTTP API with the fake engine (its toy prefix
cache and observer calls stand in for the real engine's; tests/engine/test_soak.py reads the real engine's).
/metrics is parsed with prometheus_client's own parser."""

from __future__ import annotations

import httpx
import openai
import pytest
from fake_engine import FakeEngine, make_tokenizer, running
from prometheus_client.parser import text_string_to_metric_families

from glm5_jax.api.app import create_app
from glm5_jax.api.metrics import ServerMetrics
from glm5_jax.api.server_config import parse_server_config

# One xdist worker runs this module, so its fixtures (a served fake engine) are built once.
pytestmark = pytest.mark.xdist_group("metrics")

TOKENIZER = make_tokenizer()
MODEL = "glm5-test"
SHARED = "The quick brown fox jumps over the lazy dog. "  # 11 tokens: two whole 4-token pages


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text as {(sample name, sorted label items): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def served():
    metrics = ServerMetrics()
    engine = FakeEngine(TOKENIZER, max_context=64, observer=metrics)
    config = parse_server_config({"api_keys": [{"name": "limited", "key": "sk-1", "requests_per_minute": 8},
                                               {"name": "open", "key": "sk-2"}]})
    with running(create_app(engine, MODEL, metrics=metrics, server_config=config)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-1", max_retries=0, timeout=20) as client:
            yield url, client, metrics


def test_metrics_after_requests(served):
    url, client, metrics = served
    before = scrape(url)
    usages, finishes = [], []
    for prompt, max_tokens in ((SHARED + "hello", 40), (SHARED + "world", 40), ("hello world", 1)):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
        usages.append(out.usage)
        finishes.append(out.choices[0].finish_reason)
    assert finishes == ["stop", "stop", "length"]  # the last one ran out of output budget
    # Same shared prefix: the second prompt found its two whole pages in the (fake) prefix cache.
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 8, 0]
    long_prompt = list(range(10, 74))  # 64 tokens: no room in the 64-token context
    assert httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer sk-1"},
                      json={"prompt": long_prompt, "max_tokens": 2}).status_code == 400
    truncated = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 8})
    assert truncated.usage.prompt_tokens == 8
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    # 6 requests so far, the 400 and the 404 too (every request that costs work counts against the
    # key): 2 more fit in 8 a minute.
    accepted = 0
    with pytest.raises(openai.RateLimitError):
        for _ in range(3):
            client.completions.create(model=MODEL, prompt="hello", max_tokens=1)
            accepted += 1
    assert accepted == 2

    after = scrape(url)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("glm5_requests_total", endpoint="/v1/completions", status="200") == 6
    assert delta("glm5_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("glm5_requests_total", endpoint="/v1/completions", status="404") == 1
    assert delta("glm5_requests_total", endpoint="/v1/completions", status="429") == 1
    assert value(after, "glm5_requests_total", endpoint="/metrics", status="200") >= 1
    assert delta("glm5_finished_requests_total", finish_reason="stop") == 2
    assert delta("glm5_finished_requests_total", finish_reason="length") == 4
    assert delta("glm5_prompts_rejected_total", reason="context_length_exceeded") == 1
    assert delta("glm5_prompts_truncated_total") == 1
    assert delta("glm5_rate_limited_requests_total", limit="requests", key_name="limited") == 1
    answered = [*usages, truncated.usage]  # plus the two 1-token "hello" completions before the 429
    prompt_tokens = sum(u.prompt_tokens for u in answered) + 2 * len(TOKENIZER.encode("hello").ids)
    assert delta("glm5_prompt_tokens_total") == prompt_tokens
    assert delta("glm5_output_tokens_total") == sum(u.completion_tokens for u in answered) + 2
    assert delta("glm5_cached_prompt_tokens_total") == 8
    assert delta("glm5_time_to_first_token_seconds_count") == 6
    assert delta("glm5_e2e_request_latency_seconds_count") == 6
    assert delta("glm5_queue_time_seconds_count") == 6
    # TPOT only for requests with more than one output token (the first two and the truncated one).
    assert delta("glm5_time_per_output_token_seconds_count") == 3
    hits, looked_up = value(after, "glm5_prefix_cache_hit_tokens_total"), value(
        after, "glm5_prefix_cache_lookup_tokens_total")
    assert hits >= 8 and value(after, "glm5_prefix_cache_hit_rate") == pytest.approx(hits / looked_up)
    assert value(after, "glm5_compile_count") == 0
    assert metrics.in_flight() == 0  # every request that started also finished


def test_cached_tokens_in_chat_and_in_the_streamed_usage_chunk(served):
    client = openai.OpenAI(base_url=f"{served[0]}/v1", api_key="sk-2", max_retries=0, timeout=20)
    messages = [{"role": "system", "content": SHARED * 2}, {"role": "user", "content": "hello"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 4 == 0 and cached < again.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert all(chunk.usage is None for chunk in chunks[:-1])
    # A stop string ends the request before the engine's final event: the stream's count is used.
    stopped = client.completions.create(model=MODEL, prompt=SHARED + "again", max_tokens=20, stop=" brown")
    assert stopped.choices[0].text == "The quick" and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.prompt_tokens_details.cached_tokens == 8


def test_engine_hooks_directly():
    metrics = ServerMetrics()
    metrics.on_step(pages_used=7, pages_total=32, host_pages_used=3, running=2, waiting=5, compile_count=4)
    metrics.on_preempted("r1")
    metrics.on_first_token("r1", 0.5)
    metrics.on_finished("r1", "length", prompt_tokens=10, cached_tokens=4, output_tokens=5, e2e_seconds=1.5)
    metrics.on_finished("r2", "abort", prompt_tokens=3, cached_tokens=0, output_tokens=0, e2e_seconds=0.1)
    metrics.on_prefix_lookup(10, 4)
    metrics.on_prefix_lookup(6, 0)
    samples = parse(metrics.render().decode())
    assert [value(samples, f"glm5_{name}") for name in (
        "cache_pages_used", "cache_pages_total", "host_cache_pages_used", "running_requests",
        "waiting_requests", "compile_count", "preemptions_total")] == [7, 32, 3, 2, 5, 4, 1]
    # TPOT = (e2e - TTFT) / (output tokens - 1) = (1.5 - 0.5) / 4 = 0.25: in the 0.25 bucket, not 0.1.
    assert value(samples, "glm5_time_per_output_token_seconds_sum") == pytest.approx(0.25)
    assert value(samples, "glm5_time_per_output_token_seconds_bucket", le="0.25") == 1
    assert value(samples, "glm5_time_per_output_token_seconds_bucket", le="0.1") == 0
    assert value(samples, "glm5_prefix_cache_hit_rate") == pytest.approx(4 / 16)
    assert value(samples, "glm5_prompt_tokens_total") == 13
    assert value(samples, "glm5_cached_prompt_tokens_total") == 4
    assert value(samples, "glm5_e2e_request_latency_seconds_count") == 2 and metrics.in_flight() == 0


def test_two_apps_in_one_process_keep_separate_registries():
    first, second = ServerMetrics(), ServerMetrics()
    first.preemptions.inc(3)
    assert "glm5_preemptions_total 3.0" in first.render().decode()
    assert "glm5_preemptions_total 0.0" in second.render().decode()
