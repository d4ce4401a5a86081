"""The feedback loop: answers recorded by the server (fake engine, uvicorn in a thread), ratings through
POST /v1/feedback, the log's crash safety and any text it is given, and the export to SFT and pair
lines (private files). De-identification itself: tests/data/test_deidentify.py."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat

import httpx
import pytest
from fake_engine import FakeEngine, make_tokenizer, running

import serve
from glm5_jax.api.app import create_app
from glm5_jax.chat.feedback_log import FeedbackLog, JsonlAppender, ReadReport, read_records
from glm5_jax.data import feedback as export_cli
from glm5_jax.data.chat import parse_conversation
from glm5_jax.data.preference import parse_pair

MODEL = "glm5-test"
KEY = "sk-feedback-test"
TOKENIZER = make_tokenizer()
ASK = [{"role": "user", "content": "hello world"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
FAKE_LOGPROB = -0.5  # every token the fake engine generates


@contextlib.contextmanager
def serving(directory, engine=None):
    """(engine, log, client with the API key) of a fake-engine server that logs feedback to DIR."""
    engine = engine or FakeEngine(TOKENIZER, max_context=2048)  # the tool instructions are ~500 tokens
    log = FeedbackLog(directory)
    try:
        with running(create_app(engine, MODEL, api_key=KEY, feedback_log=log)) as url, \
                httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=20) as client:
            yield engine, log, client
    finally:
        log.close()


def streamed(client, path: str, body: dict) -> list[dict]:
    """The SSE chunks of a streamed request (without [DONE])."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def records(directory) -> dict[str, list[dict]]:
    by_type = {"interaction": [], "feedback": []}
    for record in read_records(directory):
        by_type[record["type"]].append(record)
    return by_type


# ---------------------------------------------------------------- the server records its answers
def test_every_finished_answer_is_recorded_streamed_or_not(tmp_path):
    with serving(tmp_path) as (engine, log, client):
        chat = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 20}).json()
        assert chat["choices"][0]["logprobs"] is None  # asked of the engine for the log, not shown
        assert engine.streams[-1].params.logprobs == 0
        chat_chunks = streamed(client, "/v1/chat/completions", {"messages": ASK, "temperature": 0.5,
                                                                 "stream_options": {"include_usage": True}})
        completion = client.post("/v1/completions", json={"prompt": "hello world", "n": 2,
                                                          "max_tokens": 30}).json()
        completion_chunks = streamed(client, "/v1/completions", {"prompt": ["hello", "the quick brown fox"],
                                                                 "echo": True, "max_tokens": 30})
        log.flush()
    logged = {record["id"]: record for record in records(tmp_path)["interaction"]}
    assert len(logged) == 4

    record = logged[chat["id"]]
    assert (record["endpoint"], record["model"], record["created"]) == ("chat", MODEL, chat["created"])
    assert record["request"]["messages"] == ASK and record["request"]["sampling"]["max_tokens"] == 20
    assert record["usage"] == chat["usage"]
    (choice,) = record["choices"]
    assert choice["content"] == chat["choices"][0]["message"]["content"] == "hello world"
    assert (choice["finish_reason"], choice["confidence"]) == ("stop", FAKE_LOGPROB)
    assert choice["reasoning_content"] is None and choice["tool_calls"] is None

    record = logged[chat_chunks[0]["id"]]
    assert record["request"]["sampling"]["temperature"] == 0.5
    assert record["choices"][0]["content"] == "hello world"
    assert record["usage"] == chat_chunks[-1]["usage"]  # the include_usage chunk

    record = logged[completion["id"]]
    assert record["endpoint"] == "completions" and record["request"]["prompts"] == ["hello world"]
    assert [(c["index"], c["prompt_index"], c["content"]) for c in record["choices"]] == [
        (0, 0, "hello world"), (1, 0, "hello world")]
    assert all(c["confidence"] == FAKE_LOGPROB for c in record["choices"])
    assert record["request"]["sampling"]["n"] == 2 and record["usage"] == completion["usage"]

    record = logged[completion_chunks[0]["id"]]  # the echoed prompt is not part of the answer
    assert [(c["prompt_index"], c["content"]) for c in record["choices"]] == [
        (0, "hello"), (1, "the quick brown fox")]


