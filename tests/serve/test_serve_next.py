"""serve.py on a hybrid checkpoint (GLM-5.3-Flash, glm5_next: KDA linear layers, hyper-connections,
pooled DSA) saved by `glm5_jax.save_pretrained` with a tokenizer: the official `openai` client's
greedy completion equals the argmax chain of `glm5_jax.forward`, streamed and not, past
index_topk and across prefill chunks; the same prompt again is a prefix-cache hit (the KDA state
restored from a snapshot) with the same text; the server says at start how many state snapshots
it keeps."""

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from next_models import tiny_next
from processes import free_port, wait_healthy
from reference import greedy_chain, perturbed_params

import glm5_jax
from glm5_jax.data import train_bpe_tokenizer

# One xdist worker runs this module, so its serve.py process is started once.
pytestmark = pytest.mark.xdist_group("serve_next")

ROOT = Path(__file__).resolve().parents[2]
TEXT = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n    y: int = 0\n",
        "for item in range(10):\n    print(item)\n", "import os\nprint(os.getcwd())\n"] * 20
# tests/next_models.py's tiny model (2 indexer heads of 8) with the tokenizer's vocabulary.
CHANGES = dict(vocab_size=320, index_num_heads=2, index_head_dim=8, eos_token_ids=[0])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("served_next")
    tokenizer = train_bpe_tokenizer(TEXT, vocab_size=320)
    config = tiny_next(**CHANGES)
    params = perturbed_params(config, 11)
    glm5_jax.save_pretrained(config, params, directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory, config, params, tokenizer


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    directory = checkpoint[0]
    log = tmp_path_factory.mktemp("log") / "serve.log"
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "serve.py", "--checkpoint", str(directory), "--port", str(port),
             "--max-slots", "2", "--max-context", "48", "--page-size", "4", "--token-budget", "16",
             "--decode-steps", "4"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", (process,), timeout=300)
        yield port, directory.name, log
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_completions_equal_forward_streamed_and_not(server, checkpoint):
    port, model_id, log = server
    _, config, params, tokenizer = checkpoint
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    # Past index_topk 8 and more than one 16-token prefill chunk.
    prompt = "class Point:\n    x: int = 0\n    y: int = 0\nfor item in range(10):"
    ids = tokenizer.encode(prompt).ids
    assert len(ids) > 16
    expected = greedy_chain(config, params, ids, 10, length=48)
    expected_text = tokenizer.decode([t for t in expected if t not in config.eos_token_ids])
    response = client.completions.create(model=model_id, prompt=prompt, max_tokens=10, temperature=0)
    assert response.choices[0].text == expected_text
    assert response.usage.completion_tokens == len(expected)
    assert response.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached yet
    again = client.completions.create(model=model_id, prompt=prompt, max_tokens=10, temperature=0)
    assert again.choices[0].text == expected_text
    # A hit ends at the last page boundary with a KDA state snapshot (4-token pages).
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 4 == 0 and cached < len(ids)
    streamed = client.completions.create(model=model_id, prompt=prompt, max_tokens=10, temperature=0,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected_text
    # Two at once (both slots), sampled with a seed: answered, and the same text twice.
    sampled = [client.completions.create(model=model_id, prompt=["def add(a, b):", "import os"], max_tokens=6,
                                         temperature=1.0, seed=3) for _ in range(2)]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert "prefix caching with 2 KDA state snapshots" in log.read_text()  # said at start (2 slots)
    assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
