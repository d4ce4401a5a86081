"""Generated HTTP requests for fuzzing serve.py's API, and what every answer to one must look like.

Shared by tests/serve/test_serve_e2e.py (a small hypothesis budget against its real server) and
bench/fuzz_serve.py (thousands of requests, concurrent). Bodies come from the request models' own
JSON schemas (glm5_jax/api/protocol.py, feedback_log.FeedbackRequest) through
hypothesis-jsonschema: the app parses bodies itself (api/body.py), so FastAPI's OpenAPI schema has
none. A few fields are narrowed so that generated requests reach the engine often and stay cheap
(model ids the server serves, token ids inside the vocabulary, max_tokens <= 8); hostile values
come on top: one field of a generated body replaced by a wrong type, a lone surrogate, an extreme
number or a long string (`mutated`), raw bytes, truncated or deeply nested JSON (`raw`), and the
reproducers of issue 37 by name (`known_cases`).

What an answer must be (`problems`): any status but a 5xx, except 503 (a full queue, or the engine
unavailable) while other requests are running; an answer within the timeout; a 4xx for a body its
schema refuses (no coercion of `true` into 1); OpenAI-style error bodies, small (no input echoed
back) and free of Python internals; 200 bodies that parse (streams ending in [DONE] without an error
event) and tool calls only to declared functions.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import functools
import json
import re
import time

import httpx
import jsonschema
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from glm5_jax.api.feedback import FeedbackRequest
from glm5_jax.api.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

BODY_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
               "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
               "/v1/feedback": FeedbackRequest}
GET_PATHS = ("/health", "/metrics", "/v1/models", "/tokenizer_info")
RECENT_ID = "$RECENT_ID"  # replaced when sent by the id of an answer the server gave (feedback)
SURROGATE = "\ud800"  # json.dumps writes it as the escape "\ud800": valid JSON, not valid UTF-8 text
TOOL_NAMES = ("get_weather", "x</tool_call><tool_call>y", "a<arg_key>b")
MAX_ERROR_BYTES = 4096  # an error body is a message, never the input echoed back
# What a client must never see in an error message: Python's own words about the server's code.
LEAKS = re.compile(r"Traceback|File \"|\w\(\) (got|missing|takes)|object has no attribute|"
                   r"object is not|unsupported operand|maximum recursion")
WEIGHTS = {"schema": 7, "mutated": 6, "raw": 2, "case": 3, "get": 2}  # of the kinds of request
PATH_WEIGHTS = {"/v1/completions": 4, "/v1/chat/completions": 4, "/tokenize": 1, "/detokenize": 1,
                "/v1/feedback": 1}  # of the generated bodies
HOSTILE = (True, False, "yes", "", None, 0, -1, 1, 2**31, 2**63, -(2**63), 10**30, 1e308, -1e308, 0.5,
           [], {}, [[]], {"a": 1}, SURROGATE, f"a{SURROGATE}b", TOOL_NAMES[1], "\x00", "a" * 100_000)


@dataclasses.dataclass(frozen=True)
class Target:
    """The server under test: what requests must name to get past the first checks."""

    model_id: str
    api_key: str | None
    vocab_size: int
    capacity: int  # --max-slots + --max-waiting: more generations than this can never fit
    aliases: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class FuzzRequest:
    """One request. name: how it was made ("schema", "mutated:max_tokens", "case:...", "raw:...");
    schema_valid: whether the body is valid under its endpoint's schema (None: no such judgement);
    oversize: a body of this many bytes is made when sent (not held in memory meanwhile)."""

    name: str
    method: str
    path: str
    body: bytes | None = None
    headers: tuple[tuple[str, str], ...] = ()
    schema_valid: bool | None = None
    chunked: bool = False
    oversize: int = 0

    def reproducer(self) -> dict:
        body = self.body or b""
        try:
            text = {"body": body.decode()}
        except UnicodeDecodeError:
            text = {"body_base64": base64.b64encode(body).decode()}
        if len(body) > 4096:
            text = {"body_head": body[:2048].decode(errors="replace"), "body_bytes": len(body)}
        return {"name": self.name, "method": self.method, "path": self.path, "headers": dict(self.headers),
                "chunked": self.chunked, "oversize": self.oversize, **text}


def dumps(value) -> bytes:
    return json.dumps(value).encode()  # ensure_ascii: lone surrogates become \ud800 escapes


# ---------------------------------------------------------------- schemas
def body_schemas(target: Target) -> dict[str, dict]:
    """Each POST endpoint's JSON schema: the model's, with the fields below narrowed and every array,
    string and object bounded in size (so generated requests stay small)."""
    null = {"type": "null"}
    ids = {"type": "array", "items": _integer(0, target.vocab_size + 1), "minItems": 1, "maxItems": 6}
    text = {"type": "string", "maxLength": 24}
    unit = {"anyOf": [{"type": "number", "minimum": 0, "maximum": 2}, {"type": "number"}, null]}
    role = ChatRequest.model_json_schema()["$defs"]["ChatMessage"]["properties"]["role"]
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": text}}
    content = {"anyOf": [text, {"type": "array", "minItems": 1, "maxItems": 2, "items": part}]}
    messages = {"type": "array", "minItems": 1, "maxItems": 3, "items": {  # null content: a mutation
        "type": "object", "required": ["role", "content"], "properties": {"role": role, "content": content}}}
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool_name = {"enum": list(TOOL_NAMES)}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
            "name": tool_name, "parameters": {"const": city}}}}}
    named_tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                    "properties": {"name": tool_name}}}}
    formats = [{"type": "text"}, {"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "city", "schema": city}}]
    model = {"anyOf": [{"enum": [target.model_id, *target.aliases]}, null, text]}
    common = {
        "model": model, "max_tokens": _nullable(_integer(1, 8)), "n": _nullable(_integer(1, 3)),
        "temperature": unit, "top_p": unit, "min_p": unit, "repetition_penalty": unit,
        "presence_penalty": unit, "frequency_penalty": unit, "top_k": _nullable(_integer(-1, 50)),
        "stop": {"anyOf": [{"type": "string", "maxLength": 3},
                           {"type": "array", "maxItems": 2, "items": text}, null]},
        "stop_token_ids": _nullable({**ids, "minItems": 0, "maxItems": 2}),
        "truncate_prompt_tokens": _nullable(_integer(-1, 8)),
        "stream_options": _nullable({"type": "object", "additionalProperties": False,
                                     "properties": {"include_usage": {"type": "boolean"}}}),
        "response_format": {"anyOf": [null, {"enum": formats}, {"type": "object"}]},
        "logit_bias": null,
    }
    prompts = {"anyOf": [text, ids, {"type": "array", "items": text, "minItems": 1, "maxItems": 3},
                         {"type": "array", "items": ids, "minItems": 1, "maxItems": 3}]}
    narrowed = {
        "/v1/completions": {**common, "prompt": prompts, "logprobs": _nullable(_integer(-1, 6)),
                            "max_tokens": _nullable(_integer(0, 8)),  # 0: scoring with echo + logprobs
                            "best_of": _nullable(_integer(0, 2)),
                            "suffix": {"anyOf": [{"const": ""}, null, text]}},
        "/v1/chat/completions": {
            **common, "messages": messages, "max_completion_tokens": _nullable(_integer(0, 8)),
            "top_logprobs": _nullable(_integer(-1, 21)),
            "tools": _nullable({"type": "array", "items": tool, "minItems": 1, "maxItems": 2}),
            "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, null, named_tool]},
            "chat_template_kwargs": _nullable({"type": "object",
                                               "properties": {"enable_thinking": {"type": "boolean"}}})},
        "/tokenize": {"model": model, "prompt": _nullable(text), "messages": _nullable(messages),
                      "chat_template_kwargs": null, "tools": null},
        "/detokenize": {"model": model, "tokens": {**ids, "minItems": 0,
                                                   "items": _integer(-2, target.vocab_size + 1)}},
        "/v1/feedback": {"id": {"anyOf": [{"const": RECENT_ID}, text]}, "correction": _nullable(text),
                         "index": _integer(0, 2)},
    }
    schemas = {}
    for path, model in BODY_MODELS.items():
        schema = _bounded(model.model_json_schema())
        schema["properties"].update(narrowed[path])
        schema["additionalProperties"] = False  # extra fields are ignored by design; generate none
        if path == "/v1/chat/completions":  # chat's default max_tokens is the whole context: costly
            schema["required"] = [*schema["required"], "max_tokens"]
        schemas[path] = schema
    return schemas


def _integer(least: int, most: int) -> dict:
    return {"type": "integer", "minimum": least, "maximum": most}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _bounded(schema):
    """`schema` with every array, string and object given an upper size (kept when already set)."""
    if isinstance(schema, list):
        return [_bounded(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _bounded(value) for key, value in schema.items()}
    kind = schema.get("type")
    if kind == "array":
        schema.setdefault("maxItems", 3)
    elif kind == "string":
        schema.setdefault("maxLength", 24)
    elif kind == "object":
        schema.setdefault("maxProperties", 3)
    return schema


def schema_valid(path: str, body) -> bool:
    """Whether `body` is valid under the endpoint's model's own (unnarrowed) JSON schema."""
    return _validator(path).is_valid(body)


@functools.cache
def _validator(path: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(BODY_MODELS[path].model_json_schema())


# ---------------------------------------------------------------- strategies
def requests(target: Target) -> st.SearchStrategy[FuzzRequest]:
    """Every kind of request, in proportions (WEIGHTS, PATH_WEIGHTS) that keep most of them reaching
    the engine. The choices among kinds, fields and hostile values come from a seeded random.Random
    drawn from hypothesis: uniform, where hypothesis' own choices lean hard on the first option."""
    bodies = {path: from_schema(schema) for path, schema in body_schemas(target).items()}
    cases = known_cases(target)

    @st.composite
    def request(draw) -> FuzzRequest:
        rnd = draw(st.randoms(use_true_random=True))
        kind = rnd.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
        if kind == "case":
            return rnd.choice(cases)
        headers = rnd.choice(_headers(target))
        if kind == "get":
            path = rnd.choice(GET_PATHS)
            return FuzzRequest(f"get:{path}", "GET", path, headers=headers)
        path = rnd.choices(list(PATH_WEIGHTS), list(PATH_WEIGHTS.values()))[0]
        body = draw(bodies[path])
        if kind == "schema":
            return _json_request("schema", path, body, headers)
        if kind == "mutated":
            return _mutated(rnd, path, body, headers)
        return _raw(rnd, path, body, headers, draw(st.binary(max_size=64)))

    return request()


