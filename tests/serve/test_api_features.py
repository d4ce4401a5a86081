"""The chat and completions features agentic and evaluation clients use, end to end through the
official openai client against the fake engine: reasoning split from the answer, tool calls (parsed,
streamed, forced by a constraint), structured-output constraints, n choices, prompt scoring
(echo + logprobs, as lm-evaluation-harness sends it) and vLLM's /tokenize and /detokenize. One
test drives the real GLM-5 chat template with the real GLM tokenizer through a tool round trip."""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest
import tokenizers
from fake_engine import FakeEngine, fake_prompt_logprob, make_tokenizer, running
from glm_files import glm_data_dir, glm_tokenizer

from glm5_jax.api.app import create_app
from glm5_jax.api.chat_constraints import tool_call_regex
from glm5_jax.chat.template import ChatRenderer, load_chat_template, render_glm5
from glm5_jax.engine.types import Constraint

pytestmark = pytest.mark.xdist_group("api")

MODEL = "glm5-test"
TOKENIZER = make_tokenizer()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "clock", "parameters": {}}}]
CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
        "<arg_value>2</arg_value></tool_call>")
ASK = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(TOKENIZER, max_context=2048)  # the tool instructions alone are ~600 tiny tokens


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False).ids


@contextlib.contextmanager
def replying(engine, *pieces: str, tokenizer=TOKENIZER):
    """The fake answers the pieces' tokens (each piece tokenized alone, so a tag split over two
    pieces is cut across tokens), then EOS."""
    engine.reply = [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False).ids]
    try:
        yield
    finally:
        engine.reply = None


def deltas(stream) -> tuple[dict, list]:
    """Concatenated delta fields of choice 0's chunks, and the chunks."""
    chunks, fields = list(stream), {"reasoning_content": "", "content": ""}
    for chunk in chunks:
        if chunk.choices:
            delta = chunk.choices[0].delta
            fields["reasoning_content"] += delta.model_extra.get("reasoning_content") or ""
            fields["content"] += delta.content or ""
    return fields, chunks


# ---------------------------------------------------------------- reasoning
def test_reasoning_split_in_message_and_stream_with_tags_cut_across_tokens(client, engine):
    pieces = ["Two plus", " two </th", "ink", ">The answer", " is 4."]  # "</think>" in three tokens
    with replying(engine, *pieces):
        out = client.chat.completions.create(model=MODEL, messages=ASK)
        fields, chunks = deltas(client.chat.completions.create(model=MODEL, messages=ASK, stream=True))
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == ("Two plus two ", "The answer is 4.")
    assert message.model_extra["reasoning"] == "Two plus two "  # newer vLLM's name
    assert fields == {"reasoning_content": "Two plus two ", "content": "The answer is 4."}
    reasoning_chunks = [c for c in chunks if c.choices and c.choices[0].delta.model_extra.get("reasoning")]
    assert len(reasoning_chunks) >= 2  # streamed as it comes, not at the end
    assert not any("<" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_enable_thinking_false_and_the_parser_switched_off(client, engine):
    out = client.chat.completions.create(model=MODEL, messages=ASK,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    prompt = TOKENIZER.decode(engine.streams[-1].prompt_ids, skip_special_tokens=False)
    assert prompt.endswith("<|assistant|></think>")  # GLM-5's no-think generation prompt
    assert out.choices[0].message.content == "hello world"
    assert out.choices[0].message.reasoning_content is None
    with replying(engine, "hmm</think>4"), running(create_app(engine, MODEL, reasoning_parser="none")) as url:
        raw = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]
    assert raw["message"]["content"] == "hmm</think>4" and raw["message"]["reasoning_content"] is None
    with pytest.raises(ValueError, match="reasoning_parser"):
        create_app(engine, MODEL, reasoning_parser="deepseek")


# ---------------------------------------------------------------- tool calls
def test_tool_calls_parsed_typed_and_streamed(client, engine):
    with replying(engine, "Need weather.</think>", CALL):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
        stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True)
        chunks = [c for c in stream if c.choices]
    prompt = TOKENIZER.decode(engine.streams[-1].prompt_ids, skip_special_tokens=False)
    assert prompt == render_glm5(ASK, tools=TOOLS) and "# Tools" in prompt
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "Need weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}  # days typed by the schema
    parts = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert parts[0].index == 0 and parts[0].id.startswith("call_") and parts[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert all(p.function.name is None for p in parts[1:])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert engine.streams[-1].params.constraint is None  # "auto": the model chooses


def test_tool_choice_none_named_required_parallel_and_malformed_markup(client, engine):
    with replying(engine, "</think>", CALL):
        none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none")
        assert "# Tools" not in TOKENIZER.decode(engine.streams[-1].prompt_ids, skip_special_tokens=False)
        choice = {"type": "function", "function": {"name": "get_weather"}}
        named = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice)
        assert engine.streams[-1].params.constraint == Constraint(
            "regex", tool_call_regex(TOOLS, ["get_weather"], parallel=False), after="</think>")
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert engine.streams[-1].params.constraint == Constraint(
            "regex", tool_call_regex(TOOLS, ["get_weather", "clock"], parallel=True))  # no thinking: at once
    assert none.choices[0].message.content == CALL and not none.choices[0].message.tool_calls
    assert none.choices[0].finish_reason == "stop"
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    with replying(engine, "</think>", CALL, "<tool_call>clock</tool_call>"):
        one = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                             parallel_tool_calls=False)
        both = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["get_weather", "clock"]
    broken = "Let me see <tool_call>get_weather<arg_key>city</arg_key>"  # cut short: not a call
    with replying(engine, "</think>", broken):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
        stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True)
        fields, _ = deltas(stream)
    assert out.choices[0].message.content == broken and out.choices[0].finish_reason == "stop"
    assert fields["content"] == broken