def test_reasoning_and_tool_calls_recorded_alike_from_a_stream_and_a_response(tmp_path):
    body = {"messages": ASK, "tools": [WEATHER]}
    with serving(tmp_path) as (engine, log, client):
        engine.reply = TOKENIZER.encode("Need weather.</think>" + CALL, add_special_tokens=False).ids
        answer = client.post("/v1/chat/completions", json=body).json()
        chunks = streamed(client, "/v1/chat/completions", body)
        log.flush()
    logged = {record["id"]: record for record in records(tmp_path)["interaction"]}
    whole, stream = logged[answer["id"]]["choices"][0], logged[chunks[0]["id"]]["choices"][0]
    message = answer["choices"][0]["message"]
    assert whole["tool_calls"] == message["tool_calls"]
    assert json.loads(whole["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert (whole["reasoning_content"], whole["content"], whole["finish_reason"]) == (
        "Need weather.", "", "tool_calls")
    assert logged[answer["id"]]["request"]["tools"] == [WEATHER]
    ids_differ = [{**call, "id": None} for call in stream["tool_calls"]]
    assert ids_differ == [{**call, "id": None} for call in whole["tool_calls"]]  # call ids are per answer
    assert {k: v for k, v in stream.items() if k != "tool_calls"} == {
        k: v for k, v in whole.items() if k != "tool_calls"}


def test_a_failing_log_never_breaks_an_answer(tmp_path, caplog):
    with serving(tmp_path) as (engine, log, client):
        def broken(record):
            raise OSError(28, "No space left on device")

        log._appender.append = broken
        with caplog.at_level(logging.ERROR, logger="glm5_jax.chat.feedback_log"):
            answer = client.post("/v1/chat/completions", json={"messages": ASK})
            chunks = streamed(client, "/v1/chat/completions", {"messages": ASK})
            log.flush()
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["message"]["content"] == "hello world"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert sum("could not write" in r.message for r in caplog.records) == 2
        # An answer whose record is not on disk cannot be rated: nothing could join the rating to it.
        for response_id in (answer.json()["id"], chunks[0]["id"]):
            rated = client.post("/v1/feedback", json={"id": response_id, "rating": 1})
            assert rated.status_code == 404 and rated.json()["error"]["param"] == "id"
        del log._appender.append  # the disk is back; a rating of a written answer that fails to write: 500
        written = client.post("/v1/chat/completions", json={"messages": ASK}).json()
        log.flush()
        log._appender.append = broken
        rated = client.post("/v1/feedback", json={"id": written["id"], "rating": 1})
        assert rated.status_code == 500 and rated.json()["error"]["type"] == "server_error"


# ---------------------------------------------------------------- POST /v1/feedback
def test_feedback_is_validated_and_recorded_and_later_servers_know_earlier_ids(tmp_path):
    with serving(tmp_path) as (engine, log, client):
        answer = client.post("/v1/chat/completions", json={"messages": ASK, "n": 2}).json()
        ok = client.post("/v1/feedback", json={"id": answer["id"], "rating": -0.5, "correction": "hi there",
                                               "index": 1})
        assert ok.status_code == 200
        assert ok.json() == {"id": answer["id"], "object": "feedback", "status": "recorded"}

        def error(body, status):
            response = client.post("/v1/feedback", json=body)
            assert response.status_code == status, response.text
            return response.json()["error"]

        assert error({"id": "chatcmpl-nope", "rating": 1}, 404)["param"] == "id"
        for rating in (1.5, -2, "good", True, None):
            assert error({"id": answer["id"], "rating": rating}, 400)["param"] == "rating"
        assert error({"id": answer["id"]}, 400)["param"] == "rating"
        assert error({"id": answer["id"], "rating": 1, "index": 2}, 400)["param"] == "index"
        assert error({"id": answer["id"], "rating": 1, "correction": 3}, 400)["param"] == "correction"
        keyless = httpx.post(f"{client.base_url}/v1/feedback", json={"id": answer["id"], "rating": 1})
        assert keyless.status_code == 401
    (feedback,) = records(tmp_path)["feedback"]
    assert {k: feedback[k] for k in ("id", "index", "rating", "correction")} == {
        "id": answer["id"], "index": 1, "rating": -0.5, "correction": "hi there"}

    with serving(tmp_path) as (engine, log, client):  # a restarted server over the same DIR
        assert client.post("/v1/feedback", json={"id": answer["id"], "rating": 1}).status_code == 200
    assert [f["rating"] for f in records(tmp_path)["feedback"]] == [-0.5, 1]

    with running(create_app(FakeEngine(TOKENIZER), MODEL)) as url:
        off = httpx.post(f"{url}/v1/feedback", json={"id": answer["id"], "rating": 1})
    assert off.status_code == 404 and "--feedback-dir" in off.json()["error"]["message"]


def test_serve_flag_and_an_unusable_directory(tmp_path):
    assert serve.parse_args(["--feedback-dir", str(tmp_path)]).feedback_dir == str(tmp_path)
    assert serve.parse_args([]).feedback_dir is None and serve.open_feedback_log(None) is None
    log = serve.open_feedback_log(str(tmp_path / "new" / "dir"))  # created
    assert log.path.parent == tmp_path / "new" / "dir"
    log.close()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit, match="--feedback-dir: cannot create the feedback directory"):
        serve.open_feedback_log(str(tmp_path / "a_file"))


