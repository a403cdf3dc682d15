"""The quart-trio HTTP API: OpenAI-compatible endpoints over one :class:`Engine`.

Lifecycle (see ``TRIO-NOTES.md``):

- Importing this module loads nothing. ``before_serving`` reads the configuration (from the
  environment unless one was given), runs the blocking backend factory in a worker thread
  and starts the engine in ``app.nursery`` with ``nursery.start``, so hypercorn accepts
  connections only once the model is ready.
- The engine runs under a supervisor: if it dies (or its step watchdog fires), ``/health``
  and every new request answer 503, and streams in flight end with an SSE error event;
  with ``exit_on_engine_failure`` the process then exits with :data:`ENGINE_FAILURE_EXIT`.
  ``after_serving`` drains, shuts the engine down and cancels it explicitly (quart-trio
  would wait 5 s for it otherwise).
- Once the engine runs, the startup heap (the libraries, the model's Python objects, the
  tokenizer) is frozen out of the cyclic garbage collector (``gc.freeze``, as vLLM and
  SGLang do): a full collection over it took about 155 ms on the default model, a stall
  of every stream while it held the GIL. ``after_serving`` thaws it, so that an app
  built and stopped in a long-lived process (tests) leaves nothing behind.
- Drain (:func:`drain`): stop admitting (503 with ``Retry-After``, ``/health`` 503), let
  requests in flight finish for ``drain_timeout_s``, then fail the rest (an SSE error
  event or a 503 error object, never a silent cut). Hypercorn calls ``after_serving`` only
  once its connections are closed, so a server that wants the drain to cover requests in
  flight runs it *before* telling hypercorn to stop: :func:`drain_then` wraps a
  ``shutdown_trigger`` (``python -m furnace_trio.server.serve`` does this on SIGTERM/SIGINT).
- Cancellation: each generation registers its request id in the ASGI scope. The handler's
  ``finally`` aborts it (sync, idempotent); :class:`AbortOnExit`, an ASGI wrapper around the
  whole app, aborts every registered id again on the way out, which covers a client that
  leaves after the handler returned a streaming response but before its body generator
  started (its ``finally`` then never runs).
"""

from __future__ import annotations

import dataclasses
import gc
import hmac
import json
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from furnace_trio.core.params import SamplingParams, TokenConstraint
from furnace_trio.engine.engine import (
    Admitted,
    Delta,
    EngineBusy,
    EngineUnavailable,
    Failed,
    FailureCause,
    Finished,
    GenerationRequest,
    LogprobEntry,
    RequestRejected,
    RequestStream,
    RequestTooLarge,
)
from furnace_trio.engine.sessions import SessionBusy, SessionNotFound, Turn, owner_of
from furnace_trio.server.config import ServerConfig
from furnace_trio.server.echo import Echo
from furnace_trio.server.errors import APIError, invalid_request
from furnace_trio.server.metrics import render_metrics
from furnace_trio.server.openapi import openapi_document
from furnace_trio.server.protocol import (
    ChatRequest,
    CompletionRequest,
    TokenizeRequest,
    max_prompt_chars,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
    resolve_max_tokens,
)
from furnace_trio.server.sse import DONE, SSE_HEADERS, Collector, Kind, dumps, sse_event
from furnace_trio.server.stream_group import StreamGroup
from furnace_trio.server.tool_stream import ToolCallReady, ToolCallStream, render_fallback_metrics
from furnace_trio.tools.grammar import GrammarCompiler, GrammarError
from furnace_trio.tools.tool_prompt import (
    prepare_tool_messages,
    template_supports_tools,
    tool_call_format,
)

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

    from furnace_trio.server.backend import Backend

logger = logging.getLogger(__name__)

BackendFactory = Callable[[ServerConfig], "Backend"]
SCOPE_KEY = "furnace_trio.request_ids"

STATE_KEY = "furnace_trio"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
BUSY_RETRY_AFTER_S = 1
#: Exit status when the engine failed and ``exit_on_engine_failure`` is set.
ENGINE_FAILURE_EXIT = 3
#: After the engine failed, how long handlers get to write their error events before exit.
EXIT_GRACE_S = 1.0
#: After a drain cancelled what was left, how long handlers get to write their errors.
CANCEL_GRACE_S = 2.0


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
    draining: bool = False
    in_flight: int = 0  # HTTP requests inside the app right now
    no_requests: trio.Event = field(default_factory=trio.Event)  # set while in_flight == 0
    exit_process: Callable[[int], object] = os._exit  # tests inject a recorder

    def serving_backend(self) -> Backend:
        """The backend if its engine is running, else a 503 :class:`APIError`."""
        if self.draining:
            raise _shutting_down()
        backend = self.backend
        if backend is None or not self.engine_running or not backend.engine.alive:
            reason = self.engine_failure or "the engine is not running"
            raise APIError(503, f"The server cannot serve requests: {reason}", code="unavailable")
        return backend


