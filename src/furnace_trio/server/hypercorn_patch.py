"""Two changes to hypercorn's Trio worker, so that ``hypercorn -c hypercorn.toml
furnace_trio.app:app`` stops as gracefully as ``python -m furnace_trio.server.serve``.

:func:`install` applies them when :mod:`furnace_trio.app` is imported, which is what each
hypercorn worker process does before it serves. They replace functions of hypercorn
0.18.0 (:data:`PATCHED_VERSION`) whose bodies they depend on; under any other version
:func:`install` changes nothing and logs a warning, and the server then stops the way that
hypercorn does.

1. **Drain before stopping** (``hypercorn.trio.run.worker_serve``). Hypercorn stops
   listening as soon as it is told to stop (the master process's shutdown event; a
   SIGINT in a single-process server), gives connections ``graceful_timeout``, cancels
   what is left (a stream then ends without an error event or a terminating chunk) and
   only then calls the app's ``after_serving``. With ``workers >= 1`` the worker has no
   signal handler of its own: a SIGTERM sent to the whole process group (systemd's
   default) kills it at once. The patched worker's shutdown trigger waits for the first
   of hypercorn's own trigger and a SIGTERM or SIGINT to this process, then runs the
   app's drain (:func:`~furnace_trio.server.lifecycle.drain_then`: 503 with
   ``Retry-After`` to new requests while hypercorn still accepts them, requests in flight
   finish or end with an error), and only then lets hypercorn stop. A repeated SIGTERM is
   ignored (see :func:`~furnace_trio.server.lifecycle.signalled`).
2. **A deadline for sends** (``hypercorn.trio.tcp_server.TCPServer.run``). Hypercorn
   shields each socket write from cancellation and has no write timeout, so a client that
   stops reading holds a write, its connection and the whole shutdown open for good. When
   hypercorn cancels a connection at the end of ``graceful_timeout``, the patched server
   closes its socket, which fails the blocked write (Trio wakes a task waiting on a closed
   socket with an error; a shield does not stop that), and the worker exits.

Apps other than furnace-trio's served by a patched worker are served as by an unpatched one.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from quart_trio import QuartTrio

from furnace_trio.server.lifecycle import drain_then, signalled
from furnace_trio.server.state import STATE_KEY

logger = logging.getLogger(__name__)

#: The hypercorn version whose Trio worker these patches were written and tested against.
PATCHED_VERSION = "0.18.0"
_MARK = "__furnace_trio_patched__"

Trigger = Callable[[], Awaitable[object]]


def install() -> bool:
    """Patch hypercorn's Trio worker if it is :data:`PATCHED_VERSION`; whether it is
    patched. Idempotent."""
    version = importlib.metadata.version("hypercorn")
    if version != PATCHED_VERSION:
        logger.warning(
            "hypercorn %s is not %s, the version furnace-trio patches: its Trio worker is "
            "left as it is, so SIGTERM will not drain (use python -m furnace_trio.server.serve) "
            "and a client that stops reading can hold shutdown open",
            version,
            PATCHED_VERSION,
        )
        return False
    import hypercorn.trio.run as run_module
    import hypercorn.trio.tcp_server as tcp_module

    if not getattr(run_module.worker_serve, _MARK, False):
        run_module.worker_serve = _draining(run_module.worker_serve)  # type: ignore[assignment]
    server = tcp_module.TCPServer
    if not getattr(server.run, _MARK, False):
        server.run = _closing_when_cancelled(server.run)  # type: ignore[method-assign,assignment]
    return True


def _mark(function: Any) -> Any:
    setattr(function, _MARK, True)
    return function


def _draining(worker_serve: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    @functools.wraps(worker_serve)
    async def draining_worker_serve(
        app: Any,
        config: Any,
        *,
        sockets: Any = None,
        shutdown_trigger: Trigger | None = None,
        task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        inner = getattr(app, "app", None)  # hypercorn's wrapper around the ASGI app
        if isinstance(inner, QuartTrio) and STATE_KEY in inner.extensions:
            triggers: list[Trigger] = [signalled]
            if shutdown_trigger is not None:
                triggers.append(shutdown_trigger)
            shutdown_trigger = drain_then(inner, functools.partial(_first_of, triggers))
        await worker_serve(
            app, config, sockets=sockets, shutdown_trigger=shutdown_trigger, task_status=task_status
        )

    return _mark(draining_worker_serve)  # type: ignore[no-any-return]


async def _first_of(triggers: list[Trigger]) -> None:
    """Return when the first of ``triggers`` returns (the others are cancelled)."""
    async with trio.open_nursery() as nursery:

        async def wait(trigger: Trigger) -> None:
            await trigger()
            nursery.cancel_scope.cancel()

        for trigger in triggers:
            nursery.start_soon(wait, trigger)


def _closing_when_cancelled(
    run: Callable[[Any], Awaitable[None]],
) -> Callable[[Any], Awaitable[None]]:
    @functools.wraps(run)
    async def run_closing_when_cancelled(server: Any) -> None:
        finished = False

        async def close_when_cancelled() -> None:
            try:
                await trio.sleep_forever()
            finally:
                if not finished:  # the connection itself was cancelled, not just ended
                    _close_socket(server.stream)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_when_cancelled)
            try:
                await run(server)
            finally:
                finished = True
                nursery.cancel_scope.cancel()

    return _mark(run_closing_when_cancelled)  # type: ignore[no-any-return]


def _close_socket(stream: Any) -> None:
    """Close the socket under a (TLS or plain) Trio stream; a write blocked on it fails."""
    transport = getattr(stream, "transport_stream", stream)
    sock = getattr(transport, "socket", None)
    if sock is not None:
        sock.close()
