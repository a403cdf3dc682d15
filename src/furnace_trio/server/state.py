"""What the app knows about its backend, shared by the lifecycle, the ASGI wrapper and the
routes: :class:`ServerState`, kept in ``app.extensions[STATE_KEY]``.

Touched only on the Trio thread. Every handler asks it for the backend
(:meth:`ServerState.serving_backend`), which answers 503 while the engine is not running
or the server drains, so no route has its own idea of whether the server serves.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from furnace_trio.server.api_keys import KeyUsage
from furnace_trio.server.config import ServerConfig
from furnace_trio.server.errors import APIError
from furnace_trio.server.off_loop import OffLoop
from furnace_trio.tools.grammar import GrammarCompiler

if TYPE_CHECKING:
    from furnace_trio.server.backend import Backend
    from furnace_trio.server.shared_sessions import SharedSessions

BackendFactory = Callable[[ServerConfig], "Backend"]
STATE_KEY = "furnace_trio"
BUSY_RETRY_AFTER_S = 1


@dataclass(slots=True)
class ServerState:
    """What the app knows about its backend; touched only on the Trio thread.

    ``backend`` is set once the factory returned; ``engine_running`` is true exactly while
    the supervised engine task runs; ``engine_failure`` keeps why it stopped.
    """

    config: ServerConfig | None
    backend_factory: BackendFactory | None
    backend: Backend | None = None
    engine_running: bool = False
    engine_failure: str | None = None
    engine_scope: trio.CancelScope | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    http_responses: Counter[int] = field(default_factory=Counter)
    tool_call_fallbacks: Counter[str] = field(default_factory=Counter)

    grammar: GrammarCompiler | None = None
    # Sessions shared with other replicas (FURNACE_SESSION_STORE); None: in-process only.
    shared: SharedSessions | None = None
    off_loop: OffLoop = field(default_factory=OffLoop)  # threads for client-chosen work
    draining: bool = False
    in_flight: int = 0  # HTTP requests inside the app right now
    no_requests: trio.Event = field(default_factory=trio.Event)  # set while in_flight == 0
    exit_process: Callable[[int], object] = os._exit  # tests inject a recorder
    # Bumped by each reload that applied a configuration (server.reload); 1 at startup.
    config_generation: int = 1
    api_keys: KeyUsage = field(default_factory=KeyUsage)  # requests per API key name
    background: trio.CancelScope | None = None  # the SIGHUP listener (server.lifecycle)

    def serving_backend(self) -> Backend:
        """The backend if its engine is running, else a 503 :class:`APIError`."""
        if self.draining:
            raise shutting_down()
        backend = self.backend
        if backend is None or not self.engine_running or not backend.engine.alive:
            reason = self.engine_failure or "the engine is not running"
            raise APIError(503, f"The server cannot serve requests: {reason}", code="unavailable")
        return backend


def shutting_down() -> APIError:
    return APIError(
        503,
        "The server is shutting down. Retry shortly.",
        code="shutting_down",
        headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
    )
