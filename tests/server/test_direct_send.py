"""Streamed chunks written straight to hypercorn's socket (:mod:`furnace_trio.server.direct_send`),
over a real hypercorn socket with the scripted engine: the bytes a client reads are those
of hypercorn's own path, on a keep-alive connection, for a reader that falls behind, and
with the path turned off."""

from __future__ import annotations

import json
import os
import socket
from collections import Counter
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import h11
import httpx
import openai
import pytest
import trio

from furnace_trio.server import direct_send
from furnace_trio.server.config import ConfigError, ServerConfig
from furnace_trio.server.direct_send import DirectSend

from .. import scripted
from ..http_server import MODEL_NAME, Served, serve_scripted

#: 600 single-byte tokens: one SSE chunk each, about 130 KB of events in all.
LONG = "".join(f"{i:03d}, " for i in range(120))


def long_script(prompt: tuple[int, ...], index: int) -> Sequence[int]:
    return [*scripted.encode(LONG), scripted.EOS]


def long_runner() -> scripted.ScriptedRunner:
    return scripted.ScriptedRunner(long_script, num_blocks=512, max_context=2048)


def request_bytes(max_tokens: int = 1000) -> bytes:
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def read_chunked_response(stream: trio.SocketStream, buffer: bytearray) -> bytes:
    """One HTTP/1.1 response with a chunked body, read off ``stream`` by hand (what is left
    after it stays in ``buffer``): its body, with every chunk's framing checked."""

    async def fill() -> None:
        data = await stream.receive_some(65536)
        assert data, "the server closed the connection"
        buffer.extend(data)

    while b"\r\n\r\n" not in buffer:
        await fill()
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in head.lower()
    buffer[:] = rest
    body = bytearray()
    while True:
        while b"\r\n" not in buffer:
            await fill()
        size_line, _, rest = bytes(buffer).partition(b"\r\n")
        size = int(size_line, 16)
        while len(rest) < size + 2:
            await fill()
            size_line, _, rest = bytes(buffer).partition(b"\r\n")
        assert rest[size : size + 2] == b"\r\n", "a chunk does not end where its size says"
        body += rest[:size]
        buffer[:] = rest[size + 2 :]
        if size == 0:
            return bytes(body)


def streamed_text(body: bytes) -> str:
    """The content of an SSE body of chat chunks; asserts it ends with ``[DONE]``."""
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    text = []
    for event in events[:-1]:
        assert event.startswith("data: ")
        chunk = json.loads(event.removeprefix("data: "))
        for choice in chunk["choices"]:
            text.append(choice["delta"].get("content") or "")
    return "".join(text)


async def until_no_request_in_flight(served: Served) -> None:
    """The response's handler returns just after its last bytes leave: wait (bounded) for
    that, so that no chunk of it is still to be counted."""
    for _ in range(500):
        if served.state.in_flight == 0:
            return
        await trio.sleep(0.01)
    raise AssertionError("a request is still in flight")


async def sdk_stream_text(url: str, **extra: Any) -> str:
    """The text of a streamed chat completion of up to 1,000 tokens, read by the SDK."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    async with client:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "count"}],
            max_tokens=1000,
            stream=True,
            **extra,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


@pytest.mark.parametrize(("direct_send", "fast_lane"), [(True, True), (True, False), (False, True)])
async def test_a_stream_reads_the_same_with_or_without_the_direct_path(
    direct_send: bool, fast_lane: bool
) -> None:
    async with serve_scripted(
        long_runner(), direct_send=direct_send, fast_lane=fast_lane
    ) as served:
        assert await sdk_stream_text(served.url) == LONG
        await until_no_request_in_flight(served)
        counts = served.state.direct_send
        if direct_send and fast_lane:
            # The role chunk from the response's task, the deltas from the engine's (but
            # for any that came while the response's task was busy), the rest from the
            # response's task again: all straight to the socket.
            assert counts["fast_lane"] >= len(LONG) - 10
            assert counts["direct"] + counts["fast_lane"] >= len(LONG) + 3
            assert counts["handed_over"] == 0
        elif direct_send:
            # Every content chunk (and the role chunk) went straight to the socket.
            assert counts["direct"] >= len(LONG)
            assert counts["handed_over"] == counts["fast_lane"] == 0
        else:  # the fast lane needs the direct path
            assert counts["direct"] == counts["handed_over"] == counts["fast_lane"] == 0


@pytest.mark.parametrize(
    ("extra", "expected"),
    [({}, LONG), ({"stop": ["119"]}, LONG.removesuffix("119, ")), ({"logprobs": True}, LONG)],
    ids=["plain", "stop-strings", "logprobs"],
)
async def test_only_plain_streams_take_the_fast_lane(extra: dict[str, Any], expected: str) -> None:
    """Stop strings and logprobs make more than deltas of a token, so their streams go
    through the response's task; the text reads the same either way."""
    async with serve_scripted(long_runner()) as served:
        assert await sdk_stream_text(served.url, **extra) == expected
        await until_no_request_in_flight(served)
        if extra:
            assert served.state.direct_send["fast_lane"] == 0
        else:
            assert served.state.direct_send["fast_lane"] >= len(LONG) - 10


