"""Serving on a device mesh, run by tests/serve/test_serve_mesh.py in a subprocess with 8 fake CPU
devices (XLA_FLAGS must be set before JAX starts).

An HF checkpoint of the tiny model is loaded straight into each mesh's shardings and served
through the HTTP API (uvicorn, the official openai client) on a page pool small enough that
requests preempt each other, twice (the second round hits the prefix cache). Prints one JSON
object per mesh: the greedy completions' tokens and log-probs, and what was checked; and for "1"
(one device) the reference: the same greedy continuations by the full forward (no engine: the
engine itself is checked against forward on one device in tests/engine/test_engine.py).

    python tests/serve_mesh_checks.py "expert=8" "tensor=2,expert=4@fp8"

A mesh suffixed "@fp8" serves weights quantized by the fp8 recipe (128x128 block scales), split
as serve.py --mesh --quantize fp8 splits them; it is compared with the forward of the same
quantized weights on one device ("1@fp8").
"""

import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
from fake_engine import make_tokenizer, running  # noqa: E402
from reference import perturbed_params  # noqa: E402

import glm5_jax  # noqa: E402
from glm5_jax.api.app import create_app  # noqa: E402
from glm5_jax.checkpoint.hf_io import save_pretrained  # noqa: E402
from glm5_jax.config_files import load_model_config  # noqa: E402
from glm5_jax.engine.engine import Engine  # noqa: E402
from glm5_jax.model.config import mesh_requirements  # noqa: E402
from glm5_jax.model.options import ExecutionOptions  # noqa: E402
from glm5_jax.model.transformer import param_logical_axes  # noqa: E402
from glm5_jax.parallel.mesh import MeshSpec, make_mesh  # noqa: E402
from glm5_jax.parallel.sharding import serving_param_shardings  # noqa: E402
from glm5_jax.train.runs import load_any  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = load_model_config("configs/tiny.py", num_mtp_layers=0, eos_token_ids=[255])
PAGE, CONTEXT = 4, 48
SHARED = list(range(10, 22))  # a 12-token prefix every prompt starts with: prefix-cache hits
rng = np.random.default_rng(3)
PROMPTS = [SHARED + rng.integers(2, 200, n).tolist() for n in (3, 7, 5)]
NEW_TOKENS = 12


def serve_round(url: str) -> tuple[list[list[str]], list[list[float]], list[int]]:
    """The prompts at once (greedy, 12 tokens): (tokens and their log-probs per prompt, cached
    prompt tokens per prompt)."""
    def one(prompt):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=300) as client:
            reply = client.completions.create(model="m", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                              logprobs=0, extra_body={"ignore_eos": True})
        details = reply.usage.prompt_tokens_details
        logprobs = reply.choices[0].logprobs
        return logprobs.tokens, logprobs.token_logprobs, details.cached_tokens if details else 0

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    return tuple([r[i] for r in results] for i in range(3))


def forward_chains(config, params, tokenizer) -> tuple[list[list[str]], list[list[float]]]:
    """The prompts' greedy continuations (NEW_TOKENS, EOS ignored) by the full forward on one
    device, as the API reports them: token strings and their raw log-probabilities."""
    ids = np.zeros((len(PROMPTS), max(map(len, PROMPTS)) + NEW_TOKENS), np.int32)  # one padded shape
    for row, prompt in enumerate(PROMPTS):
        ids[row, :len(prompt)] = prompt
    tokens, logprobs = [[] for _ in PROMPTS], [[] for _ in PROMPTS]
    for step in range(NEW_TOKENS):
        log_softmax = jax.nn.log_softmax(glm5_jax.forward(config, params, ids), axis=-1)
        for row, prompt in enumerate(PROMPTS):
            position = len(prompt) + step
            token = int(np.argmax(log_softmax[row, position - 1]))
            ids[row, position] = token
            tokens[row].append(tokenizer.decode([token], skip_special_tokens=False))
            logprobs[row].append(float(log_softmax[row, position - 1, token]))
    return tokens, logprobs


def main(meshes: list[str]) -> None:
    tokenizer = make_tokenizer()
    with tempfile.TemporaryDirectory() as directory:
        save_pretrained(CONFIG, perturbed_params(CONFIG, 5), directory)
        tokenizer.save(os.path.join(directory, "tokenizer.json"))
        quantized = any(m.endswith("@fp8") for m in meshes)
        for name in ["1", *meshes] + (["1@fp8"] if quantized else []):
            text, _, recipe = name.partition("@")
            mesh, shardings = None, None
            if text != "1":
                def shardings(config, params=None, text=text):
                    mesh = make_mesh(MeshSpec.parse(text), mesh_requirements(config))
                    return serving_param_shardings(param_logical_axes(config), mesh, params)
            config, params, _ = load_any(directory, quantize=recipe or None, shardings=shardings)
            if text == "1":  # the reference: the model's own forward on one device, no engine
                tokens, logprobs = forward_chains(config, params, tokenizer)
                print(json.dumps({"mesh": name, "tokens": tokens, "logprobs": logprobs}), flush=True)
                continue
            placed = True
            if shardings is not None:
                want = shardings(config, params)
                mesh = jax.tree.leaves(want)[0].mesh
                placed = all(leaf.sharding == sharding for leaf, sharding in
                             zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True))
            # 12 pages of 4: three prompts of 15-19 tokens plus 12 new each do not fit together.
            engine = Engine(config, params, tokenizer, max_slots=3, max_context=CONTEXT, page_size=PAGE,
                            num_pages=CONTEXT // PAGE, token_budget=16, seed=0, mesh=mesh,
                            options=ExecutionOptions(moe_impl="dense"))
            try:
                with running(create_app(engine, "m")) as url:
                    first, logprobs, _ = serve_round(url)
                    second, _, cached = serve_round(url)
            finally:
                engine.shutdown()
            experts = params["moe_layers"]["moe"]["gate_proj"]
            experts = getattr(experts, "values", experts)  # a QuantizedTensor's [layers, E, in, out]
            print(json.dumps({"mesh": name, "tokens": first, "logprobs": logprobs, "again": second,
                              "cached": cached,
                              "preemptions": engine.preemptions, "placed": placed,
                              "expert_shard": list(experts.addressable_shards[0].data.shape),
                              "compiles": engine.compile_count}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