# ---------------------------------------------------------------- crash safety
def test_a_truncated_last_line_is_skipped_and_counted(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    path = tmp_path / "feedback-20250101T000000Z-1.jsonl"
    writer = JsonlAppender(path)
    synced.clear()  # the directory's, at creation
    for i in range(3):
        writer.append({"type": "interaction", "id": f"chatcmpl-{i}", "choices": [{}]})
    writer.close()
    assert len(synced) == 3  # one per record
    with open(path, "ab") as file:  # the crash: half a record
        file.write(b'{"type": "feedback", "id": "chatcmpl-0", "rat')

    report = ReadReport()
    assert [r["id"] for r in read_records(tmp_path, report)] == ["chatcmpl-0", "chatcmpl-1", "chatcmpl-2"]
    assert report.records == 3 and len(report.skipped) == 1 and "truncated" in report.skipped[0]

    log = FeedbackLog(tmp_path)  # the next server: ids from the good lines, its own file
    assert log.choices("chatcmpl-2") == 1 and log.path != path
    log.close()
    again = JsonlAppender(path)  # a writer reopening the damaged file starts on a line of its own
    again.append({"type": "feedback", "id": "chatcmpl-1", "rating": 1})
    again.close()
    report = ReadReport()
    assert [r["id"] for r in read_records(tmp_path, report)][-1] == "chatcmpl-1"
    assert report.records == 4 and len(report.skipped) == 1 and "not valid JSON" in report.skipped[0]


# ---------------------------------------------------------------- any text
LONE = "\ud800"  # what the JSON "\ud800" decodes to: a lone UTF-16 surrogate, which UTF-8 cannot encode


def _raw_json(client, path: str, body: str):
    """POST a JSON body as written (httpx's json= cannot encode a lone surrogate)."""
    return client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})


