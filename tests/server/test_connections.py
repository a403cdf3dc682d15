"""Connections end when HTTP says they end, over a raw loopback socket.

A response to ``Connection: close`` or to HTTP/1.0 ends with end-of-file, streaming or
not; a kept-alive connection left idle is closed after ``keep_alive_timeout``; a request
framed by both ``Content-Length`` and ``Transfer-Encoding`` is answered, then its
connection closed (RFC 9112 section 6.3). Each read is bounded: a connection that stays
open fails the test instead of hanging it.
"""

from __future__ import annotations

import json

import trio

from ..http_server import ANSWERS, serve_scripted

CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
STREAM = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
#: How long a connection that should close may take to; far above what closing takes.
EOF_WITHIN_S = 10.0


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def post(body: bytes, *, version: str = "1.1", headers: str = "") -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/{version}\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body


async def read_to_eof(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes; fails if it does not close in time."""
    data = bytearray()
    with trio.fail_after(EOF_WITHIN_S):
        while chunk := await stream.receive_some(65536):
            data += chunk
    return bytes(data)


async def exchange(url: str, request: bytes) -> bytes:
    async with await trio.open_tcp_stream("127.0.0.1", _port(url)) as stream:
        await stream.send_all(request)
        return await read_to_eof(stream)


async def test_connection_close_gets_eof_after_the_response() -> None:
    async with serve_scripted() as served:
        reply = await exchange(served.url, post(CHAT, headers="Connection: close\r\n"))
        health = await exchange(
            served.url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
    assert reply.startswith(b"HTTP/1.1 200") and ANSWERS[0].encode() in reply
    assert health.startswith(b"HTTP/1.1 200")


async def test_http_1_0_gets_eof_streaming_and_not() -> None:
    async with serve_scripted() as served:
        reply = await exchange(served.url, post(CHAT, version="1.0"))
        streamed = await exchange(served.url, post(STREAM, version="1.0"))
    assert reply.startswith(b"HTTP/1.1 200") and ANSWERS[0].encode() in reply
    # HTTP/1.0 has no chunked encoding: the end of the stream is the end of the connection
    assert streamed.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in streamed.lower()
    assert streamed.endswith(b"data: [DONE]\n\n")


async def test_idle_kept_alive_connection_closes_after_keep_alive_timeout() -> None:
    async with (
        serve_scripted(keep_alive_timeout=0.5) as served,
        await trio.open_tcp_stream("127.0.0.1", _port(served.url)) as stream,
    ):
        for _ in range(2):  # the timer restarts after each response on the connection
            await stream.send_all(post(CHAT))
            with trio.fail_after(EOF_WITHIN_S):
                response = b""
                while ANSWERS[0].encode() not in response:
                    response += await stream.receive_some(65536)
        assert await read_to_eof(stream) == b""


async def test_content_length_with_transfer_encoding_closes_after_the_response() -> None:
    chunked = hex(len(CHAT))[2:].encode() + b"\r\n" + CHAT + b"\r\n0\r\n\r\n"
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + chunked
    )
    async with serve_scripted() as served:
        reply = await exchange(served.url, request)
        # the server goes on serving others
        after = await exchange(served.url, post(CHAT, headers="Connection: close\r\n"))
    head = reply.split(b"\r\n\r\n", 1)[0].lower()
    assert reply.startswith(b"HTTP/1.1 200") and b"connection: close" in head
    assert reply.count(b"HTTP/1.1") == 1
    assert ANSWERS[0].encode() in after


async def test_connection_close_stream_ends_with_done_then_eof() -> None:
    async with serve_scripted() as served:
        streamed = await exchange(served.url, post(STREAM, headers="Connection: close\r\n"))
    assert streamed.startswith(b"HTTP/1.1 200")
    # the last chunk, then the chunked body's end
    assert streamed.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), streamed[-100:]
