"""serve.py end to end with the real engine: an HF-layout checkpoint with a tokenizer, the
official `openai` client, greedy output equal to the argmax chain of `glm5_jax.forward`; a server
config file (aliases, a rate-limited key), cached tokens from the real prefix cache, /metrics."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from reference import greedy_chain, perturbed_params

import glm5_jax
from glm5_jax.data import train_bpe_tokenizer

# One xdist worker runs this module, so its fixtures (a serve.py subprocess) are built once.
pytestmark = pytest.mark.xdist_group("serve_e2e")

ROOT = Path(__file__).resolve().parents[1]
TEXT = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n    y: int = 0\n",
        "for item in range(10):\n    print(item)\n", "import os\nprint(os.getcwd())\n"] * 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_config):
    directory = tmp_path_factory.mktemp("served")
    tokenizer = train_bpe_tokenizer(TEXT, vocab_size=320)
    config = tiny_config.replace(vocab_size=320, num_mtp_layers=0, eos_token_ids=[0], pad_token_id=0)
    params = perturbed_params(config, 11)
    glm5_jax.save_pretrained(config, params, directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory, config, params, tokenizer


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    directory = checkpoint[0]
    server_config = tmp_path_factory.mktemp("config") / "server.json"
    server_config.write_text(json.dumps({
        "model_aliases": ["glm-5"],
        "api_keys": [{"name": "limited", "key": "sk-limited", "requests_per_minute": 1}]}))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "serve.py", "--checkpoint", str(directory), "--port", str(port),
         "--max-slots", "4", "--max-context", "64", "--api-key", "secret", "--page-size", "8",
         "--token-budget", "16",
         "--server-config", str(server_config)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            if process.poll() is not None:
                raise AssertionError(process.stdout.read()) from None
            time.sleep(0.5)
    yield port, directory.name
    process.terminate()
    process.wait(timeout=60)


def test_completion_equals_forward_argmax(server, checkpoint):
    port, model_id = server
    _, config, params, tokenizer = checkpoint
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret", max_retries=0)
    assert [m.id for m in client.models.list().data] == [model_id, "glm-5"]  # the canonical id first
    prompt = "def add(a, b):"
    expected = greedy_chain(config, params, tokenizer.encode(prompt).ids, 12)
    expected_text = tokenizer.decode([t for t in expected if t not in config.eos_token_ids])
    response = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0)
    assert response.choices[0].text == expected_text
    assert response.usage.completion_tokens == len(expected)

    streamed = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected_text


def test_chat_streaming_and_bad_requests(server):
    port, model_id = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "print"}], max_tokens=8, stream=True,
        seed=1))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}],
                                       temperature=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong",
                      max_retries=0).completions.create(model=model_id, prompt="x")
    response = client.completions.create(model=model_id, prompt="x", max_tokens=2)
    assert response.choices[0].finish_reason in ("stop", "length")  # still serving


def test_no_recompiles_in_steady_state(server):
    port, model_id = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret", max_retries=0)
    client.completions.create(model=model_id, prompt="for item in", max_tokens=6)  # compiles its bucket
    before = httpx.get(f"http://127.0.0.1:{port}/health").json()["compile_count"]
    for prompt in ("import", "class A:", "def f(x): return x"):
        client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0.7, top_p=0.9)
    assert httpx.get(f"http://127.0.0.1:{port}/health").json()["compile_count"] == before


def test_config_aliases_limits_cached_tokens_and_metrics(server):
    port, model_id = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret", max_retries=0)
    assert [m.id for m in client.models.list().data] == [model_id, "glm-5"]
    prompt = "class Point:\n    x: int = 0\n    y: int = 0\n" * 2  # several whole 8-token pages
    first = client.completions.create(model="glm-5", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="glm-5", prompt=prompt, max_tokens=2, temperature=0)
    assert first.model == again.model == model_id
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 8 == 0 and cached < again.usage.prompt_tokens
    assert again.choices[0].text == first.choices[0].text  # the cached prefix gives the same answer
    limited = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-limited", max_retries=0)
    limited.completions.create(model=model_id, prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as refused:
        limited.completions.create(model=model_id, prompt="x", max_tokens=1)
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60

    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("glm5_time_to_first_token_seconds_count", ())] >= 3
    assert samples[("glm5_cached_prompt_tokens_total", ())] >= cached
    assert samples[("glm5_prefix_cache_hit_tokens_total", ())] >= cached
    assert samples[("glm5_cache_pages_total", ())] > 0
    limited_key = (("key_name", "limited"), ("limit", "requests"))
    assert samples[("glm5_rate_limited_requests_total", limited_key)] == 1
    assert samples[("glm5_compile_count", ())] == httpx.get(f"http://127.0.0.1:{port}/health").json()[
        "compile_count"]
