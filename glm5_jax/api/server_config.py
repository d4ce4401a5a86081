"""The server's own configuration file: model-id aliases, API keys and their rate limits.

The file is either an ml_collections Python file with `get_config()` (like everything in configs/,
see configs/serve_example.py) or a JSON object with the same fields:

    model_id         canonical model name ("" = the checkpoint directory's name or --model-id)
    model_aliases    other names clients may send as `model`; listed in /v1/models
    require_api_key  when keys are listed: true (default) accepts only those keys; false also
                     accepts any other key or none, at the default limits
    default_limits   {"requests_per_minute": int, "tokens_per_minute": int}; 0 = unlimited
    api_keys         [{"name": str, "key": str | "key_env": ENV_VAR, "requests_per_minute": int,
                       "tokens_per_minute": int}, ...]; a missing limit falls back to default_limits

It is read once into a frozen ServerConfig; a wrong field raises ServerConfigError naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TOP_LEVEL_FIELDS = ("model_id", "model_aliases", "require_api_key", "default_limits", "api_keys")
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute")
KEY_FIELDS = ("name", "key", "key_env", *LIMIT_FIELDS)


class ServerConfigError(ValueError):
    """The server config file is missing, malformed, or has a bad field (named in the message)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-key budgets over a sliding minute; None = unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclasses.dataclass(frozen=True)
class ApiKey:
    name: str  # shown in metrics and logs instead of the secret
    key: str = dataclasses.field(repr=False)
    limits: Limits = Limits()


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_id: str = ""
    model_aliases: tuple[str, ...] = ()
    require_api_key: bool = True
    default_limits: Limits = Limits()
    api_keys: tuple[ApiKey, ...] = ()


def _limit(value: Any, where: str) -> int | None:
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ServerConfigError(f"{where} must be a non-negative integer (0 = unlimited), got {value!r}")
    return value


def _limits(entry: Mapping[str, Any], where: str, fallback: Limits) -> Limits:
    values = {}
    for name in LIMIT_FIELDS:
        values[name] = _limit(entry[name], f"{where}.{name}") if name in entry else getattr(fallback, name)
    return Limits(**values)


def _check_fields(entry: Any, allowed: tuple[str, ...], where: str) -> Mapping[str, Any]:
    if not isinstance(entry, Mapping):
        raise ServerConfigError(f"{where} must be a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(allowed))
    if unknown:
        raise ServerConfigError(f"{where} has unknown field(s) {unknown}; allowed: {list(allowed)}")
    return entry


def _api_key(entry: Any, index: int, default: Limits) -> ApiKey:
    where = f"api_keys[{index}]"
    entry = _check_fields(entry, KEY_FIELDS, where)
    if ("key" in entry) == ("key_env" in entry):
        raise ServerConfigError(f"{where} needs exactly one of 'key' or 'key_env'")
    if "key_env" in entry:
        key = os.environ.get(str(entry["key_env"]))
        if not key:
            raise ServerConfigError(f"{where}.key_env: the environment variable {entry['key_env']!r} "
                                    "is not set")
    else:
        key = entry["key"]
    if not isinstance(key, str) or not key.strip() or key != key.strip():
        raise ServerConfigError(f"{where}.key must be a non-empty string without surrounding spaces")
    name = entry.get("name", f"key{index}")
    if not isinstance(name, str) or not name:
        raise ServerConfigError(f"{where}.name must be a non-empty string, got {name!r}")
    return ApiKey(name=name, key=key, limits=_limits(entry, where, default))


def parse_server_config(data: Mapping[str, Any]) -> ServerConfig:
    """A validated ServerConfig from a plain mapping (the file's content)."""
    data = _check_fields(data, TOP_LEVEL_FIELDS, "server config")
    model_id = data.get("model_id") or ""
    if not isinstance(model_id, str):
        raise ServerConfigError(f"model_id must be a string, got {model_id!r}")
    aliases = data.get("model_aliases") or ()
    if isinstance(aliases, str) or not all(isinstance(a, str) and a for a in aliases):
        raise ServerConfigError(f"model_aliases must be a list of non-empty strings, got {aliases!r}")
    require = data.get("require_api_key", True)
    if not isinstance(require, bool):
        raise ServerConfigError(f"require_api_key must be true or false, got {require!r}")
    default = _limits(_check_fields(data.get("default_limits") or {}, LIMIT_FIELDS, "default_limits"),
                      "default_limits", Limits())
    keys = tuple(_api_key(entry, i, default) for i, entry in enumerate(data.get("api_keys") or ()))
    for field, values in (("key", [k.key for k in keys]), ("name", [k.name for k in keys])):
        if len(set(values)) != len(values):
            raise ServerConfigError(f"api_keys: two entries have the same {field}")
    return ServerConfig(model_id=model_id, model_aliases=tuple(aliases), require_api_key=require,
                        default_limits=default, api_keys=keys)


def load_server_config(path: str | os.PathLike) -> ServerConfig:
    """Reads a `.json` file, or a Python file with get_config() (an ml_collections ConfigDict)."""
    path = Path(path)
    if not path.is_file():
        raise ServerConfigError(f"server config file {path} does not exist")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ServerConfigError(f"server config file {path} is not valid JSON: {exc}") from exc
    else:
        from glm5_jax.pyconfig import load_config_file  # ml_collections only when needed

        config = load_config_file(path)
        data = config.to_dict() if hasattr(config, "to_dict") else config
    try:
        return parse_server_config(data)
    except ServerConfigError as exc:
        raise ServerConfigError(f"{path}: {exc}") from None
