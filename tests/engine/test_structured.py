"""Constrained decoding in the real engine (llguidance masks applied on the device): on a
random-weight model, greedy and sampled outputs under JSON-schema constraints parse and
validate, json_object gives an object, a regex is matched; an unconstrained request in the same
batch is unchanged; `after` leaves the text before it free; bad constraints are refused."""

import asyncio
import json

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from fake_engine import make_tokenizer, running
from glm_files import glm_data_dir, glm_tokenizer
from reference import perturbed_params
from streams import run_together

from glm5_jax.api.app import create_app
from glm5_jax.api.chat_constraints import tool_call_regex
from glm5_jax.chat.template import load_chat_template
from glm5_jax.chat.tool_calls import ToolCall, ToolCallParser
from glm5_jax.engine.engine import Engine
from glm5_jax.engine.grammar import GrammarCompiler
from glm5_jax.engine.types import Constraint, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.xdist_group("structured")

TOKENIZER = make_tokenizer()
EOS = TOKENIZER.token_to_id("<|endoftext|>")
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "b": {"enum": ["x", "y"]}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
     "required": ["name", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "maximum": 9,
                                                                      "minimum": 0}, "maxItems": 3}},
     "required": ["xs"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def engine(tiny_config):
    # The vocabulary is the tokenizer's: every token the grammar allows can be sampled.
    config = tiny_config.replace(num_mtp_layers=0, eos_token_ids=[EOS], vocab_size=TOKENIZER.get_vocab_size())
    engine = Engine(config, perturbed_params(config, 5), TOKENIZER, max_slots=2, max_context=96,
                    token_budget=16, seed=0)
    yield engine
    engine.shutdown()


def text_of(events) -> str:
    return TOKENIZER.decode([e.token_id for e in events if e.token_id not in (None, EOS)])


def test_outputs_follow_their_constraints(engine):
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = run_together(engine, [([9, 8, 7], free)])[0]
    requests = [([5, 6, 7], SamplingParams(max_tokens=80, temperature=t, seed=3,
                                           constraint=Constraint("json_schema", json.dumps(schema))))
                for schema in SCHEMAS for t in (0.0, 1.0)]
    requests += [([5, 6], SamplingParams(max_tokens=80, temperature=0.0,
                                         constraint=Constraint("json_object"))),
                 ([4], SamplingParams(max_tokens=20, temperature=1.0, seed=1,
                                      constraint=Constraint("regex", "(cat|dog)-[0-9]{2}"))),
                 ([9, 8, 7], free)]
    results = run_together(engine, requests)
    for (_, params), events in zip(requests[:len(SCHEMAS) * 2], results, strict=False):
        schema = json.loads(params.constraint.spec)
        assert events[-1].finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(events)), schema)
    assert isinstance(json.loads(text_of(results[-3])), dict)
    assert text_of(results[-2]).startswith(("cat-", "dog-")) and len(text_of(results[-2])) == 6
    # Sharing decode steps with constrained rows leaves an unconstrained request unchanged.
    assert [e.token_id for e in results[-1]] == [e.token_id for e in alone]


def test_bad_constraints_are_refused(engine):
    async def submit(constraint):
        engine.submit([1, 2], SamplingParams(constraint=constraint))

    with pytest.raises(InvalidRequestError, match="regex"):
        asyncio.run(submit(Constraint("regex", "a(b")))
    with pytest.raises(InvalidRequestError, match="json_schema"):
        asyncio.run(submit(Constraint("json_schema", "{not json")))


