"""Errors every layer raises: a bad configuration field (ConfigError), a request that cannot be
served as given (InvalidRequestError: chat formats, the data pipeline's chat rendering, the
engine's validation; the API answers 400), and how a client's value is quoted in a message."""

from __future__ import annotations


def shown(value, limit: int = 64) -> str:
    """repr(value) for an error message, cut to `limit` characters: a client's 1 MB value is not
    echoed back."""
    text = repr(value)
    size = len(value) if isinstance(value, str) else len(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({size} characters)"


class InvalidRequestError(ValueError):
    """A request parameter is out of range; the message names the parameter."""


class ConfigError(ValueError):
    """A configuration field has an invalid value; the message names the field."""