async def test_two_streams_on_one_keep_alive_connection() -> None:
    """h11 frames the chunks written directly, so its state stays right: the terminating
    chunk follows them, and the connection serves the next request."""
    async with serve_scripted(long_runner()) as served:
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        buffer = bytearray()
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            with trio.fail_after(30):
                for _ in range(2):
                    await stream.send_all(request_bytes())
                    assert streamed_text(await read_chunked_response(stream, buffer)) == LONG
        assert not buffer
        await until_no_request_in_flight(served)
        counts = served.state.direct_send
        assert counts["direct"] + counts["fast_lane"] >= 2 * len(LONG)


async def test_a_reader_that_falls_behind_gets_every_byte_in_order() -> None:
    """The client reads nothing until the server's socket buffer is full: the chunk a
    write could not finish goes on through hypercorn's path, in order, and the stream
    reads whole once the client catches up."""
    async with serve_scripted(long_runner(), send_buffer=4096) as served:
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect((host, int(port)))
        buffer = bytearray()
        async with trio.SocketStream(sock) as stream:
            with trio.fail_after(30):
                await stream.send_all(request_bytes())
                # The engine writes all 600 tokens in well under this; the socket holds
                # a few kilobytes of their ~130.
                await trio.sleep(0.5)
                assert served.state.in_flight == 1
                assert streamed_text(await read_chunked_response(stream, buffer)) == LONG
        await until_no_request_in_flight(served)
        counts = served.state.direct_send
        assert counts["handed_over"] >= 1
        assert counts["direct"] >= 1
        before = dict(counts)  # the /metrics response's own body is counted once written
        async with httpx.AsyncClient(base_url=served.url) as http:
            metrics = (await http.get("/metrics")).text
        for path, count in before.items():
            assert f'furnace_direct_send_chunks_total{{path="{path}"}} {count}\n' in metrics


def test_the_direct_path_and_the_fast_lane_are_server_settings() -> None:
    assert ServerConfig().direct_send is True
    assert ServerConfig.from_env({"FURNACE_DIRECT_SEND": "0"}).direct_send is False
    assert ServerConfig.from_env({"FURNACE_DIRECT_SEND": "true"}).direct_send is True
    with pytest.raises(ConfigError, match="FURNACE_DIRECT_SEND"):
        ServerConfig.from_env({"FURNACE_DIRECT_SEND": "sometimes"})
    assert ServerConfig().fast_lane is True
    assert ServerConfig.from_env({"FURNACE_FAST_LANE": "0"}).fast_lane is False
    with pytest.raises(ConfigError, match="FURNACE_FAST_LANE"):
        ServerConfig.from_env({"FURNACE_FAST_LANE": "maybe"})


def test_a_send_that_is_not_hypercorns_http1_has_no_direct_path() -> None:
    class Other:
        async def app_send(self, message: object) -> None:
            pass

    async def plain(message: object) -> None:
        pass

    assert DirectSend.of(plain, "POST", 200, Counter()) is None
    assert DirectSend.of(Other().app_send, "POST", 200, Counter()) is None