def _headers(target: Target) -> list[tuple]:
    """Header sets, most of them a client's ordinary ones."""
    good = (("authorization", f"Bearer {target.api_key}"),) if target.api_key else ()
    json_type = (("content-type", "application/json"),)
    return [good + json_type] * 6 + [good, json_type, (("authorization", "Bearer wrong"),),
                                     good + (("content-type", "text/plain"),)]


def _json_request(name: str, path: str, body, headers=()) -> FuzzRequest:
    valid = schema_valid(path, body) if isinstance(body, dict) else False
    return FuzzRequest(name, "POST", path, dumps(body), tuple(headers), valid)


def _mutated(rnd, path: str, body: dict, headers) -> FuzzRequest:
    """`body` with one field (or the first message's content) set to a hostile value."""
    body = copy.deepcopy(body)
    fields = sorted(BODY_MODELS[path].model_fields)
    field = rnd.choice([*fields, "messages.0.content"] if "messages" in fields else fields)
    value = rnd.choice(HOSTILE)
    if field == "messages.0.content":
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            body["messages"] = [{"role": "user"}]
        body["messages"][0]["content"] = value
    else:
        body[field] = value
    return _json_request(f"mutated:{field}", path, body, headers)


def _raw(rnd, path: str, body: dict, headers, random_bytes: bytes) -> FuzzRequest:
    """A body that is not a JSON object: random bytes, `body` cut short, a JSON scalar."""
    what = rnd.choice(("bytes", "truncated", "scalar"))
    if what == "bytes":
        content = random_bytes
    elif what == "truncated":
        text = dumps(body)
        content = text[:int(len(text) * rnd.random())]  # random() < 1: never the whole body
    else:
        content = rnd.choice([b"[]", b'"x"', b"1", b"null", b"true", b"", b"{}{}"])
    return FuzzRequest(f"raw:{what}", "POST", path, content, tuple(headers), False)


