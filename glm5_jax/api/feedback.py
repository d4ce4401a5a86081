"""The feedback log's HTTP side: an answer's interaction record made from its chunks (recording),
and POST /v1/feedback (FeedbackRequest, answer_feedback). The log itself: glm5_jax/chat/feedback_log.py."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from glm5_jax.api.errors import APIError
from glm5_jax.chat.feedback_log import FeedbackLog
from glm5_jax.engine.textstream import Piece
from glm5_jax.engine.types import SamplingParams, shown

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids")


class FeedbackRequest(BaseModel):
    """The body of POST /v1/feedback. index: which choice is rated when the request asked for n > 1
    (or sent several prompts); rating: -1 (bad) .. 1 (good); correction: the answer it should have been."""

    model_config = ConfigDict(extra="ignore")
    id: str
    rating: Annotated[float, Field(strict=True, ge=-1, le=1, allow_inf_nan=False)]
    correction: str | None = None
    index: Annotated[int, Field(strict=True, ge=0)] = 0


async def answer_feedback(log: FeedbackLog, body: FeedbackRequest) -> dict:
    """POST /v1/feedback: records `body` and returns the answer; APIError for an unknown id (404), an
    index past the response's choices (400) or a failed write (500)."""
    count = await log.written_choices(body.id)
    if count is None:
        raise APIError(404, f"id: no response {shown(body.id)} is in this server's feedback log (only "
                            "answers given while feedback was collected can be rated)", "id",
                       "response_not_found")
    if body.index >= count:
        raise APIError(400, f"index must be below {count} (the choices of response {body.id}), got "
                            f"{body.index}", "index")
    try:
        await log.record_feedback(body.id, body.index, body.rating, body.correction)
    except Exception as exc:
        logger.exception("feedback log: could not record feedback on %s", body.id)
        raise APIError(500, "The feedback could not be recorded (the server could not write its feedback "
                            "log); try again later", kind="server_error") from exc
    return {"id": body.id, "object": "feedback", "status": "recorded"}


# ---------------------------------------------------------------- an answer's record
def sampling_record(params: SamplingParams, n: int) -> dict:
    return {"n": n, **{name: getattr(params, name) for name in SAMPLING_FIELDS}}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclasses.dataclass
class _ChoiceRecord:
    content: list[str] = dataclasses.field(default_factory=list)
    reasoning: list[str] = dataclasses.field(default_factory=list)
    tool_calls: dict[int, dict] = dataclasses.field(default_factory=dict)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    finished: bool = False

    def feed_delta(self, delta: dict) -> None:
        """A streamed chat delta: text, reasoning, and tool calls (their arguments come in pieces)."""
        self.content.append(delta.get("content") or "")
        self.reasoning.append(delta.get("reasoning_content") or "")
        for call in delta.get("tool_calls") or ():
            entry = self.tool_calls.setdefault(call["index"], {"id": None, "type": "function",
                                                               "function": {"name": None, "arguments": ""}})
            entry["id"] = call.get("id") or entry["id"]
            function = call.get("function") or {}
            entry["function"]["name"] = function.get("name") or entry["function"]["name"]
            entry["function"]["arguments"] += function.get("arguments") or ""


class Transcript:
    """One API request's answer as it is sent (streamed chunks or the whole response), recorded in the
    log once every choice has finished. A choice that fails in the engine never finishes: failed
    answers are not recorded."""

    def __init__(self, log: FeedbackLog, endpoint: str, base: dict, request: dict, choices):
        self._log, self._endpoint, self._base, self._request = log, endpoint, base, request
        self._choices = choices  # choices.Choices: generations (hidden EOS events, counts) and usage()
        self._records = [_ChoiceRecord() for _ in choices.generations]

    def chunks(self, chunks: Callable[[int, Piece], Iterable[dict]]) -> Callable[[int, Piece], Iterator]:
        """respond()'s `chunks`, also feeding the transcript."""

        def recorded(index: int, piece: Piece) -> Iterator[dict]:
            record = self._records[index]
            for chunk in chunks(index, piece):
                for choice in chunk["choices"]:
                    if self._endpoint == "chat":
                        record.feed_delta(choice.get("delta") or {})
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                yield chunk
            record.logprobs += [event.logprob for event in piece.events if event.logprob is not None]
            if self._endpoint == "completions":
                record.content.append(piece.text)  # the generated text alone (chunk text may echo the prompt)
            if piece.finish_reason:
                record.finished, record.finish_reason = True, record.finish_reason or piece.finish_reason
                if all(r.finished for r in self._records):
                    self._write(self._choices.usage())

        return recorded

    def response(self, response: Callable[[list], dict]) -> Callable[[list], dict]:
        """respond()'s `response`, also recording the answer it returns."""

        def recorded(results: list) -> dict:
            answer = response(results)
            for record, (text, events), choice in zip(self._records, results, answer["choices"], strict=True):
                record.logprobs = [event.logprob for event in events if event.logprob is not None]
                record.finish_reason = choice["finish_reason"]
                if self._endpoint == "chat":
                    message = choice["message"]
                    record.feed_delta({"content": message.get("content"),
                                       "reasoning_content": message.get("reasoning_content")})
                    record.tool_calls = dict(enumerate(message.get("tool_calls") or ()))
                else:
                    record.content = [text]
            self._write(answer["usage"])
            return answer

        return recorded

    def _write(self, usage: dict) -> None:
        try:
            self._log.record_interaction(self._record(usage))
        except Exception:  # noqa: BLE001 - recording must never break the answer
            logger.exception("feedback log: could not build the record of %s", self._base["id"])

    def _record(self, usage: dict) -> dict:
        n, choices, generations = self._choices.n, [], self._choices.generations
        for index, (record, generation) in enumerate(zip(self._records, generations, strict=True)):
            hidden = generation.hidden_event  # the EOS / stop token: generated, but not shown
            logprobs = record.logprobs + ([hidden.logprob] if hidden and hidden.logprob is not None else [])
            choices.append({"index": index, "prompt_index": index // n, "content": "".join(record.content),
                            "reasoning_content": "".join(record.reasoning) or None,
                            "tool_calls": [record.tool_calls[k] for k in sorted(record.tool_calls)] or None,
                            "finish_reason": record.finish_reason, "confidence": _mean(logprobs),
                            "completion_tokens": generation.completion_tokens})
        return {"type": "interaction", "id": self._base["id"], "created": self._base["created"],
                "model": self._base["model"], "endpoint": self._endpoint, "request": self._request,
                "choices": choices, "usage": usage}


def recording(log: FeedbackLog | None, endpoint: str, base: dict, request: dict, params: SamplingParams,
              choices, chunks, response):
    """(chunks, response) for choices.respond() that also record the answer in `log` once it has
    finished; unchanged when there is no log. request: the request's prompt part (messages and tools,
    or prompts); its sampling parameters are added from `params`."""
    if log is None:
        return chunks, response
    request = {**request, "sampling": sampling_record(params, choices.n)}
    transcript = Transcript(log, endpoint, base, request, choices)
    return transcript.chunks(chunks), transcript.response(response)
