"""Reading :class:`~furnace_trio.server.config.ServerConfig`'s settings from ``FURNACE_*``
variables, and checking a configuration's values: the code behind the declarations of
:mod:`furnace_trio.server.config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from furnace_trio.server.api_keys import accepted_keys
from furnace_trio.server.config_values import (
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    LOG_FORMATS,
    LOG_LEVELS,
    QUANTIZATIONS,
    SESSION_STORE_SCHEMES,
    SPECULATIVE_DRAFT,
    SPECULATIVE_METHODS,
    TOOL_PARSERS,
    ConfigError,
    flag,
    names,
    native_build,
    positive_float,
)

if TYPE_CHECKING:
    from furnace_trio.server.config import ServerConfig


def environment_values(environ: Mapping[str, str], defaults: ServerConfig) -> dict[str, Any]:
    """The fields that ``FURNACE_*`` variables in ``environ`` give, unset or empty ones as in
    ``defaults``; raises :class:`ConfigError` naming the variable on any invalid value."""

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

    device = choice("FURNACE_DEVICE", DEVICES) or defaults.device
    max_running = integer("FURNACE_MAX_RUNNING")
    max_waiting = integer("FURNACE_MAX_WAITING")
    max_step_tokens = integer("FURNACE_MAX_STEP_TOKENS")
    max_body_bytes = integer("FURNACE_MAX_BODY_BYTES")
    max_response_bytes = integer("FURNACE_MAX_RESPONSE_BYTES")
    stream_interval = integer("FURNACE_STREAM_INTERVAL")
    return dict(
        model=text("FURNACE_MODEL"),
        model_name=text("FURNACE_MODEL_NAME"),
        device=device,
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
        kv_cache_dtype=choice("FURNACE_KV_CACHE_DTYPE", KV_CACHE_DTYPES) or defaults.kv_cache_dtype,
        max_context=integer("FURNACE_MAX_CONTEXT"),
        max_output_tokens=integer("FURNACE_MAX_OUTPUT_TOKENS"),
        max_body_bytes=max_body_bytes if max_body_bytes is not None else defaults.max_body_bytes,
        max_response_bytes=max_response_bytes or defaults.max_response_bytes,
        log_level=choice("FURNACE_LOG_LEVEL", LOG_LEVELS, upper=True) or defaults.log_level,
        log_format=choice("FURNACE_LOG_FORMAT", LOG_FORMATS) or defaults.log_format,
        tool_parser=choice("FURNACE_TOOL_PARSER", TOOL_PARSERS) or defaults.tool_parser,
        quantization=choice("FURNACE_QUANT", QUANTIZATIONS) or defaults.quantization,
        session_ttl_s=positive_float(environ, "FURNACE_SESSION_TTL_S", defaults.session_ttl_s),
        session_max_blocks=integer("FURNACE_SESSION_MAX_BLOCKS"),
        max_sessions=integer("FURNACE_MAX_SESSIONS") or defaults.max_sessions,
        prefix_cache=flag(environ, "FURNACE_PREFIX_CACHE", defaults.prefix_cache),
        step_timeout_s=positive_float(environ, "FURNACE_STEP_TIMEOUT_S", defaults.step_timeout_s),
        stream_interval=stream_interval or defaults.stream_interval,
        speculative=_speculative(environ) or defaults.speculative,
        speculative_tokens=integer("FURNACE_SPECULATIVE_TOKENS") or defaults.speculative_tokens,
        speculative_max_batch=integer("FURNACE_SPECULATIVE_MAX_BATCH")
        or defaults.speculative_max_batch,
        # unset or 0: no pacing
        target_itl_ms=positive_float(environ, "FURNACE_TARGET_ITL_MS", 0.0, allow_zero=True)
        or None,
        cuda_graphs=flag(environ, "FURNACE_CUDA_GRAPHS", defaults.cuda_graphs),
        drain_timeout_s=positive_float(
            environ, "FURNACE_DRAIN_TIMEOUT_S", defaults.drain_timeout_s, allow_zero=True
        ),
        exit_on_engine_failure=flag(
            environ, "FURNACE_EXIT_ON_ENGINE_FAILURE", defaults.exit_on_engine_failure
        ),
        native=flag(environ, "FURNACE_NATIVE", defaults.native),
        native_build=native_build(environ),
        allowed_hosts=names(environ, "FURNACE_ALLOWED_HOSTS", origins=False),
        cors_origins=names(environ, "FURNACE_CORS_ORIGINS", origins=True),
        config_file=text("FURNACE_CONFIG"),
        session_store=text("FURNACE_SESSION_STORE"),
    )


def check_values(config: ServerConfig) -> None:
    """Raise :class:`ConfigError` when a field's value is out of its range."""
    if config.device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {config.device!r}")
    if config.dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    if config.tool_parser not in TOOL_PARSERS:
        raise ConfigError(
            f"tool parser must be one of {', '.join(TOOL_PARSERS)}, got {config.tool_parser!r}"
        )
    if config.quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {config.quantization!r}"
        )
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"KV cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
            f"got {config.kv_cache_dtype!r}"
        )
    if config.log_level not in LOG_LEVELS:
        raise ConfigError(
            f"log level must be one of {', '.join(LOG_LEVELS)}, got {config.log_level!r}"
        )
    if config.log_format not in LOG_FORMATS:
        raise ConfigError(
            f"log format must be one of {', '.join(LOG_FORMATS)}, got {config.log_format!r}"
        )
    for name in (
        "max_waiting",
        "max_body_bytes",
        "max_response_bytes",
        "stream_interval",
        "max_sequences_per_request",
        "max_schema_nodes",
        "speculative_tokens",
        "speculative_max_batch",
    ):
        if getattr(config, name) < 1:
            raise ConfigError(f"{name} must be at least 1")
    if config.session_ttl_s <= 0:
        raise ConfigError("session_ttl_s must be > 0")
    if not config.step_timeout_s > 0:
        raise ConfigError("step_timeout_s must be > 0")
    if config.session_store is not None and not config.session_store.startswith(
        SESSION_STORE_SCHEMES
    ):
        raise ConfigError(
            "FURNACE_SESSION_STORE must be a URL starting with "
            f"{' or '.join(SESSION_STORE_SCHEMES)}, got {config.session_store!r}"
        )
    if config.speculative not in SPECULATIVE_METHODS and not draft_model_path(config.speculative):
        raise ConfigError(
            f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} or "
            f"{SPECULATIVE_DRAFT}<path>, got {config.speculative!r}"
        )
    if config.target_itl_ms is not None and not 0 < config.target_itl_ms < float("inf"):
        raise ConfigError("target_itl_ms must be a finite number > 0")
    if not config.drain_timeout_s >= 0:
        raise ConfigError("drain_timeout_s must be >= 0")
    if config.max_sessions < 1:
        raise ConfigError("max_sessions must be at least 1")
    if config.session_max_blocks is not None and config.session_max_blocks < 0:
        raise ConfigError("session_max_blocks must be >= 0")
    for name in (
        "kv_cache_mb",
        "max_context",
        "max_output_tokens",
        "max_running",
        "max_step_tokens",
    ):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1")
    try:
        accepted_keys(config.api_key, config.api_keys)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _speculative(environ: Mapping[str, str]) -> str | None:
    """``FURNACE_SPECULATIVE``: a method of :data:`SPECULATIVE_METHODS` (any case), or
    ``draft:<path>`` (the path as given), or unset."""
    value = environ.get("FURNACE_SPECULATIVE", "").strip()
    if not value:
        return None
    method, _, path = value.partition(":")
    if method.lower() == SPECULATIVE_DRAFT[:-1] and path.strip():
        return SPECULATIVE_DRAFT + path.strip()
    if value.lower() not in SPECULATIVE_METHODS:
        raise ConfigError(
            f"FURNACE_SPECULATIVE must be one of {', '.join(SPECULATIVE_METHODS)} or "
            f"{SPECULATIVE_DRAFT}<path of a model with the same tokenizer>, got {value!r}"
        )
    return value.lower()


def draft_model_path(speculative: str) -> str | None:
    """The draft model's path of a ``FURNACE_SPECULATIVE`` value, ``None`` for a method."""
    if speculative.startswith(SPECULATIVE_DRAFT):
        return speculative[len(SPECULATIVE_DRAFT) :].strip() or None
    return None
