"""Hostile and broken connections under load, on a real loopback socket (scripted engine).

While ordinary clients stream, others at the same time: ask for ``Connection: close``,
speak HTTP/1.0 (streaming and not), leave kept-alive connections idle, and open streams
with 20 ``top_logprobs`` per token that they never read. Checked: every ordinary stream
ends with ``[DONE]``; every connection that should close sees end-of-file; every stalled
stream's request pauses and the engine generates nothing more for it; once the stalled
clients leave, nothing runs and no KV block is held.

The suite runs a small round; ``nox -s fuzz`` runs this module as a script with more
(``python -m tests.test_hostile_connections --rounds 10 --clients 16``).
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from dataclasses import dataclass, field

import httpx
import trio

from furnace_trio.engine import EngineConfig
from furnace_trio.engine.backlog import TOKEN_BYTES, TOP_LOGPROB_BYTES

from . import scripted
from .http_server import Served, serve_scripted
from .server.test_connections import EOF_WITHIN_S, read_to_eof
from .server.waiting import engine_reaches

KEEP_ALIVE_S = 0.5
LIMIT = 10 * (TOKEN_BYTES + 20 * TOP_LOGPROB_BYTES)
MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass(slots=True)
class Report:
    streams_done: int = 0
    closed: dict[str, int] = field(default_factory=dict)

    def count(self, kind: str) -> None:
        self.closed[kind] = self.closed.get(kind, 0) + 1


def _request(port: int, body: dict[str, object], version: str, headers: str = "") -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST /v1/chat/completions HTTP/{version}\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n{headers}\r\n"
    ).encode() + data


async def _connect(port: int, receive_buffer: int | None = None) -> trio.SocketStream:
    sock = trio.socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


async def _ordinary_stream(http: httpx.AsyncClient, report: Report) -> None:
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 24}
    last = ""
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                last = line
    assert last == "data: [DONE]", last
    report.streams_done += 1


async def _closing(port: int, kind: str, report: Report) -> None:
    """One request that must end with end-of-file after its response."""
    stream_it = kind.endswith("stream")
    body = {"messages": MESSAGES, "max_tokens": 8, "stream": stream_it}
    if kind.startswith("http/1.0"):
        request = _request(port, body, "1.0")
    else:
        request = _request(port, body, "1.1", "Connection: close\r\n")
    async with await _connect(port) as stream:
        await stream.send_all(request)
        reply = await read_to_eof(stream)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    if stream_it:  # HTTP/1.1 frames it in chunks; HTTP/1.0 ends it with the connection
        end = b"data: [DONE]\n\n" if kind.startswith("http/1.0") else b"\r\n0\r\n\r\n"
        assert reply.endswith(end) and b"data: [DONE]" in reply, reply[-200:]
    report.count(kind)


async def _idle(port: int, report: Report) -> None:
    """One request on a kept-alive connection, then silence: closed after the timeout."""
    async with await _connect(port) as stream:
        await stream.send_all(_request(port, {"messages": MESSAGES, "max_tokens": 4}, "1.1"))
        reply = await read_to_eof(stream)
    assert reply.startswith(b"HTTP/1.1 200") and reply.count(b"HTTP/1.1") == 1
    report.count("idle keep-alive")


async def hostile_round(served: Served, *, clients: int, stalled: int) -> Report:
    """``clients`` ordinary streams and as many of each hostile kind, with ``stalled``
    readers held open throughout; returns what completed."""
    port = int(served.url.rsplit(":", 1)[1])
    report = Report()
    body = {
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": 800,
        "logprobs": True,
        "top_logprobs": 20,
    }
    readers = [await _connect(port, receive_buffer=4096) for _ in range(stalled)]
    try:
        for reader in readers:
            await reader.send_all(_request(port, body, "1.1"))
        await engine_reaches(
            served.engine, lambda s: s.requests_paused == stalled, "the pauses", timeout_s=20
        )
        tokens = served.engine.statistics().generation_tokens_total
        async with (
            httpx.AsyncClient(base_url=served.url, timeout=60) as http,
            trio.open_nursery() as nursery,
        ):
            for _ in range(clients):
                nursery.start_soon(_ordinary_stream, http, report)
                for kind in ("close", "close stream", "http/1.0", "http/1.0 stream"):
                    nursery.start_soon(_closing, port, kind, report)
                nursery.start_soon(_idle, port, report)
        stats = served.engine.statistics()
        assert stats.requests_paused == stalled
        generated_by_others = clients * (24 + 8 + 8 + 8 + 8 + 4)
        assert stats.generation_tokens_total <= tokens + generated_by_others
    finally:
        for reader in readers:
            await reader.aclose()
    stats = await engine_reaches(
        served.engine, lambda s: s.idle, "the engine idle", timeout_s=EOF_WITHIN_S
    )
    assert not stats.leaks(), stats.leaks()
    assert stats.requests_paused == 0
    return report


def _served(clients: int) -> serve_scripted:  # type: ignore[valid-type]
    runner = scripted.ScriptedRunner(lambda p, i: [], num_blocks=4096, max_context=2048)
    return serve_scripted(
        runner,
        engine_config=EngineConfig(max_running=clients + 8, max_response_bytes=LIMIT),
        send_buffer=8192,
        keep_alive_timeout=KEEP_ALIVE_S,
    )


async def run(*, rounds: int, clients: int, stalled: int) -> list[Report]:
    reports = []
    async with _served(clients + stalled) as served:
        for _ in range(rounds):
            reports.append(await hostile_round(served, clients=clients, stalled=stalled))
    return reports


async def test_hostile_connections_under_load() -> None:
    (report,) = await run(rounds=1, clients=4, stalled=2)
    assert report.streams_done == 4
    assert report.closed == {
        kind: 4
        for kind in ("close", "close stream", "http/1.0", "http/1.0 stream", "idle keep-alive")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--stalled", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    reports = trio.run(lambda: run(rounds=args.rounds, clients=args.clients, stalled=args.stalled))
    for number, report in enumerate(reports):
        sys.stdout.write(f"round {number}: {report.streams_done} streams done, {report.closed}\n")
    sys.stdout.write("every connection closed as HTTP says, every stalled stream paused\n")


if __name__ == "__main__":
    main()