def _deep_schema(depth: int) -> bytes:
    """A response_format json_schema nested `depth` objects deep, written without recursion."""
    inner = b'{"type": "object", "properties": {"a": ' * depth + b'{"type": "string"}' + b"}}" * depth
    return (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": '
            b'{"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + inner + b"}}}")


def known_cases(target: Target) -> list[FuzzRequest]:
    """Issue 37's hostile inputs, each by name (requests send each at least once in tests)."""
    headers = (("authorization", f"Bearer {target.api_key}"),) if target.api_key else ()
    hi = [{"role": "user", "content": "hi"}]
    over = target.capacity // 16 + 1  # prompts x n (16) beyond slots + queue
    weather = {"type": "function", "function": {"name": TOOL_NAMES[1], "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    cases = {
        "one_token_scoring": ("/v1/completions", {"prompt": [7], "echo": True, "logprobs": 0,
                                                  "max_tokens": 0}),
        "max_tokens_true": ("/v1/completions", {"prompt": "hi", "max_tokens": True}),
        "stream_yes": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": "yes"}),
        "logprobs_yes": ("/v1/chat/completions", {"messages": hi, "max_tokens": 2, "logprobs": "yes"}),
        "surrogate_prompt": ("/v1/completions", {"prompt": SURROGATE, "max_tokens": 2}),
        "surrogate_chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}],
                                                    "max_tokens": 2}),
        "surrogate_stop": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [SURROGATE]}),
        "surrogate_tokenize": ("/tokenize", {"prompt": SURROGATE}),
        "surrogate_correction": ("/v1/feedback", {"id": RECENT_ID, "rating": 1, "correction": SURROGATE}),
        "surrogate_model": ("/v1/completions", {"model": SURROGATE, "prompt": "hi"}),
        "n_over_capacity": ("/v1/completions", {"prompt": ["a"] * over, "n": 16, "max_tokens": 1}),
        "template_kwargs_tools": ("/v1/chat/completions", {"messages": hi, "max_tokens": 1,
                                                           "chat_template_kwargs": {"tools": []}}),
        "template_kwargs_messages": ("/v1/chat/completions", {"messages": hi, "max_tokens": 1,
                                                              "chat_template_kwargs": {"messages": hi}}),
        "markup_tool_name": ("/v1/chat/completions", {"messages": hi, "max_tokens": 48, "tools": [weather],
                                                      "tool_choice": "required"}),
        "huge_feedback_id": ("/v1/feedback", {"id": "x" * 1_000_000, "rating": 1}),
        "huge_model_name": ("/v1/completions", {"model": "m" * 1_000_000, "prompt": "hi"}),
        "huge_tool_choice": ("/v1/chat/completions", {"messages": hi, "max_tokens": 1,
                                                      "tool_choice": "c" * 100_000}),
        "seed_overflow": ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 2, "seed": 2**63 - 1}),
        "best_of_true": ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "best_of": True}),
        "huge_max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30}),
        "negative_n": ("/v1/completions", {"prompt": "hi", "n": -1}),
        "zero_truncate": ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}),
    }
    made = [FuzzRequest(f"case:{name}", "POST", path, dumps(body), headers, schema_valid(path, body))
            for name, (path, body) in cases.items()]
    deep = 100_000
    made += [
        FuzzRequest("case:deep_json", "POST", "/v1/completions", b"[" * deep + b"]" * deep, headers, False),
        FuzzRequest("case:deep_prompt", "POST", "/v1/completions",
                    b'{"prompt": ' + b"[" * deep + b"]" * deep + b"}", headers, False),
        FuzzRequest("case:deep_schema", "POST", "/v1/chat/completions", _deep_schema(2000), headers, None),
        FuzzRequest("case:nan_temperature", "POST", "/v1/completions",
                    b'{"prompt": "hi", "temperature": NaN}', headers, False),
        FuzzRequest("case:oversized_body", "POST", "/v1/completions", None, headers, False, oversize=5 << 20),
        FuzzRequest("case:oversized_chunked", "POST", "/tokenize", None, headers, False, True, 5 << 20),
        FuzzRequest("case:get_completions", "GET", "/v1/completions", None, headers),
        FuzzRequest("case:unknown_path", "POST", "/v1/nothing", b"{}", headers),
    ]
    return made