def glm_tokenizer_and_template() -> tuple[tokenizers.Tokenizer, str]:
    return glm_tokenizer(), load_chat_template(glm_data_dir() / "glm-5")


def test_tool_round_trip_with_the_real_glm5_template_and_tokenizer():
    tokenizer, template = glm_tokenizer_and_template()
    tags = tokenizer.encode("</think><arg_key>").ids  # whole tokens, not special: decoded text keeps them
    assert [tokenizer.id_to_token(t) for t in tags] == ["</think>", "<arg_key>"]
    engine = FakeEngine(tokenizer, max_context=4096)
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    with running(create_app(engine, MODEL, chat_template=template)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            with replying(engine, "The user wants Oslo.</think>", CALL, tokenizer=tokenizer):
                first = client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS)
                fields, chunks = deltas(client.chat.completions.create(model=MODEL, messages=question,
                                                                       tools=TOOLS, stream=True))
            assert tokenizer.decode(engine.streams[0].prompt_ids, skip_special_tokens=False).endswith(
                "<|user|>Weather in Oslo?<|assistant|><think>")
            answer = first.choices[0].message
            assert first.choices[0].finish_reason == "tool_calls"
            assert answer.reasoning_content == "The user wants Oslo."
            assert json.loads(answer.tool_calls[0].function.arguments) == {"city": "Oslo", "days": 2}
            assert fields["reasoning_content"] == "The user wants Oslo." and fields["content"] == ""
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            history = [*question, answer.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": answer.tool_calls[0].id, "content": "sunny"}]
            with replying(engine, "</think>It is sunny in Oslo.", tokenizer=tokenizer):
                final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert final.choices[0].message.content == "It is sunny in Oslo."
    assert final.choices[0].finish_reason == "stop"
    prompt = tokenizer.decode(engine.streams[-1].prompt_ids, skip_special_tokens=False)
    assert prompt.endswith("<|user|>Weather in Oslo?<|assistant|><think>The user wants Oslo.</think>" + CALL
                           + "<|observation|><tool_response>sunny</tool_response><|assistant|><think>")
    # The built-in format renders the same round trip (reasoning of the turn after the last user kept).
    plain = [{k: v for k, v in m.items() if k != "reasoning"} for m in history]
    assert prompt == ChatRenderer(template).render(plain, tools=TOOLS)
    assert prompt == ChatRenderer().render(plain, tools=TOOLS)


# ---------------------------------------------------------------- structured output
def test_response_format_becomes_the_engine_constraint(client, engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"})
    assert engine.streams[-1].params.constraint == Constraint("json_object", after="</think>")
    client.chat.completions.create(model=MODEL, messages=ASK, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    constraint = engine.streams[-1].params.constraint
    assert (constraint.kind, json.loads(constraint.spec), constraint.after) == ("json_schema", schema, None)
    client.completions.create(model=MODEL, prompt="hello",
                              extra_body={"response_format": {"type": "json_object"}})
    assert engine.streams[-1].params.constraint == Constraint("json_object")


# ---------------------------------------------------------------- n choices
def test_n_choices_seeded_and_summed(client, engine):
    out = client.chat.completions.create(model=MODEL, messages=ASK, n=3, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content == "hello world" for c in out.choices)
    assert [s.params.seed for s in engine.streams[-3:]] == [5, 6, 7]  # choice i: seed + i
    per_choice = 1 + len(ids("hello world")) + 1  # "</think>", the echo, EOS
    assert out.usage.completion_tokens == 3 * per_choice
    assert out.usage.prompt_tokens == len(ids(render_glm5(ASK)))  # the prompt once
    stream = client.chat.completions.create(model=MODEL, messages=ASK, n=2, stream=True)
    chunks = [c for c in stream if c.choices]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == "hello world"
        assert mine[-1].finish_reason == "stop"
    assert [s.params.seed for s in engine.streams[-2:]] == [None, None]

    many = client.completions.create(model=MODEL, prompt=["hello", "world"], n=2, max_tokens=5, seed=1)
    assert [(c.index, c.text) for c in many.choices] == [(0, "hello"), (1, "hello"), (2, "world"),
                                                         (3, "world")]
    assert [s.params.seed for s in engine.streams[-4:]] == [1, 2, 1, 2]
    prompt_tokens = len(ids("hello")) + len(ids("world"))  # each prompt once; each choice's output + EOS
    assert (many.usage.prompt_tokens, many.usage.completion_tokens) == (prompt_tokens, 2 * prompt_tokens + 4)
    streamed = list(client.completions.create(model=MODEL, prompt=[ids("hello"), ids("world")], stream=True,
                                              stream_options={"include_usage": True}))
    texts = {i: "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i)
             for i in (0, 1)}
    assert texts == {0: "hello", 1: "world"} and streamed[-1].usage.completion_tokens == prompt_tokens + 2


# ---------------------------------------------------------------- prompt scoring
def test_echo_with_logprobs_scores_the_prompt(client, engine):
    prompt = "hello world"
    prompt_ids = ids(prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1)
    assert engine.streams[-1].params.prompt_logprobs == 1
    lp = out.choices[0].logprobs
    assert out.choices[0].text == "hello worldhello"
    assert lp.tokens == ["hello", " world", "hello"] and lp.text_offset == [0, 5, 11]
    assert lp.token_logprobs == [None, fake_prompt_logprob(prompt_ids[1]), -0.5]  # the first: null
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs[1]) == 1
    stream = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                       stream=True)
    streamed = [c.choices[0] for c in stream]
    assert streamed[0].text == prompt and streamed[0].logprobs.tokens == ["hello", " world"]
    assert "".join(c.text for c in streamed) == out.choices[0].text
    assert [t for c in streamed for t in c.logprobs.token_logprobs] == lp.token_logprobs

    # max_tokens 0: score without generating.
    scored = client.completions.create(model=MODEL, prompt=prompt_ids, echo=True, logprobs=0, max_tokens=0)
    assert scored.choices[0].text == prompt and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.token_logprobs == [None, fake_prompt_logprob(prompt_ids[1])]
    assert scored.usage.completion_tokens == 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt
    assert chunks[-1].choices[0].finish_reason == "length"
    plain_echo = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=1)
    assert plain_echo.choices[0].logprobs is None and engine.streams[-1].params.prompt_logprobs is None


