"""The app's lifecycle: start the backend, supervise the engine, drain and stop.

- ``before_serving`` (:func:`start_backend`) reads the configuration (from the environment
  and the ``FURNACE_CONFIG`` file unless one was given), runs the blocking backend factory
  in a worker thread and starts the engine in ``app.nursery`` with ``nursery.start``, so
  hypercorn accepts connections only once the model is ready. It also starts the SIGHUP
  listener that reloads the configuration (:mod:`~furnace_trio.server.reload`), which
  :func:`stop_backend` cancels.
- The engine runs under a supervisor (:func:`_supervise_engine`): if it dies (or its step
  watchdog fires), ``/health`` and every new request answer 503, and streams in flight end
  with an SSE error event; with ``exit_on_engine_failure`` the process then exits with
  :data:`ENGINE_FAILURE_EXIT`. ``after_serving`` (:func:`stop_backend`) drains, shuts the
  engine down and cancels it explicitly (quart-trio would wait 5 s for it otherwise).
- Once the engine runs, the startup heap (the libraries, the model's Python objects, the
  tokenizer) is frozen out of the cyclic garbage collector (``gc.freeze``, as vLLM and
  SGLang do): a full collection over it took about 155 ms on the default model, a stall
  of every stream while it held the GIL. :func:`stop_backend` thaws it, so that an app
  built and stopped in a long-lived process (tests) leaves nothing behind.
- Drain (:func:`drain`): stop admitting (503 with ``Retry-After``, ``/health`` 503), let
  requests in flight finish for ``drain_timeout_s``, then fail the rest (an SSE error
  event or a 503 error object, never a silent cut). Hypercorn calls ``after_serving`` only
  once its connections are closed, so a server that wants the drain to cover requests in
  flight runs it *before* telling hypercorn to stop: :func:`drain_then` wraps a
  ``shutdown_trigger`` (``python -m furnace_trio.server.serve`` does this on SIGTERM/SIGINT,
  and so does a hypercorn worker patched by :mod:`~furnace_trio.server.hypercorn_patch`).
"""

from __future__ import annotations

import gc
import logging
import signal
from collections.abc import Awaitable, Callable

import trio
from quart_trio import QuartTrio

from furnace_trio.server.config_file import load_config
from furnace_trio.server.log_setup import configure_logging
from furnace_trio.server.reload import reload_on_sighup
from furnace_trio.server.state import STATE_KEY, ServerState

logger = logging.getLogger(__name__)

#: Exit status when the engine failed and ``exit_on_engine_failure`` is set.
ENGINE_FAILURE_EXIT = 3
#: After the engine failed, how long handlers get to write their error events before exit.
EXIT_GRACE_S = 1.0
#: After a drain cancelled what was left, how long handlers get to write their errors.
CANCEL_GRACE_S = 2.0


async def start_backend(app: QuartTrio, state: ServerState) -> None:
    """Configure, load the backend in a worker thread, start the supervised engine."""
    shadowed: tuple[str, ...] = ()
    if state.config is None:
        loaded = load_config()
        state.config, shadowed = loaded.config, loaded.shadowed
    cfg = state.config
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    configure_logging(cfg.log_level, cfg.log_format)
    if cfg.config_file is not None:
        logger.info(
            "settings from %s%s",
            cfg.config_file,
            f"; set in the environment, over the file: {', '.join(shadowed)}" if shadowed else "",
        )
    factory = state.backend_factory
    if factory is None:
        from furnace_trio.server.backend import load_backend

        factory = load_backend
    state.backend = await trio.to_thread.run_sync(factory, cfg)
    if cfg.session_store is not None:
        await _open_shared_sessions(app, state, cfg.session_store)
    await app.nursery.start(_supervise_engine, state)
    await app.nursery.start(_reload_on_sighup, app, state)
    gc.collect()
    gc.freeze()
    logger.info(
        "serving %s (context %d tokens; %d startup objects frozen out of the collector)",
        state.backend.model_name,
        state.backend.max_context,
        gc.get_freeze_count(),
    )


async def _open_shared_sessions(app: QuartTrio, state: ServerState, url: str) -> None:
    """Sessions shared with other replicas through the store at ``url``; it must answer."""
    from furnace_trio.server.redis_store import RedisStore
    from furnace_trio.server.shared_sessions import SharedSessions

    assert state.backend is not None  # loaded just before; not user input
    store = RedisStore(url, ttl_s=state.backend.engine.sessions.ttl_s)
    shared = SharedSessions(store)
    await shared.check()
    await app.nursery.start(shared.serve)
    state.shared = shared
    logger.info("sessions shared through %s", url.split("@")[-1])