BODY_WAIT_S = 2.0


async def _after_the_body(message: Any, status: int, body_received: trio.Event) -> Any:
    """A response that starts before its request's body has arrived (a 404, 405 or 401
    answered from the headers alone, while the client is still sending the body): wait a
    moment for the body, then answer. A connection whose request body was still coming
    in when the response ended is left stuck by hypercorn 0.18's HTTP/1.1 protocol: the
    next request on it gets no answer. If the body does not arrive in ``BODY_WAIT_S``
    (or is refused as too large, 413), the response says ``connection: close`` instead,
    and the client opens a new connection for its next request."""
    if status != 413:
        with trio.move_on_after(BODY_WAIT_S):
            await body_received.wait()
    if body_received.is_set():
        return message
    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
    return {**message, "headers": [*headers, (b"connection", b"close")]}


class AbortOnExit:
    """ASGI wrapper: count responses by status, start none before the request's body has
    arrived (:func:`_after_the_body`), and abort a request's sequences when it ends.

    Aborting is idempotent and synchronous, so doing it for every registered id after the
    inner app returns (normally, by cancellation or by an exception) is always safe.
    """

    def __init__(self, inner: Callable[..., Any], state: ServerState) -> None:
        self.inner = inner
        self.state = state

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        request_ids: list[str] = []
        scope[SCOPE_KEY] = request_ids  # type: ignore[literal-required]
        body_received = trio.Event()

        async def watching_receive() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_received.set()
            return message

        async def counting_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                self.state.http_responses[status] += 1
                if not body_received.is_set():
                    message = await _after_the_body(message, status, body_received)
            await send(message)

        state = self.state
        if state.in_flight == 0:
            state.no_requests = trio.Event()
        state.in_flight += 1
        try:
            await self.inner(scope, watching_receive, counting_send)
        finally:
            state.in_flight -= 1
            if state.in_flight == 0:
                state.no_requests.set()
            backend = self.state.backend
            if backend is not None:
                for request_id in request_ids:
                    backend.engine.abort(request_id)


def create_app(
    config: ServerConfig | None = None, *, backend_factory: BackendFactory | None = None
) -> QuartTrio:
    """Build the app; nothing is loaded until it starts serving.

    ``config is None`` reads ``FURNACE_*`` variables when serving starts;
    ``backend_factory is None`` uses :func:`furnace_trio.server.backend.load_backend`.
    """
    app = QuartTrio(__name__)
    app.config["RESPONSE_TIMEOUT"] = 60
    state = ServerState(config=config, backend_factory=backend_factory)
    app.extensions[STATE_KEY] = state
    if config is not None:
        app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.asgi_app = AbortOnExit(app.asgi_app, state)  # type: ignore[method-assign]

    @app.before_serving
    async def start_backend() -> None:
        if state.config is None:
            state.config = ServerConfig.from_env()
        cfg = state.config
        app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
        logging.getLogger("furnace_trio").setLevel(cfg.log_level)
        if not logging.getLogger().handlers:
            logging.basicConfig(level=cfg.log_level)
        factory = state.backend_factory
        if factory is None:
            from furnace_trio.server.backend import load_backend

            factory = load_backend
        state.backend = await trio.to_thread.run_sync(factory, cfg)
        await app.nursery.start(_supervise_engine, state)
        gc.collect()
        gc.freeze()
        logger.info(
            "serving %s (context %d tokens; %d startup objects frozen out of the collector)",
            state.backend.model_name,
            state.backend.max_context,
            gc.get_freeze_count(),
        )

    @app.after_serving
    async def stop_backend() -> None:
        await drain(state)
        backend = state.backend
        if backend is not None:
            backend.engine.shutdown()
        if state.engine_scope is not None:
            state.engine_scope.cancel()
        gc.unfreeze()

    _register_error_handlers(app)
    _register_routes(app, state)
    _session_routes(app, state)
    _tokenizer_routes(app, state)
    return app


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