def test_lm_eval_loglikelihood_request(base_url, engine):
    # What lm-evaluation-harness's local-completions sends for a loglikelihood request: the context +
    # continuation as token ids, echo, logprobs 1, max_tokens 1; it reads token_logprobs[ctxlen:-1].
    context, continuation = ids("The quick brown"), ids(" fox jumps")
    body = {"model": MODEL, "prompt": [context + continuation], "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0, "seed": 1234}
    with replying(engine):  # the answer is EOS at once: it still counts as the generated token
        choice = httpx.post(f"{base_url}/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(context) + len(continuation) + 1
    assert logprobs["tokens"][-1] == "<|endoftext|>" and choice["text"] == "The quick brown fox jumps"
    assert logprobs["token_logprobs"][len(context):-1] == [fake_prompt_logprob(t) for t in continuation]
    greedy = [max(top, key=top.get) for top in logprobs["top_logprobs"][len(context):-1]]
    assert len(greedy) == len(continuation)


# ---------------------------------------------------------------- /tokenize, /detokenize, /tokenizer_info
def test_tokenize_and_detokenize(base_url):
    http = httpx.Client(base_url=base_url)

    def post(path, **body):
        return http.post(path, json={"model": MODEL, **body})

    assert post("/tokenize", prompt="hello world").json() == {
        "count": 2, "max_model_len": 2048, "tokens": ids("hello world"), "token_strs": None}
    chat = post("/tokenize", messages=ASK, return_token_strs=True).json()
    assert chat["tokens"] == ids(render_glm5(ASK)) and chat["token_strs"][-1] == "<think>"
    bare = post("/tokenize", messages=ASK, add_generation_prompt=False).json()
    assert bare["tokens"] == ids(render_glm5(ASK, add_generation_prompt=False))
    assert post("/detokenize", tokens=chat["tokens"]).json() == {"prompt": render_glm5(ASK)}
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 3}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": ASK}, "prompt"),
                              ("/detokenize", {"tokens": [10**6]}, "tokens")]:
        response = post(path, **body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert post("/detokenize", tokens=[1], model="nope").status_code == 404
    info = http.get("/tokenizer_info").json()  # lm-eval's remote tokenizer reads eos_token from here
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 2048
    assert ids(info["eos_token"]) == [TOKENIZER.token_to_id("<|endoftext|>")]
    http.close()
