"""Parsers of ``FURNACE_*`` values for :meth:`furnace_trio.server.config.ServerConfig.from_env`:
each reads one variable (or, for the native kernels' build, a few) and raises
:class:`ConfigError` naming it when the value is invalid."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from furnace_trio.runtime.native.config import DEFAULT_NATIVE_CONFIG, NativeConfig

Device = Literal["cpu", "cuda", "auto"]
DEVICES: tuple[str, ...] = ("cpu", "cuda", "auto")
DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "int8", "q4")  # as quant.QUANTIZATIONS
#: KV cache dtypes (``FURNACE_KV_CACHE_DTYPE``), as runner.KV_DTYPES.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "model", "float16", "int8")
LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: ``FURNACE_LOG_FORMAT``: lines for a person, or one JSON object a line for a collector.
LOG_FORMATS: tuple[str, ...] = ("text", "json")
#: Tool-call output formats (``auto``: from the model's chat template, see docs/tools.md).
TOOL_PARSERS: tuple[str, ...] = ("auto", "hermes", "llama3", "mistral")
#: ``FURNACE_SESSION_STORE``: the URL schemes of the Redis client (Redis or Valkey).
SESSION_STORE_SCHEMES: tuple[str, ...] = ("redis://", "rediss://", "unix://")
#: Speculative decoding (``FURNACE_SPECULATIVE``): furnace_trio.engine.speculation.METHODS,
#: with ``mtp`` (the model's multi-token-prediction layer) for the engine's ``draft``.
SPECULATIVE_METHODS: tuple[str, ...] = ("off", "ngram", "mtp")
#: ``FURNACE_SPECULATIVE=draft:<path>``: a draft model (GGUF file or Hugging Face directory).
SPECULATIVE_DRAFT = "draft:"

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: What a request may hold unsent before it pauses (``FURNACE_MAX_RESPONSE_BYTES``).
DEFAULT_MAX_RESPONSE_BYTES = 1024 * 1024
#: JSON values (objects, arrays, strings, numbers, booleans, nulls; keys not counted) that
#: the schemas of one request may hold together (see server.schema_check). OpenAI's own
#: structured-output limits (5,000 properties, 1,000 enum values) fit schemas of this order.
DEFAULT_MAX_SCHEMA_NODES = 20_000


class ConfigError(ValueError):
    """An environment variable has an invalid value; the message names the variable."""


def positive_float(
    environ: Mapping[str, str], name: str, default: float, *, allow_zero: bool = False
) -> float:
    value = environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if allow_zero and number == 0:
        return number
    if not (number > 0 and number != float("inf")):
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return number


def names(environ: Mapping[str, str], name: str, *, origins: bool) -> tuple[str, ...]:
    """A comma-separated list, lowercase: host names or origins (``scheme://host[:port]``,
    checked here); ``*`` stands for any."""
    out = []
    for item in environ.get(name, "").split(","):
        value = item.strip().lower()
        if origins and value not in ("", "*"):
            value = value.rstrip("/")
            scheme, sep, rest = value.partition("://")
            if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
                raise ConfigError(f"{name}: {item.strip()!r} is not an origin like https://host")
        if value:
            out.append(value)
    return tuple(out)


def flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def native_build(environ: Mapping[str, str]) -> NativeConfig:
    """``FURNACE_NATIVE_FLAGS`` (shell words), ``FURNACE_CACHE_DIR`` (else
    ``$XDG_CACHE_HOME/furnace-trio``) and ``CC``: how the native kernels are built."""
    try:
        flags = tuple(shlex.split(environ.get("FURNACE_NATIVE_FLAGS", "")))
    except ValueError as exc:
        raise ConfigError(f"FURNACE_NATIVE_FLAGS must be shell words: {exc}") from None
    cache_dir = environ.get("FURNACE_CACHE_DIR", "").strip()
    xdg = environ.get("XDG_CACHE_HOME", "").strip()
    return NativeConfig(
        flags=flags,
        cache_dir=Path(cache_dir) if cache_dir else Path(xdg) / "furnace-trio" if xdg else None,
        compiler=environ.get("CC", "").strip() or DEFAULT_NATIVE_CONFIG.compiler,
    )