def test_the_log_writes_any_text_and_reads_it_back(tmp_path, caplog):
    log = FeedbackLog(tmp_path)
    record = {"type": "interaction", "id": "chatcmpl-odd", "created": 1, "model": MODEL, "endpoint": "chat",
              "request": {"messages": [{"role": "user", "content": f"a{LONE}b 日本"}],
                          "sampling": {"stop": [LONE, "\udfff"]}},
              "choices": [{"index": 0, "content": f"x{LONE}", "finish_reason": "stop"}]}
    log.record_interaction(record)
    log.record_interaction({"type": "interaction", "id": "chatcmpl-bad", "choices": [object()]})  # not JSON
    with caplog.at_level(logging.ERROR, logger="glm5_jax.chat.feedback_log"):
        log.flush()
    assert log.choices("chatcmpl-odd") == 1
    assert log.choices("chatcmpl-bad") is None and "could not write the record of chatcmpl-bad" in caplog.text
    log.close()
    raw = log.path.read_bytes()
    assert "日本".encode() in raw and b"\\ud800" in raw and raw.decode("utf-8")  # UTF-8, surrogates escaped
    assert records(tmp_path)["interaction"] == [record]  # and read back as it was
    again = FeedbackLog(tmp_path)  # a later server over the same DIR knows the id
    assert again.choices("chatcmpl-odd") == 1
    again.close()


def test_lone_surrogates_over_http_never_give_500_and_every_ratable_id_is_on_disk(tmp_path):
    with serving(tmp_path / "log") as (engine, log, client):
        answer = client.post("/v1/chat/completions", json={"messages": ASK}).json()
        # The request layer may refuse a lone surrogate (400 naming the field); whatever it lets
        # through is recorded, and an answer it gives can be rated.
        rated = _raw_json(client, "/v1/feedback", f'{{"id": "{answer["id"]}", "rating": 1, '
                                                  '"correction": "fixed \\ud800 text"}')
        assert rated.status_code in (200, 400), rated.text
        assert rated.status_code == 200 or rated.json()["error"]["param"] == "correction"
        assert _raw_json(client, "/v1/feedback", '{"id": "\\udfff", "rating": 1}').status_code in (400, 404)
        huge = client.post("/v1/feedback", json={"id": "x" * 100_000, "rating": 1})  # not echoed whole
        assert huge.status_code == 404 and "(100000 characters)" in huge.text and len(huge.text) < 1000
        ask = '{"messages": [{"role": "user", "content": "hello"}], "stop": ["\\ud800"]}'
        stopped = _raw_json(client, "/v1/chat/completions", ask)
        assert stopped.status_code in (200, 400), stopped.text
        if stopped.status_code == 200:
            again = client.post("/v1/feedback", json={"id": stopped.json()["id"], "rating": 1})
            assert again.status_code == 200, again.text
        log.flush()
    logged = records(tmp_path / "log")
    if rated.status_code == 200:
        assert logged["feedback"][0]["correction"] == f"fixed {LONE} text"
    if stopped.status_code == 200:
        (record,) = [r for r in logged["interaction"] if r["id"] == stopped.json()["id"]]
        assert record["request"]["sampling"]["stop"] == [LONE]


def test_the_export_replaces_lone_surrogates(tmp_path):
    writer = JsonlAppender(tmp_path / "feedback-20250101T000000Z-1.jsonl")
    writer.append(_interaction("chatcmpl-a", [{"role": "user", "content": f"hi{LONE}"}], [("hello", -0.1)]))
    writer.append(_feedback("chatcmpl-a", 1.0, 2, correction=f"fixed {LONE} text"))
    writer.close()
    sft = tmp_path / "out" / "sft.jsonl"  # training data must be valid UTF-8: U+FFFD, as a decoder does
    stats = export_cli.main(["--input", str(tmp_path), "--sft", str(sft)])
    (line,) = [json.loads(line) for line in sft.read_bytes().decode("utf-8").splitlines()]
    assert line == {"messages": [{"role": "user", "content": "hi\ufffd"},
                                 {"role": "assistant", "content": "fixed \ufffd text"}]}
    assert stats["counts"]["replaced_lone_surrogates"] == 2