def _shutting_down() -> APIError:
    return APIError(
        503,
        "The server is shutting down. Retry shortly.",
        code="shutting_down",
        headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
    )


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


def _error_response(error: APIError) -> Response:
    response = Response(dumps(error.body()), status=error.status, mimetype="application/json")
    for name, value in error.headers.items():
        response.headers[name] = value
    return response


def _register_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(APIError)
    async def api_error(error: APIError) -> Response:
        logger.info("%s %s -> %d: %s", request.method, request.path, error.status, error.message)
        return _error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        headers = {
            name: value
            for name, value in error.get_headers()
            if name.lower() not in ("content-type", "content-length")
        }
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
        message = error.description or error.name
        if status == 413:
            message = "The request body is larger than the server accepts."
        return _error_response(APIError(status, message, code=code, headers=headers))

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Response:
        logger.exception("unexpected error in %s %s", request.method, request.path)
        return _error_response(APIError(500, "The server had an internal error.", code=None))


def _check_api_key(state: ServerState) -> None:
    cfg = state.config
    if cfg is None or cfg.api_key is None:
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else ""
    if not hmac.compare_digest(given.encode(), cfg.api_key.encode()):
        raise APIError(
            401,
            "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _check_model(backend: Backend, model: str | None) -> None:
    if model is not None and model != backend.model_name:
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {backend.model_name!r}.",
            param="model",
            code="model_not_found",
        )


def _submit(backend: Backend, generation: GenerationRequest, param: str) -> RequestStream:
    """Hand a request to the engine, register it for abort, map engine errors to HTTP."""
    try:
        stream = backend.engine.submit(generation)
    except EngineBusy as exc:
        raise APIError(
            503,
            f"The server is busy: {exc}. Retry shortly.",
            code="server_busy",
            headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
        ) from None
    except RequestTooLarge as exc:
        raise APIError(
            503,
            f"The request can never fit this server's memory: {exc}",
            code="request_too_large",
            headers={"x-should-retry": "false"},
        ) from None
    except RequestRejected as exc:
        raise invalid_request(str(exc), getattr(exc, "param", None) or param) from None
    except EngineUnavailable as exc:
        if backend.engine.alive:  # draining or shutting down: another replica can serve it
            raise _shutting_down() from None
        raise APIError(
            503, f"The server cannot serve requests: {exc}", code="unavailable"
        ) from None
    request.scope[SCOPE_KEY].append(stream.request_id)  # type: ignore[literal-required]
    return stream


@dataclass(slots=True)
class _Timing:
    """Times and counts for the per-request log line."""

    request_id: str
    started: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    queue_time: float = 0.0
    status: int = 200

    def log(self, collector: Collector) -> None:
        end = time.monotonic()
        generated = collector.completion_tokens
        prefill_rate = decode_rate = 0.0
        if self.admitted is not None and self.first_token is not None:
            prefill_s = self.first_token - self.admitted
            new_tokens = collector.prompt_tokens - collector.cached_tokens
            prefill_rate = new_tokens / prefill_s if prefill_s > 0 else 0.0
            decode_s = end - self.first_token
            decode_rate = (generated - collector.n) / decode_s if decode_s > 0 else 0.0
        reasons = ",".join(c.finish_reason or "-" for c in collector.choices)
        logger.info(
            "request %s status=%d prompt_tokens=%d cached_tokens=%d generated_tokens=%d "
            "queue_time=%.3fs prefill=%.1f tok/s decode=%.1f tok/s finish=%s total=%.3fs",
            self.request_id,
            self.status,
            collector.prompt_tokens,
            collector.cached_tokens,
            generated,
            self.queue_time,
            prefill_rate,
            max(decode_rate, 0.0),
            reasons,
            end - self.started,
        )


