"""The request error every layer raises and the API answers 400 (chat formats, the data pipeline's
chat rendering, the engine's validation), and how a client's value is quoted in a message."""

from __future__ import annotations


def shown(value, limit: int = 64) -> str:
    """repr(value) for an error message, cut to `limit` characters: a client's 1 MB value is not
    echoed back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class InvalidRequestError(ValueError):
    """A request parameter is out of range; the message names the parameter."""