# ---------------------------------------------------------------- the export
def _interaction(response_id, messages, answers, endpoint="chat", tools=None):
    """A log record: answers are (content, confidence) per choice; messages: a prompt for completions."""
    request = {"messages": messages, "tools": tools} if endpoint == "chat" else {"prompts": [messages]}
    return {"type": "interaction", "id": response_id, "created": 1, "model": MODEL, "endpoint": endpoint,
            "request": {**request, "sampling": {"n": len(answers)}},
            "choices": [{"index": i, "prompt_index": 0, "content": content, "reasoning_content": None,
                         "tool_calls": None, "finish_reason": "stop", "confidence": confidence}
                        for i, (content, confidence) in enumerate(answers)]}


def _feedback(response_id, rating, created, index=0, correction=None):
    return {"type": "feedback", "id": response_id, "index": index, "created": created, "rating": rating,
            "correction": correction}


def test_export_grades_by_rating_and_confidence_and_writes_the_fixed_formats(tmp_path, capsys):
    ask = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Mail me at a@b.io"}]
    two_plus_two = [{"role": "user", "content": "2+2?"}]
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    writer = JsonlAppender(log_dir / "feedback-20250101T000000Z-1.jsonl")
    for record in [
        _interaction("chatcmpl-good", ask, [("Sure: a@b.io", -0.2)], tools=[WEATHER]),
        _feedback("chatcmpl-good", -1.0, created=2), _feedback("chatcmpl-good", 1.0, created=3),  # last wins
        _interaction("chatcmpl-unsure", ask, [("Maybe", -3.0)]), _feedback("chatcmpl-unsure", 1.0, 2),
        _interaction("chatcmpl-meh", ask, [("Meh", -0.1)]), _feedback("chatcmpl-meh", 0.2, 2),
        _interaction("chatcmpl-unrated", ask, [("?", -0.1)]),
        _interaction("chatcmpl-n2", two_plus_two, [("4", -0.1), ("5", -0.1)]),
        _feedback("chatcmpl-n2", 1.0, 2, index=0), _feedback("chatcmpl-n2", -1.0, 2, index=1),
        _interaction("cmpl-fixed", "def f(x):", [("return x", -0.3)], endpoint="completions"),
        _feedback("cmpl-fixed", -1.0, 2, correction="    return x * 2"),
        _feedback("chatcmpl-gone", 1.0, 2),
    ]:
        writer.append(record)
    writer.close()
    sft_path, pairs_path = tmp_path / "out" / "sft.jsonl", tmp_path / "out" / "dpo.jsonl"

    stats = export_cli.main(["--input", str(log_dir), "--sft", str(sft_path), "--pairs", str(pairs_path),
                             "--min-confidence", "-1.0"])
    sft = [json.loads(line) for line in sft_path.read_text().splitlines()]
    pairs = [json.loads(line) for line in pairs_path.read_text().splitlines()]
    private = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Mail me at <EMAIL>"}]
    assert sft == [
        {"messages": [*private, {"role": "assistant", "content": "Sure: <EMAIL>"}], "tools": [WEATHER]},
        {"messages": [*two_plus_two, {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "user", "content": "def f(x):"},
                      {"role": "assistant", "content": "    return x * 2"}]},
    ]
    assert pairs == [
        {"messages": [{"role": "user", "content": "def f(x):"}],
         "chosen": {"role": "assistant", "content": "    return x * 2"},
         "rejected": {"role": "assistant", "content": "return x"}},
        # Two answers to the same prompt: the higher rated one is chosen.
        {"messages": private, "chosen": {"role": "assistant", "content": "Maybe"},
         "rejected": {"role": "assistant", "content": "Meh"}},
        {"messages": two_plus_two, "chosen": {"role": "assistant", "content": "4"},
         "rejected": {"role": "assistant", "content": "5"}},
    ]
    counts = stats["counts"]
    assert (counts["interactions"], counts["rated"], counts["sft"], counts["pairs"]) == (6, 6, 3, 3)
    assert (counts["skipped_sft_confidence_below_min"], counts["skipped_sft_rating_below_min"],
            counts["skipped_unrated"], counts["skipped_feedback_without_interaction"]) == (1, 2, 1, 1)
    assert stats["deidentified"]["email"] == 5  # the prompt of four interactions, and one answer
    assert json.loads((tmp_path / "out" / "sft.stats.json").read_text()) == stats
    assert "wrote 3 lines" in capsys.readouterr().out
    # The trainers read both files: chat_jsonl (SFT) and preference_jsonl (DPO) lines.
    for index, line in enumerate(sft_path.read_text().splitlines()):
        parse_conversation(line, f"sft.jsonl:{index + 1}")
    for index, line in enumerate(pairs_path.read_text().splitlines()):
        parse_pair(line, f"dpo.jsonl:{index + 1}")

    # Without a confidence filter the unsure answer is kept too; a higher bar keeps only perfect ones.
    export_cli.main(["--input", str(log_dir), "--sft", str(sft_path), "--min-rating", "1"])
    kept = [json.loads(line)["messages"][-1]["content"] for line in sft_path.read_text().splitlines()]
    assert kept == ["Sure: <EMAIL>", "Maybe", "4", "    return x * 2"]


