"""A client that stops reading a stream without closing: its request pauses once it holds
``max_response_bytes`` unsent (``/metrics`` says so), generation stops for it while the
server serves others, and when the client finally leaves, everything is freed.

Over a raw socket with small kernel buffers on both ends, so the few kilobytes the kernel
holds fill after a handful of events.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import trio

from furnace_trio.engine import EngineConfig
from furnace_trio.engine.backlog import TOKEN_BYTES, TOP_LOGPROB_BYTES
from furnace_trio.server.backend import engine_config
from furnace_trio.server.config import DEFAULT_MAX_RESPONSE_BYTES, ConfigError, ServerConfig

from .. import scripted
from ..http_server import serve_scripted
from .waiting import engine_idle, engine_reaches

#: ~20 tokens with 20 alternatives each.
LIMIT = 20 * (TOKEN_BYTES + 20 * TOP_LOGPROB_BYTES)
MAX_TOKENS = 3000


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def stream_request(port: int) -> bytes:
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "logprobs": True,
            "top_logprobs": 20,
        }
    ).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _metrics(http: httpx.AsyncClient) -> str:
    return (await http.get("/metrics")).text


async def open_non_reader(port: int) -> trio.SocketStream:
    """A connected socket with a small receive buffer (set before connecting)."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


async def test_reader_that_stops_reading_pauses_its_request() -> None:
    runner = scripted.ScriptedRunner(lambda p, i: [], num_blocks=2048, max_context=4096)
    async with (
        serve_scripted(
            runner, engine_config=EngineConfig(max_response_bytes=LIMIT), send_buffer=4096
        ) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
    ):
        port = int(served.url.rsplit(":", 1)[1])
        async with await open_non_reader(port) as stalled:
            await stalled.send_all(stream_request(port))
            await engine_reaches(
                served.engine, lambda s: s.requests_paused == 1, "a pause", timeout_s=20
            )
            assert metric(await _metrics(http), "furnace_requests_paused") == 1
            tokens = served.engine.statistics().generation_tokens_total
            # the backlog's ~20 tokens, plus what the loopback socket took (~120 events of
            # ~3 KB) before its sends blocked; without the bound all 3000 are generated
            assert tokens < 400, tokens
            # others are served meanwhile, and the paused request takes no steps
            reply = await http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
            )
            assert reply.json()["usage"]["completion_tokens"] == 5
            text = await _metrics(http)
            assert metric(text, "furnace_requests_paused") == 1
            assert metric(text, "furnace_generation_tokens_total") == tokens + 5
        await engine_reaches(served.engine, engine_idle, "the engine idle")
    assert served.engine.statistics().requests["aborted"] == 1


def test_max_response_bytes_is_a_setting_the_engine_gets() -> None:
    config = ServerConfig.from_env({"FURNACE_MAX_RESPONSE_BYTES": "65536"})
    assert engine_config(config, "cpu").max_response_bytes == 65536
    assert ServerConfig().max_response_bytes == DEFAULT_MAX_RESPONSE_BYTES
    for bad in ("0", "lots"):
        with pytest.raises(ConfigError, match="FURNACE_MAX_RESPONSE_BYTES"):
            ServerConfig.from_env({"FURNACE_MAX_RESPONSE_BYTES": bad})
