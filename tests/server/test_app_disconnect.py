"""A client that leaves frees its sequence and KV blocks, whatever stage it was at.

Each test waits (bounded polling, no timing assertions) until the engine has nothing
running or waiting and every KV block is back, and checks the request was aborted rather
than run to completion.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import trio

from furnace_trio.engine import EngineConfig

from .. import scripted
from ..http_server import ANSWERS, Served, default_script, scripted_app, serve_scripted
from .waiting import engine_idle, engine_reaches

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def aborted(served: Served) -> int:
    return served.engine.statistics().requests["aborted"]


async def test_disconnect_while_queued() -> None:
    gate = threading.Event()
    runner = scripted.ScriptedRunner(default_script, gate=gate)
    async with (
        serve_scripted(runner, engine_config=EngineConfig(max_running=1)) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
        trio.open_nursery() as nursery,
    ):
        first: list[httpx.Response] = []

        async def post_first() -> None:
            first.append(await http.post("/v1/chat/completions", json=CHAT))

        nursery.start_soon(post_first)
        await engine_reaches(served.engine, lambda s: s.running == 1)
        queued = trio.CancelScope()
        nursery.start_soon(_post_in, http, queued)
        await engine_reaches(served.engine, lambda s: s.waiting == 1)
        queued.cancel()
        await engine_reaches(served.engine, lambda s: s.waiting == 0)
        assert aborted(served) == 1
        gate.set()
    assert first[0].json()["choices"][0]["message"]["content"] == ANSWERS[0]
    await served.wait_idle()


async def _post_in(http: httpx.AsyncClient, scope: trio.CancelScope) -> None:
    with scope:
        await http.post("/v1/chat/completions", json={**CHAT, "stream": False})


async def test_disconnect_during_prefill() -> None:
    gate = threading.Event()
    runner = scripted.ScriptedRunner(default_script, gate=gate)
    async with serve_scripted(runner) as served, httpx.AsyncClient(base_url=served.url) as http:
        async with http.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
        ) as response:
            assert response.status_code == 200
            # the prefill step is in flight (admitted, so handed to the model thread)
            await engine_reaches(served.engine, lambda s: s.running == 1)
        # Leaving the block closed the connection mid-body.
        await engine_reaches(served.engine, lambda s: s.requests["aborted"] == 1)
        gate.set()
        await served.wait_idle()


async def test_disconnect_mid_stream() -> None:
    runner = scripted.ScriptedRunner(lambda p, i: [], sleep=0.005)
    body = {**CHAT, "stream": True, "max_tokens": 900, "ignore_eos": True}
    async with serve_scripted(runner) as served, httpx.AsyncClient(base_url=served.url) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            contents = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        contents += 1
                if contents >= 3:
                    break
        await served.wait_idle()
        assert aborted(served) == 1
        assert len(runner.plans) < 900


async def test_disconnect_before_the_body_starts() -> None:
    """The handler returned its streaming response, the client left before the body began:
    the generator never runs (so neither does its ``finally``); the ASGI wrapper aborts."""
    gate = threading.Event()
    runner = scripted.ScriptedRunner(default_script, gate=gate)
    app, engines = scripted_app(runner)
    body = json.dumps({**CHAT, "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"localhost"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "extensions": {},
    }
    gone = trio.Event()
    sent: list[dict[str, Any]] = []
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            gone.set()  # the client leaves right now
            await trio.sleep_forever()

    async with app.test_app():
        engine = engines[0]
        with trio.fail_after(10):
            await app(scope, receive, send)
        assert [m["type"] for m in sent] == ["http.response.start"]
        assert engine.statistics().requests["aborted"] == 1
        gate.set()
        await engine_reaches(engine, engine_idle, "an idle engine")
