"""Per-key RPM/TPM limits (sliding minute, fake clock), the server config file, and model aliases:
the limiter on its own, then through the HTTP API with the fake engine and the openai client."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from fake_engine import FakeEngine, make_tokenizer, running

from glm5_jax.api.app import create_app
from glm5_jax.api.limits import RateLimited, RateLimiter
from glm5_jax.api.server_config import (
    ApiKey,
    Limits,
    ServerConfigError,
    load_server_config,
    parse_server_config,
)

# One xdist worker runs this module, so its fixtures (a served fake engine) are built once.
pytestmark = pytest.mark.xdist_group("limits")

TOKENIZER = make_tokenizer()
MODEL = "glm5-test"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- the limiter
def test_requests_per_minute_sliding_window():
    clock = FakeClock()
    limiter = RateLimiter([ApiKey("a", "key-a", Limits(requests_per_minute=2))], clock=clock)
    limiter.acquire("key-a", 1).cancel()  # refused by the engine (a full queue): it does not count
    limiter.acquire("key-a", 1)
    clock.now += 10
    limiter.acquire("key-a", 1)
    clock.now += 5
    with pytest.raises(RateLimited) as refused:
        limiter.acquire("key-a", 1)
    # The first request (t=1000) leaves the window at t=1060; now is 1015.
    assert refused.value.limit == "requests" and refused.value.retry_after == 45
    assert "2 requests per minute" in refused.value.message
    clock.now = 1060.0  # exactly one minute after the first: it has left the window
    limiter.acquire("key-a", 1)
    with pytest.raises(RateLimited) as refused:
        limiter.acquire("key-a", 1)
    assert refused.value.retry_after == 10  # the second (t=1010) leaves at 1070


def test_tokens_per_minute_reserve_then_settle():
    clock = FakeClock()
    limiter = RateLimiter([ApiKey("a", "key-a", Limits(tokens_per_minute=100))], clock=clock)
    first = limiter.acquire("key-a", 60)  # prompt + max_tokens reserved while it runs
    clock.now += 1
    with pytest.raises(RateLimited) as refused:
        limiter.acquire("key-a", 50)
    assert refused.value.limit == "tokens" and refused.value.retry_after == 59
    first.settle(20)  # it really used 20: 40 tokens come back
    limiter.acquire("key-a", 50)
    clock.now += 2
    with pytest.raises(RateLimited) as refused:
        limiter.acquire("key-a", 40)  # 70 used + 40 > 100: wait for the first entry (20 tokens) to go
    assert refused.value.retry_after == 57
    with pytest.raises(RateLimited) as refused:
        limiter.acquire("key-a", 101)
    assert refused.value.retry_after is None and "more than this key's limit of 100" in refused.value.message


def test_keys_are_independent_and_unlisted_keys_share_the_default():
    clock = FakeClock()
    keys = [ApiKey("a", "key-a", Limits(requests_per_minute=1)), ApiKey("b", "key-b", Limits())]
    limiter = RateLimiter(keys, default=Limits(requests_per_minute=2), clock=clock)
    limiter.acquire("key-a", 5)
    with pytest.raises(RateLimited):
        limiter.acquire("key-a", 5)
    for _ in range(50):
        limiter.acquire("key-b", 10**9)  # unlimited, and not held back by key-a's window
    limiter.acquire("stranger", 1)
    limiter.acquire("", 1)  # no key
    for key in ("stranger", "other-stranger", ""):  # one window for them all: a new key buys nothing
        with pytest.raises(RateLimited) as refused:
            limiter.acquire(key, 1)
        assert "for all callers without a listed API key together" in refused.value.message
    clock.now += 61
    limiter.acquire("new-stranger", 1)
    assert limiter.tracked_keys() == 2  # key-a and the shared window (key-b is unlimited): bounded


def test_concurrent_acquires_admit_exactly_the_limit():
    limiter = RateLimiter([ApiKey("a", "key-a", Limits(requests_per_minute=500))], clock=FakeClock())
    admitted = []

    def worker():
        for _ in range(100):
            try:
                limiter.acquire("key-a", 7).settle(3)
                admitted.append(1)
            except RateLimited:
                pass

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 500


# ---------------------------------------------------------------- the config file
def test_server_config_python_and_json_files(tmp_path, monkeypatch):
    config = load_server_config("configs/serve_example.py")
    assert config.model_aliases and config.api_keys == ()  # the example's keys are commented out
    monkeypatch.setenv("TEAM_KEY", "sk-from-env")
    data = {"model_id": "glm-5", "model_aliases": ["a", "b"], "require_api_key": False,
            "default_limits": {"requests_per_minute": 10, "tokens_per_minute": 0},
            "api_keys": [{"name": "team", "key_env": "TEAM_KEY", "tokens_per_minute": 500},
                         {"key": "sk-literal", "requests_per_minute": 0}]}
    path = tmp_path / "server.json"
    path.write_text(json.dumps(data))
    config = load_server_config(path)
    assert (config.model_id, config.model_aliases, config.require_api_key) == ("glm-5", ("a", "b"), False)
    assert config.default_limits == Limits(requests_per_minute=10, tokens_per_minute=None)
    team, literal = config.api_keys
    assert (team.name, team.key, team.limits) == ("team", "sk-from-env", Limits(10, 500))
    assert (literal.name, literal.key, literal.limits) == ("key1", "sk-literal", Limits(None, None))
    assert "sk-" not in repr(config)  # secrets stay out of logs


@pytest.mark.parametrize("data, message", [
    ({"model_alias": ["x"]}, "unknown field(s) ['model_alias']"),
    ({"api_keys": [{"key": "k", "requests_per_minute": -1}]}, "api_keys[0].requests_per_minute"),
    ({"api_keys": [{"name": "n"}]}, "exactly one of 'key' or 'key_env'"),
    ({"api_keys": [{"key_env": "GLM5_NO_SUCH_VARIABLE"}]}, "'GLM5_NO_SUCH_VARIABLE' is not set"),
    ({"api_keys": [{"key": "k"}, {"key": "k"}]}, "the same key"),
    ({"default_limits": {"tokens_per_minute": 1.5}}, "default_limits.tokens_per_minute"),
    ({"model_aliases": "x"}, "model_aliases must be a list"),
    ({"require_api_key": "yes"}, "require_api_key"),
])
def test_server_config_errors_name_the_field(data, message):
    with pytest.raises(ServerConfigError) as error:
        parse_server_config(data)
    assert message in str(error.value)


def test_server_config_bad_files(tmp_path):
    with pytest.raises(ServerConfigError, match="does not exist"):
        load_server_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ServerConfigError, match="bad.json is not valid JSON"):
        load_server_config(tmp_path / "bad.json")


# ---------------------------------------------------------------- through the API
@pytest.fixture(scope="module")
def limited():
    """A server with two limited keys (and the anonymous default refused: require_api_key)."""
    clock = FakeClock()
    config = parse_server_config({
        "model_id": "ignored-here", "model_aliases": ["glm-5", "gpt-4o"],
        "api_keys": [{"name": "small", "key": "sk-small", "requests_per_minute": 2},
                     {"name": "tokens", "key": "sk-tokens", "tokens_per_minute": 40}]})
    engine = FakeEngine(TOKENIZER, max_context=64)
    with running(create_app(engine, MODEL, server_config=config, clock=clock)) as url:
        yield url, clock


def test_429_with_retry_after_and_window_reset(limited):
    url, clock = limited
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-small", max_retries=0) as client:
        for _ in range(2):
            assert client.completions.create(model=MODEL, prompt="hello", max_tokens=3).choices[0].text
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
        assert refused.value.response.headers["retry-after"] == "60"
        error = refused.value.response.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "2 requests per minute" in error["message"]
        with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-tokens", max_retries=0) as other:
            other.completions.create(model=MODEL, prompt="hello", max_tokens=3)  # its own window
        clock.now += 30
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=3)
        assert refused.value.response.headers["retry-after"] == "30"
        clock.now += 30
        assert client.completions.create(model=MODEL, prompt="hello", max_tokens=3).choices[0].text


def test_token_limit_counts_prompt_and_settled_output(limited):
    url, clock = limited
    clock.now += 120  # a fresh window
    headers = {"Authorization": "Bearer sk-tokens"}
    prompt = "hello world"  # 2 tokens; the fake echoes them, then EOS: 3 completion tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 30}
    first = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["total_tokens"]
    assert used == 5
    # The reservation (2 + 30) was settled to 5, so 32 more tokens fit in the 40-token limit ...
    assert httpx.post(f"{url}/v1/completions", json=body, headers=headers).status_code == 200
    # ... and now 10 are used: 2 + 29 more would make 41 > 40, until the first request's 5 leave.
    third = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 29}, headers=headers)
    assert third.status_code == 429 and int(third.headers["retry-after"]) == 60
    too_big = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 50}, headers=headers)
    assert too_big.status_code == 429 and "retry-after" not in too_big.headers
    assert "more than this key's limit of 40" in too_big.json()["error"]["message"]


def test_unknown_keys_refused_when_keys_are_required(limited):
    url, _ = limited
    for headers in ({}, {"Authorization": "Bearer sk-nope"}):
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401


def test_aliases_listed_accepted_and_answered_with_the_canonical_name(limited):
    url, clock = limited
    clock.now += 120
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-small", max_retries=0) as client:
        models = client.models.list().data
        assert [m.id for m in models] == [MODEL, "glm-5", "gpt-4o"]
        assert all(m.model_extra["root"] == MODEL for m in models)
        answer = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        assert answer.model == MODEL and answer.choices[0].message.content == "hi"
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="gpt-5", prompt="hello")
        error = missing.value.response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "'gpt-5' does not exist" in error["message"] and "'glm-5'" in error["message"]


def test_open_server_shares_the_default_limit_among_unlisted_keys():
    clock = FakeClock()
    config = parse_server_config({"require_api_key": False, "default_limits": {"requests_per_minute": 1},
                                  "api_keys": [{"key": "sk-vip", "requests_per_minute": 0}]})
    with running(create_app(FakeEngine(TOKENIZER), MODEL, server_config=config, clock=clock)) as url:
        body = {"prompt": "hello", "max_tokens": 2}

        def post(key):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.post(f"{url}/v1/completions", json=body, headers=headers).status_code

        # A fresh bearer string (or none) does not buy a fresh window.
        assert [post("sk-someone"), post("sk-someone"), post("sk-else"), post(None)] == [200, 429, 429, 429]
        assert [post("sk-vip") for _ in range(3)] == [200, 200, 200]  # listed as unlimited
        clock.now += 60
        assert [post("sk-else"), post(None)] == [200, 429]