def _register_routes(app: QuartTrio, state: ServerState) -> None:
    @app.before_request
    async def authenticate() -> None:
        if request.path.startswith("/v1") or request.path in TOKENIZER_PATHS:
            _check_api_key(state)

    @app.get("/health")
    async def health() -> tuple[dict[str, Any], int]:
        try:
            backend = state.serving_backend()
        except APIError as error:
            return {"status": "unavailable", "error": error.message}, 503
        return {"status": "ok", "model": backend.model_name}, 200

    @app.get("/metrics")
    async def metrics() -> Response:
        backend = state.backend
        stats = backend.engine.statistics() if backend is not None else None
        text = render_metrics(stats, state.http_responses, engine_up=state.engine_running)
        text += render_fallback_metrics(state.tool_call_fallbacks)
        return Response(text, mimetype="text/plain; version=0.0.4")

    openapi_body = dumps(openapi_document())  # built from the validator's own field tables

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return Response(openapi_body, mimetype="application/json")

    def model_card(backend: Backend) -> dict[str, Any]:
        return {
            "id": backend.model_name,
            "object": "model",
            "created": state.started,
            "owned_by": "furnace-trio",
            "max_model_len": backend.max_context,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        backend = state.serving_backend()
        return {"object": "list", "data": [model_card(backend)]}

    @app.get("/v1/models/<path:model_id>")
    async def get_model(model_id: str) -> dict[str, Any]:
        backend = state.serving_backend()
        _check_model(backend, model_id)
        return model_card(backend)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        body = await _read_body()
        backend = state.serving_backend()
        parsed = parse_chat_request(
            body,
            vocab_size=backend.tokenizer.vocab_size,
            max_prompt_chars=max_prompt_chars(backend.max_context),
        )
        _check_model(backend, parsed.model)
        session_id = _session_id(parsed)
        if session_id is not None:
            return await _session_chat(state, backend, parsed, session_id)
        return await _chat(state, backend, parsed)

    @app.post("/v1/completions")
    async def completions() -> Response:
        body = await _read_body()
        backend = state.serving_backend()
        parsed = parse_completion_request(
            body,
            vocab_size=backend.tokenizer.vocab_size,
            max_prompt_chars=max_prompt_chars(backend.max_context),
        )
        _check_model(backend, parsed.model)
        prompts = parsed.prompts
        if any(isinstance(prompt, str) for prompt in prompts):
            prompt_ids = await trio.to_thread.run_sync(_encode_prompts, backend, prompts)
        else:
            prompt_ids = tuple(prompt for prompt in prompts if not isinstance(prompt, str))
        echo = None
        if parsed.echo:  # token prompts are decoded (off the event loop)
            texts = tuple(prompt for prompt in prompts if isinstance(prompt, str))
            if len(texts) < len(prompts):
                texts = await trio.to_thread.run_sync(_echo_texts, backend, prompts)
            echo = texts
        return await _generate(
            backend, "completion", parsed, prompt_ids, "prompt", nursery=app.nursery, echo=echo
        )


# -- sessions ------------------------------------------------------------------------------------


def _owner() -> str:
    """The session owner: the bearer token presented (digested), even when the server
    checks no key, so that clients with different keys never see each other's sessions."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    return owner_of(token if scheme.lower() == "bearer" and token else None)


def _session_id(parsed: ChatRequest) -> str | None:
    """``session_id`` from the body (``extra_body`` in the SDK; checked by the protocol) or
    the ``X-Session-Id`` header; when both are given they must agree."""
    header = request.headers.get("X-Session-Id")
    value = parsed.session_id
    if header is not None and not 1 <= len(header) <= 256:
        raise invalid_request("X-Session-Id must have 1 to 256 characters", "session_id")
    if value is not None and header is not None and value != header:
        raise invalid_request("session_id and X-Session-Id differ", "session_id")
    return value if value is not None else header


def _session_not_found(session_id: str) -> APIError:
    return APIError(
        404, f"The session {session_id!r} does not exist.", param="session_id", code="not_found"
    )


def _session_busy(exc: Exception) -> APIError:
    return APIError(
        409,
        f"{exc}; send the next turn once it has finished.",
        param="session_id",
        code="session_busy",
        headers={"x-should-retry": "false"},
    )


async def _chat(
    state: ServerState, backend: Backend, parsed: ChatRequest, turn: Turn | None = None
) -> Response:
    """Render, tokenize, set up tool parsing and any grammar, then generate."""
    prompt_ids = await trio.to_thread.run_sync(_render_chat, backend, parsed)
    constraint = None
    if parsed.response_format is not None or parsed.tool_choice in ("required", "function"):
        if state.grammar is None:
            state.grammar = GrammarCompiler(backend.tokenizer)
        constraint = await trio.to_thread.run_sync(_constraint, state, backend, parsed)
    return await _generate(
        backend,
        "chat",
        parsed,
        (prompt_ids,),
        "messages",
        _tool_stream(state, backend, parsed),
        constraint=constraint,
        turn=turn,
    )


async def _session_chat(
    state: ServerState, backend: Backend, parsed: ChatRequest, session_id: str
) -> Response:
    """A session turn: its history plus the new messages, rendered whole. The session's
    pinned blocks are in the prefix cache, so only the tokens after the longest common
    prefix compute. The request stream commits the turn when it finishes and ends it when
    closed; until the stream exists, ending it on the way out is ours."""
    engine = backend.engine
    try:
        turn = engine.begin_turn(session_id, _owner(), parsed.messages)
    except SessionNotFound:
        raise _session_not_found(session_id) from None
    except SessionBusy as exc:
        raise _session_busy(exc) from None
    except ValueError as exc:
        raise invalid_request(str(exc), "session_id") from None
    try:
        full = dataclasses.replace(parsed, messages=tuple(turn.messages))
        response = await _chat(state, backend, full, turn)
    except BaseException:
        engine.end_turn(turn)
        raise
    response.headers["X-Session-Id"] = session_id
    if not parsed.stream:
        body = json.loads(await response.get_data(as_text=False))
        body["session_id"] = session_id
        response.set_data(dumps(body))
    return response


def _session_routes(app: QuartTrio, state: ServerState) -> None:
    @app.get("/v1/sessions/<session_id>")
    async def get_session(session_id: str) -> Response:
        backend = state.serving_backend()
        try:
            session = backend.engine.get_session(session_id, _owner())
        except SessionNotFound:
            raise _session_not_found(session_id) from None
        body = {
            "id": session.session_id,
            "object": "session",
            "turns": session.turns,
            "messages": [dict(m) for m in session.messages],
            "cached_tokens": len(session.token_ids),
        }
        return Response(dumps(body), mimetype="application/json")

    @app.delete("/v1/sessions/<session_id>")
    async def delete_session(session_id: str) -> Response:
        backend = state.serving_backend()
        try:
            backend.engine.delete_session(session_id, _owner())
        except SessionNotFound:
            raise _session_not_found(session_id) from None
        except SessionBusy as exc:
            raise _session_busy(exc) from None
        body = {"id": session_id, "object": "session.deleted", "deleted": True}
        return Response(dumps(body), mimetype="application/json")


# -- the tokenizer (as vLLM serves it) ---------------------------------------------------------

#: Outside ``/v1`` (where vLLM has them) and behind the API key like it.
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})


def _tokenizer_routes(app: QuartTrio, state: ServerState) -> None:
    """``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` with vLLM's bodies: what
    clients such as lm-evaluation-harness use to tokenize with the served model's own
    tokenizer instead of downloading one."""

    @app.post("/tokenize")
    async def tokenize() -> dict[str, Any]:
        body = await _read_body()
        backend = state.serving_backend()
        parsed = parse_tokenize_request(
            body, max_prompt_chars=max_prompt_chars(backend.max_context)
        )
        _check_model(backend, parsed.model)
        tokens = await trio.to_thread.run_sync(_tokenize, backend, parsed)
        out: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": backend.max_context,
            "tokens": tokens,
        }
        if parsed.return_token_strs:
            out["token_strs"] = [backend.tokenizer.id_to_token(t) for t in tokens]
        return out

    @app.post("/detokenize")
    async def detokenize() -> dict[str, Any]:
        body = await _read_body()
        backend = state.serving_backend()
        model, ids = parse_detokenize_request(body, vocab_size=backend.tokenizer.vocab_size)
        _check_model(backend, model)
        text = await trio.to_thread.run_sync(_detokenize, backend, ids)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        backend = state.serving_backend()
        tokenizer = backend.tokenizer
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": None,
            "add_bos_token": tokenizer.add_bos_token,
            "chat_template": tokenizer.chat_template,
            "model_max_length": backend.max_context,
        }


def _tokenize(backend: Backend, parsed: TokenizeRequest) -> list[int]:
    """A prompt's token ids, or a conversation's as the chat template renders it."""
    text = parsed.prompt
    if parsed.messages is not None:
        text = _render_messages(
            backend, parsed.messages, add_generation_prompt=parsed.add_generation_prompt
        )
    assert text is not None  # the parser gives exactly one of the two
    return backend.tokenizer.encode(text, add_special_tokens=parsed.add_special_tokens)


def _detokenize(backend: Backend, ids: tuple[int, ...]) -> str:
    """The text of ``ids``, special tokens included (it round-trips ``/tokenize``)."""
    return backend.tokenizer.decode(ids, skip_special_tokens=False)


async def _read_body() -> bytes:
    """The raw body bytes (413 past ``MAX_CONTENT_LENGTH``); parsing is ours, see protocol."""
    data = await request.get_data(cache=False, as_text=False)
    return data if isinstance(data, bytes) else data.encode()


def _render_chat(backend: Backend, parsed: ChatRequest) -> tuple[int, ...]:
    """Template and tokenize (runs in a worker thread; big inputs take a while)."""
    text = _render_messages(
        backend,
        parsed.messages,
        parsed.tools if parsed.tool_choice != "none" else None,
        required=parsed.tool_choice == "required",
        function=parsed.tool_function,
    )
    return tuple(backend.tokenizer.encode(text, add_special_tokens=False))


def _render_messages(
    backend: Backend,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    required: bool = False,
    function: str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """A conversation (and its tools) rendered by the chat template; a 400 naming
    ``messages`` when it cannot be."""
    try:
        prepared, tools_out = prepare_tool_messages(
            messages,
            tools,
            template_has_tools=template_supports_tools(backend.tokenizer.chat_template),
            required=required,
            function=function,
        )
        return backend.tokenizer.apply_chat_template(
            prepared, add_generation_prompt=add_generation_prompt, tools=tools_out
        )
    except ValueError as exc:
        raise invalid_request(f"cannot render the chat template: {exc}", "messages") from None


def _tool_stream(
    state: ServerState, backend: Backend, parsed: ChatRequest
) -> Callable[[str, int], ToolCallStream] | None:
    """How to parse this request's output for tool calls (None: plain content)."""
    if parsed.tool_choice == "none" or not parsed.tools:
        return None
    configured = state.config.tool_parser if state.config is not None else "auto"
    fmt = tool_call_format(configured, backend.tokenizer.chat_template)

    def make(request_id: str, n: int) -> ToolCallStream:
        return ToolCallStream(
            request_id,
            n,
            fmt,
            parsed.tool_schemas,
            parallel=parsed.parallel_tool_calls,
            fallbacks=state.tool_call_fallbacks,
        )

    return make


def _constraint(
    state: ServerState, backend: Backend, parsed: ChatRequest
) -> TokenConstraint | None:
    """The grammar that enforces ``tool_choice`` required/named or ``response_format``.

    Forced calls are generated in the Hermes format; with another configured parser they
    are left to the prompt. Runs in a worker thread (compiling takes milliseconds).
    """
    compiler = state.grammar
    assert compiler is not None  # set by the handler before this runs; not user input
    try:
        if parsed.tool_choice in ("required", "function"):
            configured = state.config.tool_parser if state.config is not None else "auto"
            fmt = tool_call_format(configured, backend.tokenizer.chat_template)
            if fmt.value != "hermes":
                logger.info(
                    "tool_choice %s not enforced for the %s format", parsed.tool_choice, fmt
                )
                return None
            tools = parsed.tool_schemas
            if parsed.tool_function is not None:
                tools = {parsed.tool_function: tools[parsed.tool_function]}
            # a named function is one call; "required" may call several when allowed
            parallel = parsed.parallel_tool_calls and parsed.tool_function is None
            return compiler.tool_calls(tools, parallel=parallel)
        if parsed.response_format is not None:
            return compiler.json_schema(parsed.response_format.schema)
    except GrammarError as exc:
        raise invalid_request(f"cannot compile the grammar: {exc}", "response_format") from None
    return None


def _encode_prompts(
    backend: Backend, prompts: Sequence[str | tuple[int, ...]]
) -> tuple[tuple[int, ...], ...]:
    """Token ids for every prompt: text is encoded, ids pass through."""
    return tuple(
        tuple(backend.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, str)
        else prompt
        for prompt in prompts
    )


def _echo_texts(backend: Backend, prompts: Sequence[str | tuple[int, ...]]) -> tuple[str, ...]:
    """What ``echo`` returns of each prompt: its text as sent, or its token ids decoded."""
    return tuple(p if isinstance(p, str) else backend.engine.decode(p) for p in prompts)


async def _generate(
    backend: Backend,
    kind: Kind,
    parsed: ChatRequest | CompletionRequest,
    prompts: Sequence[tuple[int, ...]],
    prompt_param: str,
    tool_stream: Callable[[str, int], ToolCallStream] | None = None,
    constraint: TokenConstraint | None = None,
    *,
    turn: Turn | None = None,
    nursery: trio.Nursery | None = None,
    echo: Sequence[str] | None = None,
) -> Response:
    """Generate for one prompt, or for a batch of completions prompts (each its own engine
    request, read together through a :class:`StreamGroup` whose tasks run in ``nursery``).
    ``echo`` holds each prompt's text where the choices begin with their prompt."""
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    generations = [
        GenerationRequest(
            prompt_token_ids=prompt_ids,
            params=_params(backend, kind, parsed, prompt_ids, prompt_param, constraint, which),
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{which}",
            turn=turn,
        )
        for which, prompt_ids in enumerate(prompts)
    ]
    params = generations[0].params
    collector = Collector(
        kind=kind,
        response_id=request_id,
        model=backend.model_name,
        created=int(time.time()),
        n=params.n * len(prompts),
        prompt_tokens=sum(len(prompt_ids) for prompt_ids in prompts),
        want_logprobs=params.logprobs is not None,
    )
    stream = _submit_all(backend, generations, prompt_param, nursery)
    timing = _Timing(request_id)
    tools: ToolCallStream | Echo | None = None
    if tool_stream is not None:
        tools = tool_stream(request_id, collector.n)
    elif echo is not None:
        firsts = [
            LogprobEntry(backend.engine.decode(ids[:1]), ids[0], None, None, ()) for ids in prompts
        ]
        tools = Echo(
            echo,
            firsts,
            params.n,
            want_logprobs=collector.want_logprobs,
            generated=parsed.sampling.max_tokens != 0,
        )
    if parsed.stream:
        response = Response(
            _stream_body(stream, collector, timing, parsed.include_usage, tools),
            mimetype="text/event-stream",
            headers=SSE_HEADERS,
        )
        response.timeout = None  # RESPONSE_TIMEOUT would silently cut a long stream
        return response
    try:
        async for engine_event in stream:
            events = tools.translate(engine_event) if tools is not None else [engine_event]
            failure = None
            for event in events:
                failure = _apply(event, collector, timing) or failure
            if failure is not None:
                error = _failure_error(failure)
                timing.status = error.status
                raise error
        return Response(dumps(collector.response()), mimetype="application/json")
    except BaseException:
        if timing.status == 200:
            timing.status = 499  # cancelled: the client went away
        raise
    finally:
        stream.close()
        timing.log(collector)


def _params(
    backend: Backend,
    kind: Kind,
    parsed: ChatRequest | CompletionRequest,
    prompt_ids: tuple[int, ...],
    prompt_param: str,
    constraint: TokenConstraint | None,
    which: int,
) -> SamplingParams:
    """One prompt's sampling parameters (its ``max_tokens`` depends on its length); a
    prompt of a batch is named in the error."""
    try:
        if not prompt_ids:
            raise invalid_request("the prompt is empty after tokenization", prompt_param)
        max_tokens = resolve_max_tokens(
            parsed.sampling.max_tokens,
            prompt_tokens=len(prompt_ids),
            max_context=backend.max_context,
            default=None if kind == "chat" else COMPLETIONS_DEFAULT_MAX_TOKENS,
            prompt_param=prompt_param,
            max_tokens_param=parsed.sampling.max_tokens_param,
        )
        try:
            # max_tokens 0 (echo alone): one token is computed, and the echo drops it.
            params = parsed.sampling.to_params(max(max_tokens, 1))
        except ValueError as exc:
            raise invalid_request(str(exc)) from None
    except APIError as exc:
        if not isinstance(parsed, CompletionRequest) or len(parsed.prompts) == 1:
            raise
        raise APIError(
            exc.status,
            f"prompt[{which}]: {exc.message}",
            param=exc.param,
            code=exc.code,
            error_type=exc.error_type,
            headers=exc.headers,
        ) from None
    if constraint is not None:
        params = dataclasses.replace(params, constraint=constraint)
    if isinstance(parsed, CompletionRequest) and parsed.echo and params.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    return params


def _submit_all(
    backend: Backend,
    generations: Sequence[GenerationRequest],
    param: str,
    nursery: trio.Nursery | None,
) -> RequestStream | StreamGroup:
    """Submit every request, or none: one that the engine refuses closes (aborts) those
    already submitted."""
    if len(generations) == 1:
        return _submit(backend, generations[0], param)
    assert nursery is not None, "a batch of prompts is read in a nursery"
    streams: list[RequestStream] = []
    try:
        for generation in generations:
            streams.append(_submit(backend, generation, param))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return StreamGroup(
        streams,
        generations[0].params.n,
        [len(generation.prompt_token_ids) for generation in generations],
        nursery,
    )


def _failure_error(failed: Failed) -> APIError:
    """The error for a failed request: 500 when the model failed on it (the server goes
    on), 503 when the engine is gone or the server is shutting down."""
    if failed.cause is FailureCause.MODEL:
        return APIError(500, f"The model failed on this request: {failed.message}")
    if failed.cause is FailureCause.SHUTDOWN:
        return APIError(503, f"The request was cancelled: {failed.message}", code="shutting_down")
    return APIError(503, f"The server cannot serve requests: {failed.message}", code="unavailable")


def _apply(event: object, collector: Collector, timing: _Timing) -> Failed | None:
    """Fold one engine event into the collector; return a ``Failed``."""
    if isinstance(event, Delta):
        if timing.first_token is None:
            timing.first_token = time.monotonic()
        collector.add_delta(event.index, event.text, event.logprobs)
    elif isinstance(event, Finished):
        collector.finish(event.index, event.reason, event.completion_tokens)
    elif isinstance(event, Admitted):
        _admit(event, collector, timing)
    elif isinstance(event, ToolCallReady):
        collector.add_tool_call(event.index, event.call)
    elif isinstance(event, Failed):
        return event
    return None


def _admit(event: Admitted, collector: Collector, timing: _Timing) -> None:
    timing.admitted = time.monotonic()
    timing.queue_time = event.queue_time
    collector.prompt_tokens = event.prompt_tokens
    collector.cached_tokens = event.cached_tokens


async def _stream_body(
    stream: RequestStream | StreamGroup,
    collector: Collector,
    timing: _Timing,
    include_usage: bool,
    tools: ToolCallStream | Echo | None = None,
) -> AsyncIterator[bytes]:
    """SSE body; ``finally`` aborts (sync, idempotent) however the generator ends."""
    try:
        if collector.kind == "chat":
            for index in range(collector.n):
                first = collector.chunk(index, role=True, include_usage=include_usage)
                if stream.session_id is not None:
                    first["session_id"] = stream.session_id
                yield sse_event(first)
        async for engine_event in stream:
            events = tools.translate(engine_event) if tools is not None else [engine_event]
            for event in events:
                for chunk in _stream_chunks(event, collector, timing, include_usage):
                    yield chunk
            if isinstance(engine_event, Failed):
                error = _failure_error(engine_event)
                timing.status = error.status
                yield sse_event(error.body())
                return
        if include_usage:
            yield sse_event(collector.usage_chunk())
        yield DONE
    except Exception as exc:
        timing.status = 500
        logger.exception("stream %s failed", collector.response_id)
        yield sse_event(APIError(500, f"The stream failed: {exc}").body())
    except BaseException:
        if timing.status == 200:
            timing.status = 499
        raise
    finally:
        stream.close()
        timing.log(collector)


def _stream_chunks(
    event: object, collector: Collector, timing: _Timing, include_usage: bool
) -> Iterable[bytes]:
    if isinstance(event, Delta):
        if timing.first_token is None:
            timing.first_token = time.monotonic()
        if collector.want_logprobs and event.logprobs:
            yield sse_event(
                collector.chunk(
                    event.index,
                    text=event.text,
                    logprobs=event.logprobs,
                    include_usage=include_usage,
                )
            )
        elif event.text:
            yield collector.content_event(event.index, event.text, include_usage=include_usage)
    elif isinstance(event, Finished):
        collector.finish(event.index, event.reason, event.completion_tokens)
        reason = collector.choices[event.index].finish_reason
        yield sse_event(
            collector.chunk(event.index, finish_reason=reason, include_usage=include_usage)
        )
    elif isinstance(event, ToolCallReady):
        for body in collector.tool_call_chunks(
            event.index, event.call, include_usage=include_usage
        ):
            yield sse_event(body)
    elif isinstance(event, Admitted):
        _admit(event, collector, timing)


#: Served by ``hypercorn -c hypercorn.toml furnace_trio.app:app``; loads nothing at import.
app = create_app()
