"""python -m glm5_jax.evaluate: pass@k against its closed form, lm-eval's pair encoding and rolling
windows, the readers' error messages, multiple-choice log-likelihoods equal to `forward`'s on the
tiny model, the server backend against serve.py's API (fake engine), a whole suite run on the
tiny model through the command line producing the JSON, the markdown and HTML reports and a
comparison, and generation from inside a running event loop (as in Jupyter).

One module fixture holds the tiny model, with its MoE layers made dense: the evaluation code does
not depend on the architecture, and dense layers compile in about two thirds of the time. Every
log-likelihood row is [8, 64] (one forward program); the suite run's Engine compiles one
mixed-step and one decode program (one slot, one chunk geometry)."""

import asyncio
import base64
import json
import math
from fractions import Fraction

import numpy as np
import pytest
import tokenizers
from fake_engine import FakeEngine, fake_prompt_logprob, running
from reference import random_params
from tokenizers import decoders, models, pre_tokenizers

import glm5_jax
from glm5_jax.api.app import create_app
from glm5_jax.evaluate import cli, render, report
from glm5_jax.evaluate.backend import GenerationRequest, encode_pair, rolling_windows
from glm5_jax.evaluate.formats import TaskDataError, read_gsm8k_jsonl, read_lm_eval_jsonl, read_mmlu_csv
from glm5_jax.evaluate.inprocess import InProcessBackend
from glm5_jax.evaluate.replay import read_replay
from glm5_jax.evaluate.scoring import (
    bootstrap,
    extract_last_number,
    extract_strict,
    pass_at_k,
    reference_number,
    wilson_interval,
)
from glm5_jax.evaluate.server import ServerBackend
from glm5_jax.evaluate.suites import PACKAGE_DATA, SuiteError, load_suite, suite_from_config, task_spec
from glm5_jax.evaluate.tasks import run_multiple_choice, run_task

pytestmark = pytest.mark.xdist_group("evaluate")
MAX_LENGTH = 64  # every log-likelihood row of these tests is [8, 64]: one forward program


# ---------------------------------------------------------------- scoring
def test_pass_at_k_equals_its_closed_form():
    for n in range(1, 13):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)
    # where the binomials overflow a float, the product form stays exact
    exact = 1 - Fraction(math.comb(2000 - 7, 700), math.comb(2000, 700))
    assert pass_at_k(2000, 7, 700) == pytest.approx(float(exact), rel=1e-9)
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)


def test_intervals():
    for total in range(1, 40):  # exact at the ends (a plotted error bar must never be negative)
        assert wilson_interval(0, total)[0] == 0.0 and wilson_interval(total, total)[1] == 1.0
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    mean = bootstrap([1.0, 2.0, 3.0, 4.0, 10.0])
    assert mean.method == "bootstrap" and mean.ci_low <= mean.value == 4.0 <= mean.ci_high
    assert bootstrap([2.0, 6.0], weights=[1.0, 3.0]).value == 2.0  # a ratio of sums


def test_gsm8k_answer_extraction():
    assert reference_number("3 * 4 = 12.\n#### 1,200") == "1200"
    assert extract_last_number("so 5 + 7 = 12, and the answer is $1,234.") == "1234"
    assert extract_strict("work...\n#### -3.50") == "-3.5" and extract_strict("42") is None
    assert extract_last_number("no number here") is None


class _Words:
    """A backend stand-in whose tokens are characters (enough for the pair and window logic)."""

    prefix_token_id = 0

    def encode(self, text):
        return [ord(ch) for ch in text]


def test_lm_eval_pair_encoding_and_rolling_windows():
    assert encode_pair(_Words(), "Q: a ", "b") == ([ord(c) for c in "Q: a"], [ord(" "), ord("b")])
    assert encode_pair(_Words(), "", "xy") == ([0], [ord("x"), ord("y")])
    tokens = list(range(1, 24))
    windows = rolling_windows(tokens, 0, 8)
    assert [t for _, continuation in windows for t in continuation] == tokens  # each predicted once
    sequence = [0, *tokens]
    for context, continuation in windows:
        assert len(context) + len(continuation) - 1 <= 8  # inputs per row
        whole = context + continuation
        start = sequence.index(whole[0])
        assert sequence[start : start + len(whole)] == whole  # the true preceding tokens


