"""Live reload: read the configuration again (``POST /admin/reload``, SIGHUP) and apply
what can change while serving.

:func:`reload_config` reads the environment and the ``FURNACE_CONFIG`` file as startup does
(:func:`~furnace_trio.server.config_file.load_config`, in a worker thread), then applies
it on the Trio thread without awaiting, so no request sees half of it
(:func:`apply_config`):

- the settings in :data:`LIVE_FIELDS` take the new values: ``state.config`` (which each new
  request snapshots when it arrives, see :func:`~furnace_trio.server.asgi.request_config`),
  the body limit quart reads per request, the log level, and the engine's admission and
  session settings (:meth:`Engine.reconfigure <furnace_trio.engine.Engine.reconfigure>`);
- every other setting keeps its running value, and the ones the file or environment now
  set differently are reported as needing a restart;
- ``state.config_generation`` goes up by one.

A request keeps the configuration it arrived under: its API key, its ``max_tokens`` cap and
default, its body and response limits. Engine-wide limits (queue, batch, step tokens,
sessions) rule the engine's decisions from the reload on. An invalid file or value raises
:class:`~furnace_trio.server.config.ConfigError` before anything changed.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from dataclasses import dataclass

import trio
from quart_trio import QuartTrio

from furnace_trio.server.config import ConfigError, ServerConfig
from furnace_trio.server.config_file import LoadedConfig, load_config
from furnace_trio.server.log_setup import configure_logging
from furnace_trio.server.state import ServerState

__all__ = [
    "LIVE_FIELDS",
    "RELOAD_SCHEMA",
    "ReloadResult",
    "apply_config",
    "reload_config",
    "reload_on_sighup",
    "try_reload",
]

logger = logging.getLogger(__name__)

#: The :class:`ServerConfig` fields a reload changes; any other needs a restart.
LIVE_FIELDS = frozenset(
    {
        "api_key",
        "admin_key",
        "api_keys",
        "max_running",
        "max_waiting",
        "max_step_tokens",
        "max_sequences_per_request",
        "max_schema_nodes",
        "max_output_tokens",
        "max_body_bytes",
        "max_response_bytes",
        "session_ttl_s",
        "session_max_blocks",
        "max_sessions",
        "step_timeout_s",
        "drain_timeout_s",
        "exit_on_engine_failure",
        "log_level",
        "tool_parser",
        "allowed_hosts",
        "cors_origins",
    }
)


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """What a reload did: the configuration generation it made, the settings it changed,
    those that differ but need a restart, and the file's keys the environment overrides."""

    config_generation: int
    changed: tuple[str, ...]
    needs_restart: tuple[str, ...]
    shadowed_by_environment: tuple[str, ...]
    config_file: str | None

    def as_dict(self) -> dict[str, object]:
        return {
            "object": "config.reload",
            "config_generation": self.config_generation,
            "config_file": self.config_file,
            "changed": list(self.changed),
            "needs_restart": list(self.needs_restart),
            "shadowed_by_environment": list(self.shadowed_by_environment),
        }


_NAMES = {"type": "array", "items": {"type": "string"}}
#: The JSON Schema of the ``POST /admin/reload`` answer (:meth:`ReloadResult.as_dict`).
RELOAD_SCHEMA: dict[str, object] = {
    "type": "object",
    "required": [
        "object",
        "config_generation",
        "config_file",
        "changed",
        "needs_restart",
        "shadowed_by_environment",
    ],
    "additionalProperties": False,
    "properties": {
        "object": {"const": "config.reload"},
        "config_generation": {"type": "integer", "minimum": 2},
        "config_file": {"type": ["string", "null"]},
        "changed": {**_NAMES, "description": "Settings this reload changed."},
        "needs_restart": {
            **_NAMES,
            "description": "Settings the configuration now sets differently that only a "
            "restart applies (they keep their running values).",
        },
        "shadowed_by_environment": {
            **_NAMES,
            "description": "Keys of the file that environment variables override.",
        },
    },
}


