"""Server configuration from ``FURNACE_*`` environment variables.

Every value is parsed and checked once, at startup: a typo in a deployment should stop the
server with a message naming the variable, not surface later as a confusing request error.
Parsing does no I/O (the model path is not opened here; the backend factory does that).
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
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

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: What a request may hold unsent before it pauses (``FURNACE_MAX_RESPONSE_BYTES``).
DEFAULT_MAX_RESPONSE_BYTES = 1024 * 1024
#: JSON values (objects, arrays, strings, numbers, booleans, nulls; keys not counted) that
#: the schemas of one request may hold together (see server.schema_check). OpenAI's own
#: structured-output limits (5,000 properties, 1,000 enum values) fit schemas of this order.
DEFAULT_MAX_SCHEMA_NODES = 20_000


class ConfigError(ValueError):
    """An environment variable has an invalid value; the message names the variable."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything the HTTP server and the backend factory need to know.

    ``model is None`` means the embedded default model; ``model_name is None`` means the name
    the loader derives from the model. ``api_key is None`` disables authentication;
    ``admin_key`` guards ``/status`` instead of ``api_key`` when set.
    ``None`` for ``max_running``, ``max_step_tokens``, ``kv_cache_mb`` and ``max_context``
    lets the backend choose by device (see :mod:`furnace_trio.server.backend`).
    ``max_output_tokens`` caps every request's ``max_tokens`` and is the default where a
    request names none; ``None``: no cap, and a chat request without ``max_tokens`` may fill
    the context (OpenAI's behaviour), a completions request gets 16.
    """

    model: str | None = None
    model_name: str | None = None
    device: Device = "auto"
    dtype: str = "auto"
    api_key: str | None = None
    admin_key: str | None = None
    max_running: int | None = None
    max_waiting: int = 256
    # Sequences (prompts x n) one request may ask for, and JSON values in its schemas.
    max_sequences_per_request: int = 128
    max_schema_nodes: int = DEFAULT_MAX_SCHEMA_NODES
    max_step_tokens: int | None = None
    kv_cache_mb: int | None = None
    kv_cache_dtype: str = "auto"
    max_context: int | None = None
    max_output_tokens: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    log_level: str = "INFO"
    log_format: str = "text"
    tool_parser: str = "auto"
    quantization: str = "auto"
    session_ttl_s: float = 1800.0
    session_max_blocks: int | None = None
    max_sessions: int = 1024
    # Sessions and stored responses shared by replicas (``redis://...``); None: in-process.
    session_store: str | None = None
    prefix_cache: bool = True
    step_timeout_s: float = 120.0
    stream_interval: int = 1
    # All-decode steps on a GPU replayed from CUDA graphs (see furnace_trio.runtime.cuda_graphs).
    cuda_graphs: bool = True
    drain_timeout_s: float = 30.0
    exit_on_engine_failure: bool = False
    # The native CPU kernels (False: torch kernels only) and how they are built.
    native: bool = True
    native_build: NativeConfig = DEFAULT_NATIVE_CONFIG
    # Browser defences (furnace_trio.server.request_guard): extra Host names, CORS origins.
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.tool_parser not in TOOL_PARSERS:
            raise ConfigError(
                f"tool parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_parser!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"KV cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(
                f"log level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(
                f"log format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}"
            )
        for name in (
            "max_waiting",
            "max_body_bytes",
            "max_response_bytes",
            "stream_interval",
            "max_sequences_per_request",
            "max_schema_nodes",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.session_ttl_s <= 0:
            raise ConfigError("session_ttl_s must be > 0")
        if not self.step_timeout_s > 0:
            raise ConfigError("step_timeout_s must be > 0")
        if not self.drain_timeout_s >= 0:
            raise ConfigError("drain_timeout_s must be >= 0")
        if self.max_sessions < 1:
            raise ConfigError("max_sessions must be at least 1")
        if self.session_max_blocks is not None and self.session_max_blocks < 0:
            raise ConfigError("session_max_blocks must be >= 0")
        if self.session_store is not None and not self.session_store.startswith(
            SESSION_STORE_SCHEMES
        ):
            raise ConfigError(
                "FURNACE_SESSION_STORE must be a URL starting with "
                f"{' or '.join(SESSION_STORE_SCHEMES)}, got {self.session_store!r}"
            )
        for name in (
            "kv_cache_mb",
            "max_context",
            "max_output_tokens",
            "max_running",
            "max_step_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ServerConfig:
        """Read ``FURNACE_*`` variables; unset or empty means the default.

        Raises :class:`ConfigError` naming the variable on any invalid value.
        """

        def text(name: str) -> str | None:
            value = environ.get(name, "").strip()
            return value or None

        def integer(name: str) -> int | None:
            value = text(name)
            if value is None:
                return None
            try:
                number = int(value)
            except ValueError:
                raise ConfigError(f"{name} must be an integer, got {value!r}") from None
            if number < 1:
                raise ConfigError(f"{name} must be at least 1, got {number}")
            return number

        def choice(name: str, choices: tuple[str, ...], *, upper: bool = False) -> str | None:
            value = text(name)
            if value is None:
                return None
            value = value.upper() if upper else value.lower()
            if value not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
            return value

        defaults = cls()
        device = choice("FURNACE_DEVICE", DEVICES) or defaults.device
        max_running = integer("FURNACE_MAX_RUNNING")
        max_waiting = integer("FURNACE_MAX_WAITING")
        max_step_tokens = integer("FURNACE_MAX_STEP_TOKENS")
        max_body_bytes = integer("FURNACE_MAX_BODY_BYTES")
        max_response_bytes = integer("FURNACE_MAX_RESPONSE_BYTES")
        stream_interval = integer("FURNACE_STREAM_INTERVAL")
        return cls(
            model=text("FURNACE_MODEL"),
            model_name=text("FURNACE_MODEL_NAME"),
            device=device,  # type: ignore[arg-type]  # checked by choice()
            dtype=choice("FURNACE_DTYPE", DTYPES) or defaults.dtype,
            api_key=text("FURNACE_API_KEY"),
            admin_key=text("FURNACE_ADMIN_KEY"),
            max_running=max_running,
            max_waiting=max_waiting if max_waiting is not None else defaults.max_waiting,
            max_sequences_per_request=integer("FURNACE_MAX_SEQUENCES_PER_REQUEST")
            or defaults.max_sequences_per_request,
            max_schema_nodes=integer("FURNACE_MAX_SCHEMA_NODES") or defaults.max_schema_nodes,
            max_step_tokens=max_step_tokens,
            kv_cache_mb=integer("FURNACE_KV_CACHE_MB"),
            kv_cache_dtype=choice("FURNACE_KV_CACHE_DTYPE", KV_CACHE_DTYPES)
            or defaults.kv_cache_dtype,
            max_context=integer("FURNACE_MAX_CONTEXT"),
            max_output_tokens=integer("FURNACE_MAX_OUTPUT_TOKENS"),
            max_body_bytes=max_body_bytes
            if max_body_bytes is not None
            else defaults.max_body_bytes,
            max_response_bytes=max_response_bytes or defaults.max_response_bytes,
            log_level=choice("FURNACE_LOG_LEVEL", LOG_LEVELS, upper=True) or defaults.log_level,
            log_format=choice("FURNACE_LOG_FORMAT", LOG_FORMATS) or defaults.log_format,
            tool_parser=choice("FURNACE_TOOL_PARSER", TOOL_PARSERS) or defaults.tool_parser,
            quantization=choice("FURNACE_QUANT", QUANTIZATIONS) or defaults.quantization,
            session_ttl_s=_positive_float(environ, "FURNACE_SESSION_TTL_S", defaults.session_ttl_s),
            session_max_blocks=integer("FURNACE_SESSION_MAX_BLOCKS"),
            max_sessions=integer("FURNACE_MAX_SESSIONS") or defaults.max_sessions,
            session_store=text("FURNACE_SESSION_STORE"),
            prefix_cache=_flag(environ, "FURNACE_PREFIX_CACHE", defaults.prefix_cache),
            step_timeout_s=_positive_float(
                environ, "FURNACE_STEP_TIMEOUT_S", defaults.step_timeout_s
            ),
            stream_interval=stream_interval or defaults.stream_interval,
            cuda_graphs=_flag(environ, "FURNACE_CUDA_GRAPHS", defaults.cuda_graphs),
            drain_timeout_s=_positive_float(
                environ, "FURNACE_DRAIN_TIMEOUT_S", defaults.drain_timeout_s, allow_zero=True
            ),
            exit_on_engine_failure=_flag(
                environ, "FURNACE_EXIT_ON_ENGINE_FAILURE", defaults.exit_on_engine_failure
            ),
            native=_flag(environ, "FURNACE_NATIVE", defaults.native),
            native_build=_native_build(environ),
            allowed_hosts=_names(environ, "FURNACE_ALLOWED_HOSTS", origins=False),
            cors_origins=_names(environ, "FURNACE_CORS_ORIGINS", origins=True),
        )

    @property
    def sequences_per_request(self) -> int:
        """Most sequences (prompts x n) one request may ask for: a request larger than the
        whole queue (``max_waiting``) could never be queued, so that bounds it too."""
        return min(self.max_sequences_per_request, self.max_waiting)

    @property
    def log_level_number(self) -> int:
        return logging.getLevelName(self.log_level)  # type: ignore[no-any-return]


def _positive_float(
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


def _names(environ: Mapping[str, str], name: str, *, origins: bool) -> tuple[str, ...]:
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


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def _native_build(environ: Mapping[str, str]) -> NativeConfig:
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