def test_export_files_are_private(tmp_path):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    writer = JsonlAppender(log_dir / "feedback-20250101T000000Z-1.jsonl")
    writer.append(_interaction("chatcmpl-a", ASK, [("hi", -0.1), ("yo", -0.1)]))
    writer.append(_feedback("chatcmpl-a", 1.0, 2, index=0))
    writer.append(_feedback("chatcmpl-a", -1.0, 2, index=1))
    writer.close()
    out = tmp_path / "new" / "deeper"
    (tmp_path / "old.jsonl").write_text("stale\n")
    os.chmod(tmp_path / "old.jsonl", 0o644)
    export_cli.main(["--input", str(log_dir), "--sft", str(out / "sft.jsonl"),
                     "--pairs", str(tmp_path / "old.jsonl")])
    mode = lambda path: stat.S_IMODE(os.stat(path).st_mode)  # noqa: E731
    assert [mode(out / name) for name in ("sft.jsonl", "sft.stats.json")] == [0o600, 0o600]
    assert mode(tmp_path / "old.jsonl") == 0o600 and "stale" not in (tmp_path / "old.jsonl").read_text()
    assert mode(out) == mode(out.parent) == 0o700  # created by the export
    assert sorted(p.name for p in out.iterdir()) == ["sft.jsonl", "sft.stats.json"]  # no temporary left


def test_export_refuses_a_missing_or_empty_directory(tmp_path):
    out = ["--sft", str(tmp_path / "sft.jsonl")]
    with pytest.raises(SystemExit, match="is not a directory"):
        export_cli.main(["--input", str(tmp_path / "nope"), *out])
    with pytest.raises(SystemExit, match="no feedback log files"):
        export_cli.main(["--input", str(tmp_path), *out])
    JsonlAppender(tmp_path / "feedback-20250101T000000Z-1.jsonl").close()
    with pytest.raises(SystemExit, match="no interactions"):
        export_cli.main(["--input", str(tmp_path), *out])
    with pytest.raises(SystemExit):
        export_cli.main(["--input", str(tmp_path)])  # nothing to write


def test_served_answers_rated_then_exported(tmp_path):
    """The loop: serve, rate, export."""
    with serving(tmp_path / "log") as (engine, log, client):
        answer = client.post("/v1/chat/completions", json={"messages": ASK}).json()
        assert client.post("/v1/feedback", json={"id": answer["id"], "rating": 1}).status_code == 200
    sft = tmp_path / "sft.jsonl"
    stats = export_cli.main(["--input", str(tmp_path / "log"), "--sft", str(sft), "--min-confidence", "-1"])
    assert [json.loads(line) for line in sft.read_text().splitlines()] == [
        {"messages": [*ASK, {"role": "assistant", "content": "hello world"}]}]
    assert stats["counts"]["sft"] == 1