def _differs(old: ServerConfig, new: ServerConfig, names: object) -> tuple[str, ...]:
    return tuple(
        f.name
        for f in dataclasses.fields(ServerConfig)
        if f.name in names and getattr(old, f.name) != getattr(new, f.name)  # type: ignore[operator]
    )


async def reload_config(app: QuartTrio, state: ServerState) -> ReloadResult:
    """Read the configuration again (the file in a worker thread) and apply its live
    settings (:func:`apply_config`). Raises :class:`ConfigError`: nothing changed."""
    loaded = await trio.to_thread.run_sync(load_config)
    return apply_config(app, state, loaded)


def apply_config(app: QuartTrio, state: ServerState, loaded: LoadedConfig) -> ReloadResult:
    """Apply the live settings of ``loaded`` (see the module docstring), all or none.

    Raises :class:`ConfigError` (nothing changed) on a value the engine refuses. Never
    awaits, so no request sees half of a reload."""
    from furnace_trio.server.backend import engine_config

    old = state.config if state.config is not None else ServerConfig()
    new = loaded.config
    every = {f.name for f in dataclasses.fields(ServerConfig)}
    needs_restart = _differs(old, new, every - LIVE_FIELDS)
    applied = dataclasses.replace(old, **{name: getattr(new, name) for name in LIVE_FIELDS})
    backend = state.backend
    engine_settings = None
    if backend is not None:
        device = backend.device_type
        try:
            before, after = engine_config(old, device), engine_config(applied, device)
            changes = {
                f.name: getattr(after, f.name)
                for f in dataclasses.fields(after)
                if getattr(after, f.name) != getattr(before, f.name)
            }
            engine_settings = dataclasses.replace(backend.engine.config, **changes)
        except ValueError as exc:  # EngineConfig's own checks
            where = applied.config_file or "the environment"
            raise ConfigError(f"{where}: {exc}") from None
    # Nothing below raises: the new configuration applies whole.
    if backend is not None and engine_settings is not None:
        backend.engine.reconfigure(engine_settings)
        backend.max_output_tokens = applied.max_output_tokens
    state.config = applied
    app.config["MAX_CONTENT_LENGTH"] = applied.max_body_bytes
    if applied.log_level != old.log_level:
        configure_logging(applied.log_level, applied.log_format)
    state.config_generation += 1
    result = ReloadResult(
        config_generation=state.config_generation,
        changed=_differs(old, applied, LIVE_FIELDS),
        needs_restart=needs_restart,
        shadowed_by_environment=loaded.shadowed,
        config_file=applied.config_file,
    )
    logger.info(
        "configuration reloaded (generation %d): changed %s; needs a restart to change: %s%s",
        result.config_generation,
        ", ".join(result.changed) or "nothing",
        ", ".join(result.needs_restart) or "nothing",
        "; set in the environment, over the file: " + ", ".join(result.shadowed_by_environment)
        if result.shadowed_by_environment
        else "",
    )
    return result


async def try_reload(app: QuartTrio, state: ServerState, trigger: str) -> ReloadResult | None:
    """:func:`reload_config`, an invalid configuration logged (with why) instead of raised."""
    try:
        return await reload_config(app, state)
    except ConfigError as exc:
        logger.error("%s: the configuration was not reloaded, nothing changed: %s", trigger, exc)
        return None


async def reload_on_sighup(
    app: QuartTrio,
    state: ServerState,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Reload at every SIGHUP to this process, until cancelled.

    Signals reach only the main thread's Trio run: an app served from another thread (an
    embedding application) logs that SIGHUP does not reload, and reloads by
    ``POST /admin/reload`` alone."""
    if threading.current_thread() is not threading.main_thread():
        logger.warning("SIGHUP will not reload the configuration: not served on the main thread")
        task_status.started()
        return
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            await try_reload(app, state, "SIGHUP")
