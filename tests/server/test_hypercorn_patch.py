"""The hypercorn patch: applied only to the pinned version, once; and in process, a reader
that never reads does not hold a server's stop open past its graceful period.

(The drain under the real ``hypercorn`` command is tested in ``test_hypercorn_stop.py``.)
"""

from __future__ import annotations

import json
import logging
import socket

import hypercorn.trio.run
import hypercorn.trio.tcp_server
import pytest
import trio

from furnace_trio.engine import EngineConfig
from furnace_trio.server import hypercorn_patch

from .. import scripted
from ..http_server import serve_scripted
from .waiting import engine_reaches


def test_another_hypercorn_version_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    worker_serve = hypercorn.trio.run.worker_serve
    run = hypercorn.trio.tcp_server.TCPServer.run
    monkeypatch.setattr(hypercorn_patch.importlib.metadata, "version", lambda name: "0.19.0")
    with caplog.at_level(logging.WARNING):
        assert not hypercorn_patch.install()
    assert "hypercorn 0.19.0 is not 0.18.0" in caplog.text
    assert hypercorn.trio.run.worker_serve is worker_serve
    assert hypercorn.trio.tcp_server.TCPServer.run is run


def test_the_pinned_version_is_patched_once() -> None:
    assert hypercorn_patch.install()
    worker_serve = hypercorn.trio.run.worker_serve
    run = hypercorn.trio.tcp_server.TCPServer.run
    assert hypercorn_patch.install()
    assert hypercorn.trio.run.worker_serve is worker_serve
    assert hypercorn.trio.tcp_server.TCPServer.run is run
    assert worker_serve.__wrapped__.__module__ == "hypercorn.trio.run"  # type: ignore[attr-defined]


async def test_a_reader_that_never_reads_does_not_hold_the_stop_open() -> None:
    """The server stops within its graceful period while a client holds a stream it does
    not read. Without the patch hypercorn's shielded write would wait for good; here a
    watchdog closes the client after 30 s, so the test fails instead of hanging."""
    hypercorn_patch.install()
    runner = scripted.ScriptedRunner(lambda p, i: [], num_blocks=2048, max_context=4096)
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 3000,
            "logprobs": True,
            "top_logprobs": 20,
        }
    ).encode()
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    rescued = False
    async with trio.open_nursery() as nursery:
        async with serve_scripted(
            runner, engine_config=EngineConfig(max_response_bytes=20000), send_buffer=4096
        ) as served:
            port = int(served.url.rsplit(":", 1)[1])
            await sock.connect(("127.0.0.1", port))
            await sock.send(
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await engine_reaches(served.engine, lambda s: s.requests_paused == 1, "a pause")

            async def watchdog() -> None:
                nonlocal rescued
                await trio.sleep(30)
                rescued = True
                sock.close()

            nursery.start_soon(watchdog)
            stopping = trio.current_time()
        stopped = trio.current_time()
        nursery.cancel_scope.cancel()
    sock.close()
    assert not rescued
    assert stopped - stopping < 20  # serve_app's graceful period is 1 s
