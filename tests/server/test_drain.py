"""Graceful drain over a real socket: on shutdown new requests get 503 with Retry-After,
requests in flight finish within the drain deadline, and those still running at the
deadline end with an SSE error event or a 503 error object, never silently.

The server here is run the way ``python -m furnace_trio.server.serve`` runs it: the shutdown
trigger drains first (:func:`furnace_trio.server.lifecycle.drain_then`), and only then does hypercorn
stop listening; hypercorn's own graceful period would otherwise cut streams silently.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import hypercorn.trio
import trio
from hypercorn.config import Config

from furnace_trio.engine import Engine, EngineConfig
from furnace_trio.server.config import ServerConfig
from furnace_trio.server.lifecycle import drain_then

from .. import scripted
from ..http_server import scripted_app
from .waiting import engine_reaches

MESSAGES = [{"role": "user", "content": "hi"}]


@asynccontextmanager
async def serve_draining(
    runner: scripted.ScriptedRunner, drain_timeout_s: float
) -> AsyncIterator[tuple[str, trio.Event, Engine]]:
    """Yield (url, shutdown event, engine); setting the event starts the drain, and the
    block's exit waits (bounded) until hypercorn has stopped."""
    app, engines = scripted_app(
        runner,
        engine_config=EngineConfig(max_running=4),
        config=ServerConfig(drain_timeout_s=drain_timeout_s),
    )
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 5
    config.accesslog = None
    config.errorlog = None
    shutdown = trio.Event()
    with trio.fail_after(drain_timeout_s + 20):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                partial(
                    hypercorn.trio.serve,
                    app,
                    config,
                    shutdown_trigger=drain_then(app, shutdown.wait),
                )
            )
            yield binds[0], shutdown, engines[0]
            shutdown.set()


async def _read_stream(
    http: httpx.AsyncClient, events: list[Any], body: dict[str, Any], started: trio.Event
) -> None:
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 2:
                    started.set()


async def _wait_running(engine: Engine, count: int) -> None:
    await engine_reaches(engine, lambda s: s.running >= count, f"{count} running")


async def test_stream_in_flight_completes_within_the_drain_and_new_requests_get_503() -> None:
    runner = scripted.ScriptedRunner(lambda p, i: [], sleep=0.01)  # filler tokens
    async with (
        serve_draining(runner, drain_timeout_s=30) as (url, shutdown, engine),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        trio.open_nursery() as nursery,
    ):
        events: list[Any] = []
        started = trio.Event()
        body = {"messages": MESSAGES, "stream": True, "max_tokens": 60}
        nursery.start_soon(_read_stream, http, events, body, started)
        await started.wait()
        shutdown.set()
        for _ in range(500):  # the drain flag is set at once; bounded wait regardless
            await trio.sleep(0.01)
            refused = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
            if refused.status_code == 503:
                break
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "shutting_down"
        assert (await http.get("/health")).status_code == 503
    assert events[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in events[:-1] for c in e.get("choices", [])]
    assert finishes[-1] == "length"
    assert not any("error" in e for e in events[:-1])
    assert engine.statistics().requests_in_flight == 0


async def test_drain_deadline_ends_streams_with_an_error_and_requests_with_503() -> None:
    runner = scripted.ScriptedRunner(lambda p, i: [], sleep=0.05)  # ~20 s for 400 tokens
    outcomes: dict[str, Any] = {}
    async with (
        serve_draining(runner, drain_timeout_s=0.5) as (url, shutdown, engine),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        trio.open_nursery() as nursery,
    ):
        events: list[Any] = []
        started = trio.Event()
        body = {"messages": MESSAGES, "stream": True, "max_tokens": 400}
        nursery.start_soon(_read_stream, http, events, body, started)

        async def blocking() -> None:
            response = await http.post(
                "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 400}
            )
            outcomes["blocking"] = (response.status_code, response.json())

        nursery.start_soon(blocking)
        await started.wait()
        await _wait_running(engine, 2)  # both admitted (both fit the KV pool)
        shutdown.set()
    assert events[-1] != "[DONE]"
    error = events[-1]["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    status, response_body = outcomes["blocking"]
    assert status == 503 and response_body["error"]["code"] == "shutting_down"
    stats = engine.statistics()
    assert stats.requests_in_flight == 0 and stats.running == 0 and stats.kv_block_refs == 0


async def test_after_serving_drains_what_is_left() -> None:
    """Without the trigger wrapper (plain ``hypercorn``), ``after_serving`` still drains:
    whatever the engine holds then is failed, and the engine stops."""
    from ..http_server import serve_scripted

    async with (
        serve_scripted(drain_timeout_s=0.1) as served,
        httpx.AsyncClient(base_url=served.url) as http,
    ):
        assert (await http.get("/health")).status_code == 200
    assert served.state.draining
    assert not served.engine.alive
