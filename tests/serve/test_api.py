"""The OpenAI-compatible API end to end: uvicorn on 127.0.0.1 in a thread, a fake engine, the official
openai client (sync and async) and raw httpx for what the client cannot send (malformed JSON)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fake_engine import FakeEngine, make_tokenizer, running
from glm_files import glm_data_dir

from glm5_jax.api.app import create_app
from glm5_jax.api.metrics import ServerMetrics
from glm5_jax.chat.template import ChatRenderer, load_chat_template, load_special_tokens, render_glm5

# One xdist worker runs this module, so its fixtures (a served fake engine) are built once.
pytestmark = pytest.mark.xdist_group("api")

MODEL = "glm5-test"
KEY = "sk-test-key"
TOKENIZER = make_tokenizer()


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(TOKENIZER, max_context=128)


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text).ids


def stream_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


# ---------------------------------------------------------------- basics
def test_health_and_models(base_url, client):
    health = httpx.get(f"{base_url}/health").json()
    assert health["status"] == "ok" and isinstance(health["compile_count"], int)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "glm5-jax" and models.data[0].object == "model"


def test_completion_returns_text_and_usage(client):
    prompt = "hello world"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=50)
    assert out.id.startswith("cmpl-") and out.model == MODEL and out.created > 0
    assert out.choices[0].text == prompt  # the fake repeats the prompt; the EOS text is not shown
    assert out.choices[0].finish_reason == "stop"
    n = len(ids(prompt))
    usage = out.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (n, n + 1, 2 * n + 1)


def test_completion_length_limit_and_token_prompt(client):
    prompt_ids = ids("The quick brown fox jumps")
    out = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=2)
    assert out.choices[0].text == TOKENIZER.decode(prompt_ids[:2])
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2
    assert client.completions.create(model=MODEL, prompt=["hello"]).choices[0].text == "hello"
    echoed = client.completions.create(model=MODEL, prompt="hello", echo=True)
    assert echoed.choices[0].text == "hellohello"


def test_completion_streaming_with_usage(client):
    prompt = "The quick brown fox jumps over the lazy dog."
    text, chunks = stream_text(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=64, stream=True, stream_options={"include_usage": True}))
    assert text == prompt
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids(prompt)) + 1


def test_chat_non_streaming_and_streaming(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    out = client.chat.completions.create(model=MODEL, messages=messages)
    # The fake repeats the prompt's ordinary tokens: the rendered system and user text, after an empty
    # thinking block ("</think>": the prompt opened it).
    assert out.choices[0].message.content == "Be brief.hello world"
    assert out.choices[0].message.reasoning_content is None
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "stop"
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    rendered = render_glm5(messages)
    assert out.usage.prompt_tokens == len(TOKENIZER.encode(rendered, add_special_tokens=False).ids)
    assert out.usage.completion_tokens == 1 + len(ids("Be brief.hello world")) + 1

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "The quick "},
                                                            {"type": "text", "text": "brown fox"}]}],
        stream=True, max_completion_tokens=3, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TOKENIZER.decode(
        ids("The quick brown fox")[:2])  # "</think>" and two tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].object == "chat.completion.chunk"


# ---------------------------------------------------------------- stop strings and text
def test_stop_string_spanning_two_tokens(client):
    prompt = "The quick brown fox jumps"
    pieces = [TOKENIZER.decode([t]) for t in ids(prompt)]
    assert pieces[2:4] == [" brown", " fox"]
    stop = "wn fo"  # ends inside " fox", starts inside " brown"
    expected = "The quick bro"
    out = client.completions.create(model=MODEL, prompt=prompt, stop=[stop, "never"], max_tokens=40)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 4  # generation stopped at the token completing the stop string
    text, chunks = stream_text(client.completions.create(model=MODEL, prompt=prompt, stop=stop, stream=True))
    assert text == expected and chunks[-1].choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          stop=" fox")
    assert chat.choices[0].message.content == "The quick brown" and chat.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              stop=" fox", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "The quick brown"


def test_stop_string_in_first_token_and_stop_token_ids(client, engine):
    out = client.completions.create(model=MODEL, prompt="hello world", stop="hel")
    assert out.choices[0].text == "" and out.choices[0].finish_reason == "stop"
    assert engine.streams[-1].cancelled  # the engine request was cut short
    world = ids("hello world")[1]
    out = client.completions.create(model=MODEL, prompt="hello world", extra_body={"stop_token_ids": [world]})
    assert out.choices[0].text == "hello" and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 2 and not engine.streams[-1].cancelled


def test_streaming_never_splits_a_character(client):
    prompt = "héllo 你好 ✓ world"
    text, chunks = stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                                         stream=True))
    assert text == prompt
    assert all("\ufffd" not in c.choices[0].text for c in chunks if c.choices)


# ---------------------------------------------------------------- logprobs
def test_completion_logprobs(client):
    prompt = "hello world"
    out = client.completions.create(model=MODEL, prompt=prompt, logprobs=3)
    lp = out.choices[0].logprobs
    n = len(ids(prompt))  # one entry per shown token: the final EOS is left out like its text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == prompt and lp.text_offset == [0, len("hello")]
    assert all(len(top) == 3 for top in lp.top_logprobs) and lp.token_logprobs[0] == -0.5


def test_chat_logprobs(client):
    messages = [{"role": "user", "content": "hello world"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == ["</think>", "hello", " world"]  # the thinking tokens too
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, stream=True)
    tokens = [c.token for ch in streamed if ch.choices and ch.choices[0].logprobs
              for c in ch.choices[0].logprobs.content]
    assert tokens == ["</think>", "hello", " world"]
    plain = client.chat.completions.create(model=MODEL, messages=messages)
    assert plain.choices[0].logprobs is None


# ---------------------------------------------------------------- bad requests
COMPLETION_CASES = [
    ({"temperature": -1}, 400, "temperature"),
    ({"temperature": 1e9}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_k": -5}, 400, "top_k"),
    ({"min_p": 2}, 400, "min_p"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"presence_penalty": 3}, 400, "presence_penalty"),
    ({"frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"seed": -1}, 400, "seed"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": -3}, 400, "max_tokens"),
    ({"max_tokens": 10**9}, 400, "max_tokens"),
    ({"n": 0}, 400, "n"),
    ({"n": 17}, 400, "n"),
    ({"logprobs": 6}, 400, "logprobs"),
    ({"stop": [""]}, 400, "stop"),
    ({"stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ({"stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", ""]}, 400, "prompt"),
    ({"prompt": ["a"] * 200, "n": 2}, 400, "prompt"),
    ({"response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"prompt": [10**6]}, 400, "prompt"),
    ({"prompt": {"text": "hi"}}, 400, "prompt"),
    ({"prompt": "hello " * 200}, 400, "prompt"),
    ({"model": "gpt-4"}, 404, "model"),
]
CHAT_CASES = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages"),
    ({"messages": [{"role": "user", "content": "hello " * 200}]}, 400, "messages"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 25}, 400, "top_logprobs"),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"max_tokens": 10**6}, 400, "max_tokens"),
    ({"temperature": [1]}, 400, "temperature"),
    ({"response_format": {"type": "xml"}}, 400, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ({"tools": [{"type": "function"}]}, 400, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"model": "other"}, 404, "model"),
]


@pytest.mark.parametrize("fields,status,param", COMPLETION_CASES + [({"chat": True, **f}, s, p)
                                                                    for f, s, p in CHAT_CASES])
def test_bad_requests_get_openai_errors(client, fields, status, param):
    fields = dict(fields)
    with pytest.raises(openai.APIStatusError) as caught:
        if fields.pop("chat", False):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           extra_body=fields)
        else:
            client.completions.create(model=MODEL, prompt="hello", extra_body=fields)
    error = caught.value
    assert error.status_code == status and error.param == param and error.type == "invalid_request_error"
    assert param in error.body["message"]
    if "hello " * 200 in str(fields):
        assert "128" in error.body["message"] and error.code == "context_length_exceeded"
    # The server keeps serving.
    assert client.completions.create(model=MODEL, prompt="hello").choices[0].text == "hello"


def test_malformed_bodies(base_url, client):
    for body, param in [(b"{not json", None), (b"[1, 2]", None), (b'{"model": "glm5-test"}', "messages")]:
        response = httpx.post(f"{base_url}/v1/chat/completions", content=body,
                              headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "JSON" in httpx.post(f"{base_url}/v1/completions", content=b"{oops").json()["error"]["message"]
    # A body sent without a JSON Content-Type (curl -d) is still read as JSON.
    plain = httpx.post(f"{base_url}/v1/completions", content=b'{"model": "glm5-test", "prompt": "hello"}',
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == "hello"
    missing = httpx.get(f"{base_url}/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()
    assert client.models.list().data[0].id == MODEL


def test_api_key_required_when_set():
    with running(create_app(FakeEngine(TOKENIZER), MODEL, api_key=KEY)) as url:
        assert httpx.get(f"{url}/health").status_code == 200  # health checks need no key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.get(f"{url}/v1/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=MODEL, prompt="hello")
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as good:
            assert good.completions.create(model=MODEL, prompt="hello").choices[0].text == "hello"


@pytest.fixture(scope="module")
def strict():
    """One server with small limits for the failure and overload checks: one slot, one waiting request,
    1 KiB bodies, and 20 ms per token so that a request can hold the slot."""
    engine, metrics = FakeEngine(TOKENIZER, max_slots=1, max_waiting=1, delay=0.02), ServerMetrics()
    with running(create_app(engine, MODEL, metrics=metrics, max_body_bytes=1024)) as url:
        yield url, engine, metrics


def test_engine_failure_is_reported_and_the_server_survives(strict, monkeypatch, caplog):
    url, engine, metrics = strict
    caplog.set_level(logging.ERROR, logger="glm5_jax.api")
    engine.fail_after = 1  # each request's model step fails after one token: a finish_reason "error" event
    try:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hello world"})  # no model: allowed
        error = response.json()["error"]
        assert response.status_code == 500 and error["type"] == "server_error"
        assert error["message"].startswith("Internal server error (request cmpl-")
        assert "fake" not in response.text  # the engine's reason is for the log only
        lines = httpx.post(f"{url}/v1/completions", json={"prompt": "hello world", "stream": True,
                                                           "stream_options": {"include_usage": True}}).text
        events = [line for line in lines.split("\n\n") if line]
        assert '"text": "hello"' in events[0]  # the token made before the failure, then no usage chunk
        assert len(events) == 3 and events[-1] == "data: [DONE]"
        assert '"server_error"' in events[1] and "Internal server error (request cmpl-" in events[1]
    finally:
        engine.fail_after = None
    assert caplog.text.count("failed in the engine") == 2

    def broken_submit(*args):
        raise RuntimeError("secret detail")

    monkeypatch.setattr(engine, "submit", broken_submit)  # a bug: an unexpected exception
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 500 and "secret" not in response.text
    assert response.json()["error"]["message"].startswith("Internal server error (request chatcmpl-")
    assert "RuntimeError: secret detail" in caplog.text  # the details are logged, with the traceback
    monkeypatch.undo()
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hello"}).status_code == 200
    counted = metrics.render().decode()
    assert 'glm5_requests_total{endpoint="/v1/completions",status="500"} 1.0' in counted
    assert 'glm5_requests_total{endpoint="/v1/chat/completions",status="500"} 1.0' in counted
    assert 'glm5_finished_requests_total{finish_reason="error"} 2.0' in counted

    # The engine cannot go on: /health says so, requests get 503, and serve.py stops its server.
    import serve

    server = uvicorn.Server(uvicorn.Config(create_app(engine, MODEL), host="127.0.0.1", port=0,
                                           lifespan="off", log_level="warning"))
    threading.Timer(0.3, setattr, (engine, "failure", "device lost")).start()
    try:
        assert serve.serve_until_failure(server, engine, poll_seconds=0.05) == "device lost"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json() == {"status": "unavailable", "reason": "device lost"}
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hello"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
        assert "device lost" in refused.json()["error"]["message"]
    finally:
        engine.failure = None
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_overload_and_oversized_bodies_are_refused(strict):
    url, engine, _ = strict
    body = json.dumps({"prompt": "x" * 2000}).encode()
    chunked = iter([body[:600], body[600:]])  # no Content-Length: counted while it arrives
    for response in (httpx.post(f"{url}/v1/completions", content=body),
                     httpx.post(f"{url}/v1/completions", content=chunked)):
        error = response.json()["error"]
        assert response.status_code == 413 and (error["type"], error["code"]) == (
            "invalid_request_error", "request_too_large")
        assert "1024 bytes" in error["message"]
    small = httpx.post(f"{url}/v1/completions", content=iter([b'{"prompt": ', b'"hello"}']))
    assert small.status_code == 200 and small.json()["choices"][0]["text"] == "hello"

    hold = {"prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url) as http:
        with http.stream("POST", "/v1/completions", json=hold) as first:
            lines = first.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # a first token: this request holds the only slot
            with http.stream("POST", "/v1/completions", json=hold):  # submitted, waiting for the slot
                refused = http.post("/v1/completions", json={"prompt": "hello"})
    error = refused.json()["error"]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"  # the fake's 0.4 s rounded up
    assert (error["type"], error["code"]) == ("server_error", "queue_full")
    assert wait_for(lambda: not any(s.waiting for s in engine.streams))  # the clients left: both cancelled
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hello"}).status_code == 200


# ---------------------------------------------------------------- disconnects and load
def wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_client_disconnect_cancels_the_engine_request():
    engine = FakeEngine(TOKENIZER, max_context=128, delay=0.02)  # ~2.5 s for a full 120-token answer
    with running(create_app(engine, MODEL)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            stream = client.completions.create(model=MODEL, prompt="hello world", max_tokens=120, stream=True,
                                               extra_body={"ignore_eos": True})
            received = [next(stream), next(stream)]
            stream.close()
        assert received[0].choices[0].text
        assert wait_for(lambda: engine.streams[0].cancelled), "streaming request was not cancelled"
        assert engine.streams[0].finish_reason in (None, "abort")
        # Non-streaming: the client gives up (read timeout) and the request is cancelled all the same.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", timeout=0.3,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 120, "ignore_eos": True})
        assert wait_for(lambda: len(engine.streams) == 2 and engine.streams[1].cancelled)
        assert len(engine.streams[1].token_ids) < 120


def test_many_concurrent_clients(base_url, engine):
    clients, per_client = 64, 8
    first = len(engine.streams)

    async def one_client(api, i):
        results = []
        for j in range(per_client):
            prompt = f"client {i} request {j}"
            if j % 2:
                messages = [{"role": "user", "content": prompt}]
                out = await api.chat.completions.create(model=MODEL, messages=messages)
                results.append(out.choices[0].message.content == prompt)
            elif j % 4 == 2:
                stream = await api.completions.create(model=MODEL, prompt=prompt, stream=True)
                results.append("".join([c.choices[0].text async for c in stream]) == prompt)
            else:
                out = await api.completions.create(model=MODEL, prompt=prompt)
                results.append(out.choices[0].text == prompt and out.choices[0].finish_reason == "stop")
        return results

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0,
                                      timeout=30) as api:
            return await asyncio.wait_for(asyncio.gather(*(one_client(api, i) for i in range(clients))), 45)

    results = asyncio.run(main())
    assert all(all(r) for r in results) and sum(map(len, results)) == clients * per_client
    streams = engine.streams[first:]
    assert len(streams) == clients * per_client and not any(s.cancelled for s in streams)


# ---------------------------------------------------------------- chat templates
def glm5_template_dir() -> Path:
    return glm_data_dir() / "glm-5"


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
     {"role": "assistant", "content": "  hello \n"}, {"role": "user", "content": "again"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "calling"},
     {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "ok", "tool_calls": [
         {"type": "function",
          "function": {"name": "weather", "arguments": {"city": "Zürich", "days": [1, 2]}}},
         {"type": "function", "function": {"name": "time", "arguments": {}}}]},
     {"role": "tool", "content": "sunny"}],
    # Reasoning: dropped from turns before the last user message, kept after it (or everywhere with
    # clear_thinking false); from reasoning_content, or from the content's <think> block.
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nold\n</think>\nx"},
     {"role": "user", "content": "b"},
     {"role": "assistant", "reasoning_content": " why \n", "content": "y", "tool_calls": [
         {"type": "function", "function": {"name": "time", "arguments": {"tz": "UTC"}}}]},
     {"role": "tool", "content": "noon"}],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "<b>forecast</b> ü",
                                           "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "time"}}]


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_real_glm5_template_matches_transformers_and_fallback(messages, tools):
    template = load_chat_template(glm5_template_dir())
    assert template and template.startswith("[gMASK]<sop>")
    rendered = ChatRenderer(template).render(messages, tools=tools)
    transformers_chat = pytest.importorskip("transformers.utils.chat_template_utils")
    expected = transformers_chat.render_jinja_template([messages], tools=tools, chat_template=template,
                                                       add_generation_prompt=True)[0][0]
    assert rendered == expected
    assert rendered == ChatRenderer(None).render(messages, tools=tools)  # the built-in format is the real one
    assert (ChatRenderer(template).render(messages, enable_thinking=False)
            == render_glm5(messages, enable_thinking=False))
    assert (ChatRenderer(template).render(messages, clear_thinking=False)
            == ChatRenderer(None).render(messages, clear_thinking=False))


def test_openai_style_tool_call_arguments_are_parsed_for_the_template():
    template = load_chat_template(glm5_template_dir())
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    rendered = ChatRenderer(template).render(messages)
    assert "<tool_call>weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>" in rendered
    assert rendered == ChatRenderer(None).render(messages)


def test_real_glm5_template_with_tools_and_served():
    template = load_chat_template(glm5_template_dir())
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"tz": "<utc>"}}}]
    rendered = ChatRenderer(template).render([{"role": "user", "content": "time?"}], tools=tools)
    assert '"tz": "<utc>"' in rendered and rendered.endswith("<|user|>time?<|assistant|><think>")
    engine = FakeEngine(TOKENIZER, max_context=2048)  # the tool instructions alone are ~600 tiny tokens
    with running(create_app(engine, MODEL, chat_template=template)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}])
            call = {"id": "c1", "type": "function",
                    "function": {"name": "clock", "arguments": '{"tz": "UTC"}'}}
            client.chat.completions.create(model=MODEL, tools=tools, messages=[
                {"role": "user", "content": "time?"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "noon"}])
    assert out.choices[0].message.content == "hello"
    prompt = TOKENIZER.decode(engine.streams[0].prompt_ids, skip_special_tokens=False)
    assert prompt == "[gMASK]<sop><|user|>hello<|assistant|><think>"
    prompt = TOKENIZER.decode(engine.streams[1].prompt_ids, skip_special_tokens=False)
    assert "<tool_call>clock<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>" in prompt
    assert prompt.startswith("[gMASK]<sop><|system|>\n# Tools") and '"tz": "<utc>"' in prompt


def test_template_loading_and_rejection(tmp_path):
    assert load_chat_template(tmp_path) is None and load_special_tokens(tmp_path) == {}
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}],'
        ' "bos_token": {"content": "<s>"}, "eos_token": "</s>"}')
    template = load_chat_template(tmp_path)
    assert load_special_tokens(tmp_path) == {"bos_token": "<s>", "eos_token": "</s>"}
    renderer = ChatRenderer(template, load_special_tokens(tmp_path))
    assert renderer.render([{"role": "user", "content": "x"}]) == "<s>x"
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    rejecting = load_chat_template(tmp_path)
    with running(create_app(FakeEngine(TOKENIZER), MODEL, chat_template=rejecting)) as url:
        response = httpx.post(f"{url}/v1/chat/completions",
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and "roles must alternate" in response.json()["error"]["message"]


# ---------------------------------------------------------------- serve.py
def test_serve_execution_flags():
    import argparse

    import serve
    from glm5_jax import execution_flags
    from glm5_jax.model import options

    # One table (glm5_jax/execution_flags.py, no JAX) defines every execution flag: serve.py's and
    # the library's choices are its tuples, and each flag's choices are its row's.
    table = {field: choices for field, choices, _ in execution_flags.EXECUTION_FLAG_TABLE}
    assert serve.EXECUTION_FLAGS == tuple(table) and set(table) <= set(options.EXECUTION_FIELDS)
    assert tuple(options.DTYPES) == table["dtype"] and options.MOE_IMPLS is table["moe_impl"]
    assert options.KERNEL_IMPLS is table["attention_impl"] is table["decode_attention_impl"]
    assert options.QUANTIZED_MATMUL_IMPLS is table["quantized_matmul"]
    parser = argparse.ArgumentParser()
    execution_flags.add_execution_flags(parser, serve.EXECUTION_FLAGS)
    built = {a.dest: a.choices and tuple(a.choices) for a in parser._actions if a.dest in table}
    assert built == table
    from glm5_jax.engine.engine import DEFAULT_DECODE_STEPS

    assert serve.DEFAULT_DECODE_STEPS == DEFAULT_DECODE_STEPS
    args = serve.parse_args(["--dtype", "bfloat16", "--decode-attention-impl", "pallas"])
    assert (args.dtype, args.decode_attention_impl, args.moe_impl, args.indexer_impl) == (
        "bfloat16", "pallas", None, None)
    with pytest.raises(SystemExit):
        serve.parse_args(["--decode-attention-impl", "triton"])
    from glm5_jax.chat.reasoning import REASONING_PARSERS

    assert serve.parse_args([]).reasoning_parser == "glm45"
    assert [serve.parse_args(["--reasoning-parser", p]).reasoning_parser for p in REASONING_PARSERS] == list(
        REASONING_PARSERS)
    with pytest.raises(SystemExit):
        serve.parse_args(["--reasoning-parser", "deepseek_r1"])


def test_serve_cli_defaults_and_missing_demo_run(tmp_path, monkeypatch, capsys):
    import serve

    args = serve.parse_args([])
    assert (args.host, args.port, args.max_slots, args.max_context) == ("127.0.0.1", 8000, 8, 1024)
    assert (args.max_waiting, args.max_body_bytes) == (64, None)  # 8 x --max-slots; the API's 4 MiB
    args = serve.parse_args(["--max-slots", "2", "--max-waiting", "0", "--max-body-bytes", "100"])
    assert (args.max_waiting, args.max_body_bytes) == (0, 100)  # 0: unbounded
    monkeypatch.chdir(tmp_path)  # no runs/demo here
    with pytest.raises(SystemExit) as exited:
        serve.main([])
    assert "python train.py --config configs/demo.py" in str(exited.value.code)
    (tmp_path / "runs" / "demo" / "checkpoints").mkdir(parents=True)
    assert serve.resolve_checkpoint(None) == Path("runs/demo")
    with pytest.raises(SystemExit):
        serve.parse_args(["--max-slots", "0"])
    assert "--max-slots must be >= 1" in capsys.readouterr().err
    args = serve.parse_args(["--noprefix-caching", "--page-size", "8", "--num-pages", "64", "--token-budget",
                             "128", "--host-cache-pages", "32", "--quantize", "fp8"])
    assert (args.prefix_caching, args.page_size, args.num_pages, args.token_budget, args.host_cache_pages,
            args.quantize) == (False, 8, 64, 128, 32, "fp8")
    assert serve.parse_args(["--no-prefix-caching"]).prefix_caching is False
    assert serve.parse_args([]).prefix_caching is True and serve.parse_args([]).num_pages is None
    with pytest.raises(SystemExit):
        serve.parse_args(["--host-cache-pages", "-1"])
    assert "--host-cache-pages must be >= 0" in capsys.readouterr().err
    (tmp_path / "server.json").write_text('{"model_aliasses": []}')
    with pytest.raises(SystemExit) as exited:
        serve.main(["--checkpoint", str(tmp_path), "--server-config", str(tmp_path / "server.json")])
    assert "unknown field(s) ['model_aliasses']" in str(exited.value.code)


def test_stream_events_stay_one_line_for_splitlines_readers():
    """A sampled token can decode to U+0085, U+2028 or U+2029, which JSON leaves raw and
    str.splitlines (httpx's iter_lines) takes for line ends: the event escapes them."""
    import json

    from glm5_jax.api.choices import sse_json

    text = "a\x85b\u2028c\u2029d é"
    event = sse_json({"choices": [{"text": text}]})
    assert len(event.splitlines()) == 1 and "é" in event
    assert json.loads(event)["choices"][0]["text"] == text