# ---------------------------------------------------------------- input errors
def test_malformed_inputs_name_file_line_and_field(tmp_path, capsys):
    bad = tmp_path / "mc.jsonl"
    bad.write_text(
        '{"context": "a", "choices": ["x", "y"], "gold": 0}\n\n{"context": "b", "choices": ["x"], '
        '"gold": 0}\n'
    )
    with pytest.raises(TaskDataError, match=r"mc\.jsonl:3: field 'choices'"):
        read_lm_eval_jsonl(bad)
    bad.write_text('{"context": "a", "choices": ["x", "y"]}\n')
    with pytest.raises(TaskDataError, match=r"mc\.jsonl:1: missing field 'gold'"):
        read_lm_eval_jsonl(bad)
    bad.write_text('{"context": "a", "choices": ["x", "y"], "gold": 0\n')
    with pytest.raises(TaskDataError, match=r"mc\.jsonl:1: not valid JSON"):
        read_lm_eval_jsonl(bad)
    csv = tmp_path / "mmlu.csv"
    csv.write_text("q,a,b,c,d,A\nq2,a,b,c,d,E\n")
    with pytest.raises(TaskDataError, match=r"mmlu\.csv:2: field 'answer'"):
        read_mmlu_csv(csv)
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text('{"question": "q", "answer": "no number"}\n')
    with pytest.raises(TaskDataError, match=r"gsm\.jsonl:1: field 'answer' has no final number"):
        read_gsm8k_jsonl(gsm)
    log = tmp_path / "log.jsonl"
    log.write_text('{"request": {"prompt": "x"}, "rules": {"lenght": 3}}\n')
    with pytest.raises(TaskDataError, match=r"log\.jsonl:1: unknown rule 'lenght'"):
        read_replay([log])
    with pytest.raises(SuiteError, match=r"tasks\[0\] \(t\): field 'kind' is 'essay'"):
        suite_from_config({"tasks": [{"name": "t", "kind": "essay", "source": "x"}]}, "s.py")
    with pytest.raises(SuiteError, match=r"unknown field\(s\) \['samples'\] for a multiple_choice task"):
        task_spec({"name": "t", "kind": "multiple_choice", "source": "x", "samples": 3}, "s.py: tasks[0]")
    with pytest.raises(SuiteError, match="suite 'no_such_suite' not found"):
        load_suite("no_such_suite")
    suite = tmp_path / "suite.py"  # the command line reads every task's data before loading the model
    suite.write_text(
        "def get_config():\n    return {'tasks': [{'name': 'mc', 'kind': 'multiple_choice', "
        "'source': 'mc.jsonl'}]}\n"
    )
    assert cli.main(["--checkpoint", str(tmp_path / "no-model"), "--suite", str(suite)]) == 2
    assert "mc.jsonl:1: not valid JSON" in capsys.readouterr().err
    assert len(read_replay([PACKAGE_DATA / "replay_sample.jsonl"])) == 9  # the shipped sample parses
    assert load_suite("local").tasks and load_suite("formats").tasks  # the shipped suites load


# ---------------------------------------------------------------- the tiny model
def byte_tokenizer() -> tokenizers.Tokenizer:
    """256 byte tokens, no merges: fits the tiny model's vocabulary, any text round-trips."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_config):
    config = tiny_config.replace(
        num_layers=2, num_dense_layers=2, indexer_types=["full"] * 2, attention_types=["dsa"] * 2
    )
    params = random_params(config, 3)
    return config, params, InProcessBackend(config, params, byte_tokenizer(), max_length=MAX_LENGTH)


def test_multiple_choice_scores_equal_forward_log_probs(tiny):
    config, params, backend = tiny
    items = read_lm_eval_jsonl(PACKAGE_DATA / "lm_eval_sample.jsonl")
    long_item = items[0].__class__("long", "x = 1\n" * 20 + "import", (" json", " os"), 1)  # cut to 64 inputs
    items = [*items, long_item]
    pairs = [encode_pair(backend, item.context, " " + choice) for item in items for choice in item.choices]
    scored = backend.loglikelihood(pairs)
    # The reference: each pair in its own row of [8, 64] batches in the given order (the backend
    # sorts by length), log-softmax in float64, the continuation's positions summed by hand.
    rows = [(context + continuation)[-(MAX_LENGTH + 1) :] for context, continuation in pairs]
    for first in range(0, len(rows), 8):
        ids = np.zeros((8, MAX_LENGTH), np.int32)
        for row, whole in enumerate(rows[first : first + 8]):
            ids[row, : len(whole) - 1] = whole[:-1]
        logits = np.asarray(glm5_jax.forward(config, params, ids), np.float64)  # [8, 64, V]
        logprobs = logits - logits.max(-1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
        for row, whole in enumerate(rows[first : first + 8]):
            (loglikelihood, greedy), continuation = scored[first + row], pairs[first + row][1]
            positions = range(len(whole) - 1 - len(continuation), len(whole) - 1)
            assert loglikelihood == pytest.approx(
                sum(logprobs[row, p, whole[p + 1]] for p in positions), abs=2e-4
            )
            assert greedy == all(logits[row, p].argmax() == whole[p + 1] for p in positions)
    spec = task_spec({"name": "mc", "kind": "multiple_choice", "source": "x"}, "test")
    result = run_multiple_choice(spec, items, backend, suite_from_config({"tasks": [spec.to_dict()]}), False)
    at, predictions = 0, []
    for item in items:
        predictions.append(int(np.argmax([score for score, _ in scored[at : at + len(item.choices)]])))
        at += len(item.choices)
    assert [sample["prediction"] for sample in result.samples] == predictions
    golds = [item.gold for item in items]
    assert result.metrics["acc"].value == np.mean(np.array(predictions) == np.array(golds))
    assert 0 <= result.metrics["acc"].ci_low <= result.metrics["acc"].value <= result.metrics["acc"].ci_high


SUITE = """import ml_collections