def test_the_constraint_starts_after_its_marker():
    compiler = GrammarCompiler(TOKENIZER, TOKENIZER.get_vocab_size(), [EOS])
    output = compiler.start(Constraint("regex", "(cat|dog)", after="</think>"), TOKENIZER)
    row = np.zeros(-(-TOKENIZER.get_vocab_size() // 32), np.int32)
    for token in TOKENIZER.encode("hmm, pets").ids:
        output.fill(row)
        assert (row == -1).all()  # free before the marker
        assert not output.advance(token)
    assert not output.advance(TOKENIZER.token_to_id("</think>")) and output.active
    output.fill(row)
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
    assert allowed.size and all(any(word.startswith(TOKENIZER.decode([t])) for word in ("cat", "dog"))
                                for t in allowed)
    done = [output.advance(token) for token in TOKENIZER.encode("dog").ids]
    assert done[-1] and not any(done[:-1])  # complete: the engine ends the output ("stop")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city"]}}}
CLOCK = {"type": "function",
         "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}


def test_forced_tool_calls_sampled_with_the_real_glm_tokenizer_parse_and_validate():
    # GLM's tool-call tags (<tool_call>, <arg_key>, ...) are added tokens that are text, not
    # special: the grammar must allow them. Random walks under the mask (closing tags preferred
    # so walks end) must always give markup that the server's parser turns into typed calls.
    tokenizer = glm_tokenizer()
    vocab, eos = 154_856, tokenizer.token_to_id("<|endoftext|>")
    compiler = GrammarCompiler(tokenizer, vocab, [eos])
    special = {tokenizer.token_to_id(t) for t in ("<|user|>", "<|assistant|>", "<|observation|>", "[gMASK]")}
    closes = np.array([(tokenizer.id_to_token(t) or "").startswith("</") for t in range(vocab)])
    row = np.zeros(-(-vocab // 32), np.int32)
    rng = np.random.default_rng(0)
    for names, parallel in ((["get_weather"], False), (["get_weather", "clock"], True)):
        constraint = Constraint("regex", tool_call_regex([WEATHER, CLOCK], names, parallel), after="</think>")
        for _ in range(4):
            output, tokens = compiler.start(constraint, tokenizer), []
            for token in tokenizer.encode("Let me check.</think>").ids:
                output.advance(token)
            for _ in range(300):
                output.fill(row)
                allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])
                assert allowed.size and not special & set(allowed.tolist())
                if not tokens:  # the model's own single token for the tag, not "<", "tool", ...
                    assert tokenizer.token_to_id("<tool_call>") in allowed
                tags = allowed[closes[allowed]]
                token = int(rng.choice(tags if tags.size and rng.random() < 0.5 else allowed))
                if token == eos:
                    break
                tokens.append(token)
                if output.advance(token):
                    break
            text = tokenizer.decode(tokens, skip_special_tokens=False)
            parser = ToolCallParser([WEATHER, CLOCK], None if parallel else 1)
            items = parser.feed(text) + parser.finish()
            assert items and all(isinstance(item, ToolCall) for item in items), text
            assert parallel or len(items) == 1
            for call in items:
                assert call.name in names
                parameters = (WEATHER if call.name == "get_weather" else CLOCK)["function"]["parameters"]
                jsonschema.validate(json.loads(call.arguments), parameters)


UNITS = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "save": {"type": "boolean"}},
    "required": ["unit"]}}}


def test_tool_round_trip_through_the_api_on_the_real_engine(tiny_config):
    # The acceptance test of the chat API's tools: the real GLM tokenizer and GLM-5 template, the
    # official openai client, the real engine on a random-weight model whose output is forced by
    # tool_choice "required" into GLM-5's tool-call markup; the call comes back as tool_calls
    # and its result, sent as a `tool` message, is rendered into the next prompt.
    tokenizer = glm_tokenizer()
    template = load_chat_template(glm_data_dir() / "glm-5")
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = tiny_config.replace(num_mtp_layers=0, eos_token_ids=[eos], vocab_size=154_856)
    engine = Engine(config, perturbed_params(config, 7), tokenizer, max_slots=2, max_context=1024,
                    token_budget=16, seed=0)
    app = create_app(engine, "glm", chat_template=template)
    question = [{"role": "user", "content": "Use Fahrenheit from now on."}]
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    try:
        with running(app) as base_url:
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
            for temperature in (0.0, 1.0):
                first = client.chat.completions.create(
                    model="glm", messages=question, tools=[UNITS], tool_choice="required", max_tokens=40,
                    parallel_tool_calls=False, temperature=temperature, seed=5, extra_body=no_thinking)
                choice = first.choices[0]
                assert choice.finish_reason == "tool_calls" and choice.message.content is None
                (call,) = choice.message.tool_calls
                assert call.function.name == "set_unit" and call.id.startswith("call_")
                jsonschema.validate(json.loads(call.function.arguments), UNITS["function"]["parameters"])
            history = [*question, choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "unit saved"}]
            final = client.chat.completions.create(model="glm", messages=history, tools=[UNITS], max_tokens=3,
                                                   extra_body=no_thinking)
            rendered = httpx.post(f"{base_url}/tokenize", json={"messages": history, "tools": [UNITS],
                                                                 **no_thinking}).json()
    finally:
        engine.shutdown()
    assert final.usage.prompt_tokens == rendered["count"]
    prompt = tokenizer.decode(rendered["tokens"], skip_special_tokens=False)
    arguments = json.loads(call.function.arguments)
    written = "".join(f"<arg_key>{key}</arg_key><arg_value>"
                      f"{value if isinstance(value, str) else json.dumps(value)}</arg_value>"
                      for key, value in arguments.items())
    result = "<|observation|><tool_response>unit saved</tool_response>"
    assert f"<tool_call>set_unit{written}</tool_call>{result}" in prompt
