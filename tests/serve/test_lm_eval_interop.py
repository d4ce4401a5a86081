"""lm-evaluation-harness against serve.py (issue 17 item 2): lm_eval's `local-completions` model
scores a multiple-choice task through serve.py's `echo` + `logprobs` completions, and every
choice's log-likelihood equals the one `glm5_jax.evaluate` computes in-process (itself checked
against `forward` in test_evaluate.py) to 1e-4; lm_eval's acc and acc_norm equal ours.

Offline and cheap: lm_eval tokenizes through the server (`tokenizer_backend=remote`: serve.py's
/tokenizer_info and /tokenize, nothing downloaded); the task is built in memory
(`ConfigurableTask` with a `custom_dataset`) and run with `lm_eval.evaluator.evaluate`, not
`simple_evaluate`, which indexes lm_eval's ~14,000 task YAML files (54 s here, under load) and
imports torch for its environment report. The model is test_evaluate.py's tiny one (dense MoE
layers, byte tokenizer); serve.py runs one slot with a 16-token budget (one chunk geometry), and
starts while the in-process scores are computed. lm_eval's `max_length` 66 keeps the same tokens
as our `max_length` 64 (lm_eval: prompt = last max_length - 1 tokens of context + continuation;
ours: last max_length + 1), so the items cut on the left are compared too.

Cost (2-core CPU): ~31 s of CPU time with `-n 0` (serve.py ~13 s: imports and loading ~5 s, its
warm-up's 15 programs, then the prompt-scoring step at the first request; the in-process scores
~3 s; lm_eval ~3 s; the rest pytest, JAX and the imports), ~44 s with the two xdist workers of
the default `-n auto`, which both import and collect the module. See docs/evaluation.md.
"""

import dataclasses
import importlib.util
import os
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from reference import random_params
from test_evaluate import MAX_LENGTH, byte_tokenizer

import glm5_jax
from glm5_jax.evaluate.backend import encode_pair
from glm5_jax.evaluate.formats import MultipleChoiceItem, read_lm_eval_jsonl
from glm5_jax.evaluate.inprocess import InProcessBackend
from glm5_jax.evaluate.suites import PACKAGE_DATA, suite_from_config, task_spec
from glm5_jax.evaluate.tasks import run_multiple_choice

MISSING = [
    name
    for name in ("lm_eval", "aiohttp", "tenacity", "requests")  # lm-eval[api]
    if importlib.util.find_spec(name) is None
]
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"needs lm-eval with its API extra (pip install 'lm-eval[api]'): missing {MISSING}"
)

ROOT = Path(__file__).resolve().parents[2]
TASK = "glm5_tiny_mc"
# The engine geometry of test_evaluate.py's suite run: one slot, one 16-token chunk shape.
SERVE_FLAGS = (
    "--model-id tiny --max-slots 1 --max-context 256 --token-budget 16 --decode-steps 4 --page-size 16 "
    "--log-level warning"
)


class Served:
    """serve.py in a subprocess; `url` once `ready()` has returned."""

    def __init__(self, checkpoint: Path, log: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "serve.py", "--checkpoint", str(checkpoint), "--port", str(self.port)]
        command += SERVE_FLAGS.split()
        env = {k: v for k, v in os.environ.items() if k != "GLM5_API_KEY"}  # no key: lm_eval sends none
        with open(log, "w") as handle:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT
            )

    def ready(self, timeout: float = 300.0) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                raise AssertionError(f"serve.py exited:\n{self.log.read_text()}")
            time.sleep(0.2)
        raise AssertionError(f"serve.py did not come up in {timeout:.0f} s:\n{self.log.read_text()}")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def tiny_served(tmp_path_factory, tiny_config):
    """test_evaluate.py's tiny model, saved as an HF checkpoint and being served (not waited for)."""
    config = tiny_config.replace(
        num_layers=2, num_dense_layers=2, indexer_types=["full"] * 2, attention_types=["dsa"] * 2
    )
    params = random_params(config, 3)
    directory = tmp_path_factory.mktemp("lm_eval_served")
    glm5_jax.save_pretrained(config, params, directory / "tiny")
    tokenizer = byte_tokenizer()
    tokenizer.save(str(directory / "tiny" / "tokenizer.json"))
    served = Served(directory / "tiny", directory / "serve.log")
    try:
        yield config, params, tokenizer, served
    finally:
        served.close()