def get_config():
    return ml_collections.ConfigDict(dict(
        name="tiny", max_length={max_length}, batch_size=8, seed=0,
        engine=dict(max_slots=1, max_context=256, token_budget=16, decode_steps=4),
        sandbox=dict(timeout_s=2.0, memory_mb=256),
        tasks=[
            dict(name="mc", kind="multiple_choice", source="package:lm_eval_sample.jsonl"),
            dict(name="text", kind="bits_per_byte", source="heldout.txt", max_document_bytes=400),
            dict(name="code", kind="code", source="package:humaneval_sample.jsonl", limit=2, max_tokens=6),
            dict(name="sums", kind="exact_match", source="builtin:arithmetic", limit=2, num_fewshot=2,
                 max_tokens=4, stop=["\\n"], prompt_template=">>> {{question}}\\n",
                 shot_template=">>> {{question}}\\n{{solution}}\\n"),
            dict(name="replay", kind="replay", source="package:replay_sample.jsonl", limit=4, max_tokens=6,
                 warm_up=False, default_rules=dict(max_chars=10000)),
        ]))
"""


def test_suite_run_on_the_tiny_model_writes_json_report_and_comparison(tiny, tmp_path, monkeypatch):
    config, params, _ = tiny
    checkpoint = tmp_path / "tiny"
    glm5_jax.save_pretrained(config, params, checkpoint)
    byte_tokenizer().save(str(checkpoint / "tokenizer.json"))
    (tmp_path / "heldout.txt").write_text("def add(a, b):\n    return a + b\n" * 6)
    (tmp_path / "suite.py").write_text(SUITE.format(max_length=MAX_LENGTH))
    monkeypatch.setattr(report, "_pyplot", lambda: None)  # the report must not need matplotlib
    output = tmp_path / "out"
    assert (
        cli.main(
            [
                "--checkpoint",
                str(checkpoint),
                "--suite",
                str(tmp_path / "suite.py"),
                "--output",
                str(output),
                "--no-progress",
            ]
        )
        == 0
    )
    document = json.loads((output / "results.json").read_text())
    assert document["schema"] == report.SCHEMA and document["model"]["content_hash"]
    assert document["suite"]["name"] == "tiny" and "jax" in document["versions"]
    tasks = {t["name"]: t for t in document["tasks"]}
    assert set(tasks) == {"mc", "text", "code", "sums", "replay"}
    assert {t["dimension"] for t in tasks.values()} == {"basic", "professional", "real_scenarios"}
    for task in tasks.values():
        primary = task["metrics"][task["primary"]]
        assert {"value", "ci_low", "ci_high", "method", "count"} <= set(primary)
    assert tasks["text"]["metrics"]["bits_per_byte"]["value"] > 0
    assert tasks["code"]["metrics"]["pass@1"]["count"] == 2
    assert {"ttft_p50", "tpot_p90", "tokens_per_s_p99"} <= set(tasks["replay"]["metrics"])
    markdown = (output / "report.md").read_text()
    assert "plots skipped: matplotlib not installed" in markdown and "| replay | ttft_p50 |" in markdown
    page = (output / "report.html").read_text()  # the same content, as HTML
    assert page.startswith("<!DOCTYPE html>") and "<p>plots skipped: matplotlib not installed" in page
    for task in tasks.values():
        primary = task["metrics"][task["primary"]]
        value = report.format_value(primary)
        assert f"<td>{task['name']}</td><td>{task['primary']} (primary)</td><td>{value}</td>" in page
    samples = [json.loads(line) for line in (output / "samples.jsonl").read_text().splitlines()]
    assert {s["task"] for s in samples} == set(tasks)
    other = dict(document, label="other <b>")  # escaped in HTML
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert (
        cli.main(
            [
                "--compare",
                str(output / "results.json"),
                str(tmp_path / "other.json"),
                "--output",
                str(tmp_path / "compare"),
            ]
        )
        == 0
    )
    table = (tmp_path / "compare" / "compare.md").read_text()
    assert "| mc | acc | " in table and "other <b> - tiny" in table
    page = (tmp_path / "compare" / "compare.html").read_text()
    assert "<th>other &lt;b&gt; - tiny</th>" in page and "<b>" not in page
    acc = report.format_value(tasks["mc"]["metrics"]["acc"])
    assert f"<tr><td>mc</td><td>acc</td><td>{acc} " in page


def test_html_report_embeds_the_plot_and_escapes_text(tmp_path):
    plot = tmp_path / "scores.png"
    plot.write_bytes(b"\x89PNG\r\n\x1a\n not really a picture")
    blocks = [
        render.Heading(1, "Evaluation of `a<b>`"),
        render.Table(("task", "notes"), (("mc & co", 'say "hi" | bye'),)),
        render.Image("scores", plot),
    ]
    page = render.to_html(blocks, "a<b>")
    assert "<title>a&lt;b&gt;</title>" in page and "<h1>Evaluation of <code>a&lt;b&gt;</code></h1>" in page
    assert "<td>mc &amp; co</td><td>say &quot;hi&quot; | bye</td>" in page
    assert f'src="data:image/png;base64,{base64.b64encode(plot.read_bytes()).decode()}"' in page
    markdown = render.to_markdown(blocks)
    assert '| mc & co | say "hi" \\| bye |' in markdown and "![scores](scores.png)" in markdown


def test_in_process_generation_inside_a_running_event_loop(tiny):
    """A Jupyter cell runs inside an event loop, where asyncio.run refuses to start: generate
    then runs its loop on a worker thread. The engine is the API tests' fake (nothing compiled)."""
    config, params, _ = tiny
    engine = FakeEngine()
    backend = InProcessBackend(config, params, engine.tokenizer)
    backend._engine = engine
    requests = [GenerationRequest(prompt="hello world", max_tokens=4), GenerationRequest(prompt="the quick")]

    async def cell():
        assert asyncio.get_running_loop()
        return backend.generate(requests)

    inside, outside = asyncio.run(cell()), backend.generate(requests)
    assert [r.text for r in inside] == [r.text for r in outside] and inside[0].text
    assert {r.finish_reason for r in inside} <= {"stop", "length"}
    backend.close()