def _h11_in_body(headers: list[tuple[str, str]]) -> h11.Connection:
    """A server-side h11 connection that has sent a response's head with ``headers``."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
    assert isinstance(connection.next_event(), h11.Request)
    connection.send(h11.Response(status_code=200, headers=headers))
    assert connection.our_state is h11.SEND_BODY
    return connection


def _frame_with(connection: h11.Connection, body: bytes) -> bytes:
    direct = DirectSend(None, None, connection, None, None, Counter())  # type: ignore[arg-type]
    return direct.frame(body)


@pytest.mark.parametrize(
    "body", [b"x", b"data: {}\n\n", "\u00e9\U0001f600".encode() * 9, b"z" * 70000]
)
def test_a_chunk_is_framed_as_h11_frames_it(body: bytes) -> None:
    """A chunked body's chunk is framed without h11's send; the bytes are h11's, and h11's
    state is what its own send leaves (the end of the body still closes it properly)."""
    ours = _h11_in_body([("transfer-encoding", "chunked")])
    theirs = _h11_in_body([("transfer-encoding", "chunked")])
    assert _frame_with(ours, body) == theirs.send(h11.Data(data=body))
    assert _frame_with(ours, b"") == theirs.send(h11.Data(data=b"")) == b""
    assert ours.our_state is theirs.our_state is h11.SEND_BODY
    assert ours.send(h11.EndOfMessage()) == theirs.send(h11.EndOfMessage()) == b"0\r\n\r\n"


def test_a_body_with_a_content_length_is_framed_by_h11() -> None:
    """With a Content-Length h11 counts the bytes: they go through its send, which refuses
    one byte too many and ends the message once they are all written."""
    connection = _h11_in_body([("content-length", "5")])
    assert _frame_with(connection, b"abc") == b"abc"
    with pytest.raises(h11.LocalProtocolError):
        _frame_with(connection, b"def")
    connection = _h11_in_body([("content-length", "5")])
    assert _frame_with(connection, b"abcde") == b"abcde"
    assert connection.send(h11.EndOfMessage()) == b""


async def test_head_requests_and_whole_bodies_on_one_connection() -> None:
    """Hypercorn drops the body of a HEAD response; the direct path must not write it (h11
    refuses it, and the connection broke). A whole JSON body (``Content-Length``, one chunk
    with more to follow, then the end) goes through it framed by h11 as well."""
    async with serve_scripted() as served:
        async with httpx.AsyncClient(base_url=served.url) as http:
            for path in ("/health", "/v1/models", "/metrics"):
                head = await http.head(path)
                assert head.status_code == 200
                assert head.content == b""
                get = await http.get(path)
                assert get.status_code == 200
                assert len(get.content) == int(get.headers["content-length"]) > 0
            models = (await http.get("/v1/models")).json()
            assert models["data"][0]["id"] == MODEL_NAME
        await until_no_request_in_flight(served)
        # Three GETs of /health, /v1/models and /metrics and one more of /v1/models.
        assert served.state.direct_send["direct"] >= 4


async def test_a_failed_write_hands_the_whole_chunk_to_hypercorn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A write that raises (as on a reset connection) leaves the chunk to hypercorn's own
    path, which sends it (here the socket is fine) in its place: the stream reads whole."""
    calls = 0

    def failing_write(fd: int, data: bytes) -> int:
        nonlocal calls
        calls += 1
        if calls % 7 == 0:
            raise BrokenPipeError("every seventh write fails")
        return os.write(fd, data)

    monkeypatch.setattr(direct_send, "os", SimpleNamespace(write=failing_write))
    async with serve_scripted(long_runner()) as served:
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        buffer = bytearray()
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            with trio.fail_after(30):
                await stream.send_all(request_bytes())
                assert streamed_text(await read_chunked_response(stream, buffer)) == LONG
        await until_no_request_in_flight(served)
        counts = served.state.direct_send
        assert counts["handed_over"] == calls // 7 >= len(LONG) // 7
        # The first failure ends the stream's fast lane (its chunk goes to hypercorn
        # before anything else); the rest go from the response's task.
        assert counts["direct"] + counts["fast_lane"] == calls - calls // 7
        assert 1 <= counts["fast_lane"] <= 5  # writes 2 to 6 at most (1: the role chunk)