def lm_eval_run(url: str, items: list[MultipleChoiceItem], prefix_token_id: int) -> dict:
    """lm_eval's own multiple-choice task over `items`, scored by local-completions at `url`."""
    import datasets  # imported before, while serve.py starts
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.evaluator import evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    docs = [{"context": item.context, "choices": list(item.choices), "gold": item.gold} for item in items]
    mean = {"aggregation": "mean", "higher_is_better": True}
    task = ConfigurableTask(
        config={
            "task": TASK,
            "custom_dataset": lambda **_: datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)}),
            "test_split": "test",
            "output_type": "multiple_choice",
            "doc_to_text": "{{context}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{gold}}",
            "target_delimiter": "",  # in the choices (see the test)
            "metric_list": [{"metric": "acc", **mean}, {"metric": "acc_norm", **mean}],
        }
    )
    model = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions",
        model="tiny",
        tokenizer_backend="remote",
        max_length=MAX_LENGTH + 2,
        custom_prefix_token_id=prefix_token_id,
        max_retries=1,
        num_concurrent=1,
    )
    return evaluate(
        model, {"tasks": {TASK: task}, "groups": {}, "group_map": {}}, bootstrap_iters=0, log_samples=True
    )


def greedy_item(backend: InProcessBackend) -> MultipleChoiceItem:
    """An item whose first choice is the model's greedy next character (one byte token), so that
    the greedy flags are compared where they are true, not only where they are false."""
    printable = string.ascii_letters + string.digits + string.punctuation
    for context in ("def f(x):\n    return", "import", "class A:", "for i in range(", "x = [1, 2", "print("):
        ids = backend.encode(context)
        scored = backend.loglikelihood([(ids, backend.encode(ch)) for ch in printable])
        greedy = [ch for ch, (_, is_greedy) in zip(printable, scored, strict=True) if is_greedy]
        if greedy:
            return MultipleChoiceItem("greedy", context, (greedy[0], "~" if greedy[0] != "~" else "!"), 0)
    raise AssertionError("no context whose greedy next token is printable ASCII")


def test_lm_eval_local_completions_against_serve_equals_our_scores(tiny_served):
    config, params, tokenizer, served = tiny_served
    # ours, in-process, while serve.py starts (and lm_eval is imported)
    import lm_eval.evaluator  # noqa: F401
    import lm_eval.models.openai_completions  # noqa: F401

    backend = InProcessBackend(config, params, tokenizer, max_length=MAX_LENGTH)
    # lm-eval's format, as shipped (contexts long enough that 6 of the 16 pairs are cut on the
    # left), plus a context ending in a space (moved to the continuation by both), choices that
    # share a prefix, the model's greedy choice, and an empty context (the continuation follows
    # the prefix token: ours is the config's bos token; lm_eval's would be the tokenizer's bos/eos
    # token from /tokenizer_info, which a checkpoint without tokenizer_config.json does not name,
    # so it is given as custom_prefix_token_id). The delimiter is in the choices: the task's
    # target_delimiter is "" on both sides, so that a one-token choice can be greedy.
    shipped = read_lm_eval_jsonl(PACKAGE_DATA / "lm_eval_sample.jsonl")
    items = [dataclasses.replace(item, choices=tuple(" " + c for c in item.choices)) for item in shipped] + [
        MultipleChoiceItem("space", "def add(a, b):\n    return a ", ("+ b", "- b", "* b"), 0),
        MultipleChoiceItem("prefix", "import os\nprint(os.", ("getcwd())", "get_cwd())", "sep)"), 0),
        greedy_item(backend),
        MultipleChoiceItem("empty", "", ("import os", "import sys"), 0),
    ]
    pairs = [encode_pair(backend, item.context, choice) for item in items for choice in item.choices]
    ours = backend.loglikelihood(pairs)
    spec = task_spec({"name": TASK, "kind": "multiple_choice", "source": "x", "target_delimiter": ""}, "test")
    result = run_multiple_choice(spec, items, backend, suite_from_config({"tasks": [spec.to_dict()]}), False)

    output = lm_eval_run(served.ready(), items, backend.prefix_token_id)
    samples = sorted(output["samples"][TASK], key=lambda sample: sample["doc_id"])
    assert [s["arguments"] for s in samples] == [[(item.context, c) for c in item.choices] for item in items]
    theirs = [response[0] for sample in samples for response in sample["resps"]]  # (loglik, greedy)
    assert len(theirs) == len(ours) == sum(len(item.choices) for item in items)
    for (score, greedy), (their_score, their_greedy) in zip(ours, theirs, strict=True):
        assert their_score == pytest.approx(score, abs=1e-4)
        assert their_greedy == greedy
    assert any(greedy for _, greedy in ours)
    scores = output["results"][TASK]
    assert scores["acc,none"] == pytest.approx(result.metrics["acc"].value, abs=1e-12)
    assert scores["acc_norm,none"] == pytest.approx(result.metrics["acc_norm"].value, abs=1e-12)
    assert [s["acc"] for s in samples] == [
        float(sample["prediction"] == sample["gold"]) for sample in result.samples
    ]