# ---------------------------------------------------------------- the server backend
def test_server_backend_scores_generates_and_judges():
    engine = FakeEngine()
    tokenizer = engine.tokenizer
    judge_engine = FakeEngine(tokenizer, max_context=4096)  # the grading prompt holds the whole exchange
    judge_engine.reply = tokenizer.encode("Score: 8", add_special_tokens=False).ids
    with running(create_app(engine, "m")) as url, running(create_app(judge_engine, "j")) as judge_url:
        backend = ServerBackend(url + "/v1", batch_size=2)
        assert backend.model == "m" and backend.encode("hello world") == tokenizer.encode("hello world").ids
        pairs = [
            encode_pair(backend, "hello world", " again"),
            encode_pair(backend, "The quick", " brown fox"),
            encode_pair(backend, "", "hello"),
        ]
        for (_, continuation), (score, _) in zip(pairs, backend.loglikelihood(pairs), strict=True):
            assert score == pytest.approx(sum(fake_prompt_logprob(t) for t in continuation))
        requests = [
            GenerationRequest(prompt="hello world", max_tokens=4, temperature=0.0),
            GenerationRequest(messages=({"role": "user", "content": "hello there"},), max_tokens=40),
        ]
        results = backend.generate(requests)

        async def cell():  # as in Jupyter: inside a running event loop
            return backend.generate(requests)

        assert [r.text for r in asyncio.run(cell())] == [r.text for r in results]
        assert results[0].text == "hello world"[: len(results[0].text)] and results[0].ttft_s is not None
        assert results[1].text == "hello there" and results[1].finish_reason == "stop"
        suite = suite_from_config(
            {
                "tasks": [
                    {
                        "name": "replay",
                        "kind": "replay",
                        "source": "package:replay_sample.jsonl",
                        "warm_up": False,
                    }
                ],
                "judge": {"url": judge_url},
            }
        )
        result = run_task(
            suite.tasks[0], suite, backend, progress=False, judge=ServerBackend(judge_url, concurrency=2)
        )
    assert result.metrics["judge_score"].value == pytest.approx(7 / 9)
    assert result.metrics["ttft_p50"].value > 0 and result.metrics["throughput_tokens_per_s"].value > 0
    assert result.extra["rules"]["contains"][1] == 2  # two records carry a `contains` rule
    assert 0 <= result.metrics["rules_pass_rate"].value <= 1