async def stop_backend(state: ServerState) -> None:
    """Drain, shut the engine down and cancel it, thaw the startup heap."""
    await drain(state)
    if state.shared is not None:
        await state.shared.stop()
    backend = state.backend
    if backend is not None:
        backend.engine.shutdown()
    if state.engine_scope is not None:
        state.engine_scope.cancel()
    if state.background is not None:
        state.background.cancel()
    gc.unfreeze()


async def _reload_on_sighup(
    app: QuartTrio, state: ServerState, *, task_status: trio.TaskStatus[None]
) -> None:
    with trio.CancelScope() as scope:
        state.background = scope
        await reload_on_sighup(app, state, task_status=task_status)


async def _supervise_engine(
    state: ServerState, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the engine; record its death instead of letting it escape ``app.nursery``.

    An exception escaping quart-trio's lifespan nursery is only logged while the server
    keeps answering, so the supervisor keeps the state ``/health`` and handlers look at.
    A failure before ``task_status.started`` propagates: the server then fails to start.
    """
    assert state.backend is not None  # set just before; not user input
    engine = state.backend.engine
    started = False

    async def run_engine(*, task_status: trio.TaskStatus[None]) -> None:
        await engine.run(task_status=task_status)

    failed = False
    with trio.CancelScope() as scope:
        state.engine_scope = scope
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(run_engine)
                started = True
                state.engine_running = True
                task_status.started()
        except Exception as exc:
            if not started:
                raise
            failed = True
            state.engine_failure = f"the engine failed: {exc!r}"
            logger.exception("the engine task died; answering 503 from now on")
        finally:
            state.engine_running = False
            if state.engine_failure is None:
                state.engine_failure = engine.failure or "the engine has stopped"
            if engine.failure is not None and not scope.cancel_called:
                failed = True
                logger.error("the engine stopped: %s; answering 503 from now on", engine.failure)
    if failed and state.config is not None and state.config.exit_on_engine_failure:
        logger.critical(
            "exiting with status %d so that a supervisor restarts the server",
            ENGINE_FAILURE_EXIT,
        )
        try:
            await trio.sleep(EXIT_GRACE_S)  # streams in flight write their error events
        finally:
            logging.shutdown()
            state.exit_process(ENGINE_FAILURE_EXIT)


async def drain(state: ServerState, drain_timeout_s: float | None = None) -> None:
    """Stop admitting, let requests in flight finish for ``drain_timeout_s`` (default: the
    configured one), then fail whatever is left and give the handlers a moment to send
    their errors. Idempotent; bounded by ``drain_timeout_s + CANCEL_GRACE_S``.

    New generation requests get 503 with ``Retry-After`` (a load balancer sends them to
    another replica); ``/health`` answers 503 so that it stops routing here.
    """
    first = not state.draining
    state.draining = True
    backend = state.backend
    if backend is None:
        return
    engine = backend.engine
    engine.drain()
    if drain_timeout_s is None:
        drain_timeout_s = state.config.drain_timeout_s if state.config is not None else 0.0
    if first:
        logger.info("draining: %d HTTP requests in flight", state.in_flight)
    with trio.move_on_after(drain_timeout_s):
        if state.in_flight:
            await state.no_requests.wait()
    cancelled = engine.cancel_all("the server is shutting down")
    if cancelled:
        logger.warning("drain deadline passed: cancelled %d requests", cancelled)
        with trio.move_on_after(CANCEL_GRACE_S):
            if state.in_flight:
                await state.no_requests.wait()


async def signalled() -> None:
    """Return at the first SIGTERM or SIGINT to this process (a shutdown trigger).

    Afterwards SIGTERM is ignored, so that the drain runs to its own deadline: the same
    SIGTERM often arrives twice (``timeout(1)`` and some supervisors signal the process,
    then its group), and a supervisor that gives up sends SIGKILL. SIGINT gets its previous
    handling again, so a second Ctrl+C in a terminal still interrupts.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            logger.warning("received %s: draining", signal.Signals(signum).name)
            break
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def drain_then(
    app: QuartTrio, trigger: Callable[[], Awaitable[object]]
) -> Callable[[], Awaitable[None]]:
    """A hypercorn ``shutdown_trigger``: wait for ``trigger``, drain, then return (and so
    let hypercorn stop listening and close connections, with nothing left in flight)."""
    state: ServerState = app.extensions[STATE_KEY]

    async def shutdown_trigger() -> None:
        await trigger()
        await drain(state)

    return shutdown_trigger