# ---------------------------------------------------------------- sending and judging
@dataclasses.dataclass
class Outcome:
    status: int | None  # None: no answer (timed out, or the connection failed)
    content: bytes = b""
    headers: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    timed_out: bool = False
    error: str | None = None


def _oversized(request: FuzzRequest):
    chunk = b"a" * 65536
    if request.chunked:  # no Content-Length: the server must count while it reads
        async def chunks():
            yield b'{"prompt": "'
            for _ in range(request.oversize // len(chunk)):
                yield chunk
            yield b'"}'
        return chunks()
    return b'{"prompt": "' + chunk * (request.oversize // len(chunk)) + b'"}'


async def send(client: httpx.AsyncClient, request: FuzzRequest, timeout: float,
               recent_id: str | None = None) -> Outcome:
    """Sends `request` and reads the whole answer (a stream to its end) within `timeout` seconds."""
    content = request.body
    if recent_id and content and RECENT_ID.encode() in content:
        content = content.replace(RECENT_ID.encode(), recent_id.encode())
    if request.oversize:
        content = _oversized(request)
    start = time.perf_counter()

    async def exchange():
        async with client.stream(request.method, request.path, content=content, headers=dict(request.headers),
                                 timeout=timeout) as response:
            return Outcome(response.status_code, await response.aread(), dict(response.headers))

    try:
        outcome = await asyncio.wait_for(exchange(), timeout)
    except (TimeoutError, httpx.TimeoutException):
        outcome = Outcome(None, timed_out=True, error=f"no answer within {timeout:g} s")
    except httpx.HTTPError as exc:
        outcome = Outcome(None, error=f"{type(exc).__name__}: {exc}")
    outcome.seconds = time.perf_counter() - start
    return outcome


def problems(request: FuzzRequest, outcome: Outcome, *, idle: bool) -> list[str]:
    """What is wrong with `outcome` as the answer to `request` (empty: nothing). idle: nothing else was
    running, so a 503 (a full queue) cannot be right."""
    if outcome.timed_out:
        return [f"hang: {outcome.error}"]
    if outcome.status is None:
        if request.oversize and outcome.error and "Write" in outcome.error:
            return []  # the server answered 413 and closed before reading the whole body
        return [f"no answer: {outcome.error}"]
    status, found = outcome.status, []
    if status >= 500 and status != 503:
        found.append(f"undocumented {status}")
    elif status == 503 and idle:
        found.append("503 on an idle server (a request that can never fit must be a 400)")
    if 200 <= status < 300 and request.schema_valid is False:
        found.append(f"{status} for a body its schema refuses (coerced instead of refused)")
    if status >= 400:
        found += _error_problems(outcome)
    elif request.method == "POST" and 200 <= status < 300:
        found += _answer_problems(request, outcome)
    return found


def _error_problems(outcome: Outcome) -> list[str]:
    if len(outcome.content) > MAX_ERROR_BYTES:
        return [f"error body of {len(outcome.content)} bytes (the input echoed back?)"]
    try:
        message = json.loads(outcome.content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return [f"error body is not an OpenAI error object: {outcome.content[:200]!r}"]
    leak = LEAKS.search(message) if isinstance(message, str) else None
    return [f"error message shows server internals: {message[:200]!r}"] if leak else []


def _answer_problems(request: FuzzRequest, outcome: Outcome) -> list[str]:
    if outcome.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in outcome.content.decode(errors="replace").splitlines()
                  if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return ["stream does not end with data: [DONE]"]
        try:
            chunks = [json.loads(event) for event in events[:-1]]
        except ValueError:
            return ["stream event is not JSON"]
        errors = [chunk["error"] for chunk in chunks if isinstance(chunk, dict) and "error" in chunk]
        return [f"stream ends in an error event: {errors[0]}"] if errors else []
    try:
        answer = json.loads(outcome.content)
    except ValueError:
        return [f"200 body is not JSON: {outcome.content[:200]!r}"]
    if request.path == "/v1/chat/completions" and request.schema_valid:
        return _tool_call_problems(json.loads(request.body), answer)
    return []


def _tool_call_problems(body: dict, answer: dict) -> list[str]:
    """Tool calls in a (schema-valid) chat request's answer name only functions the request declared."""
    declared = {tool.get("function", {}).get("name") for tool in body.get("tools") or ()}
    called = {call["function"]["name"] for choice in answer.get("choices", ())
              for call in (choice.get("message") or {}).get("tool_calls") or ()}
    return [f"tool call to undeclared function {name!r}" for name in sorted(called - declared)]


def answer_id(request: FuzzRequest, outcome: Outcome) -> str | None:
    """The response id of a non-streamed completion or chat answer (for feedback requests)."""
    if outcome.status != 200 or request.path not in ("/v1/completions", "/v1/chat/completions"):
        return None
    try:
        return json.loads(outcome.content).get("id")
    except (ValueError, AttributeError):
        return None
