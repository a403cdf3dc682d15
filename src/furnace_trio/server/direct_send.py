"""Streamed body chunks written straight to hypercorn's HTTP/1.1 socket.

For every chunk of a streamed response, hypercorn's send path builds two event objects,
frames the bytes with h11, takes the connection's send lock, opens a shielded cancel scope
and writes through Trio's ``SocketStream.send_all``, which passes through Trio's scheduler
once more after the write. On the CPU, where the model's threads use every core, that
costs tokens: with the chunks written directly, the event loop's CPU per token of one
stream of the default model fell from 0.34 to 0.29 ms, and 16 streams ran 1.8% faster
(``benchmarks/bench_overhead.py``; ``docs/benchmarks.md``, eleventh session).

:class:`DirectSend` does for a body chunk what that path does, minus the scheduling: the
chunk is framed (:meth:`DirectSend.frame`: as h11 frames it, by hand where the body is
chunked), and one non-blocking ``os.write`` hands it to the kernel. What it cannot finish
that way goes through hypercorn's own raw-data path, in order, under hypercorn's lock:

- another write holds the connection's send lock (it queues behind it);
- the socket buffer is full (the rest of the chunk; a slow reader);
- the write fails (hypercorn's own handling of a broken connection).

Only a body chunk with more to follow on a hypercorn HTTP/1.1 connection served by its
Trio worker takes this path: every token's chunk of a stream, and a whole JSON body too
(quart sends it as one chunk with more to follow, then an empty last one, which goes
through hypercorn to end the response). The connection is found through the ASGI ``send`` callable's
objects (``HTTPStream.app_send`` -> ``H11Protocol`` -> ``TCPServer``), checked by type;
anything else (HTTP/2, another server, a test client, another hypercorn layout) takes the
ordinary ``send``. ``FURNACE_DIRECT_SEND=0`` turns it off.

A stream's fast lane (``FURNACE_FAST_LANE``, see ``RequestStream.attach_fast_lane``) writes
its deltas through :meth:`DirectSend.write_now` from the engine's task, which cannot await:
what the socket does not take is kept as :attr:`DirectSend.pending`, the lane ends, and the
response's next send puts those bytes through hypercorn's path first. At 16 streams of the
default model this read 1 to 4% more tokens per second than the deltas going through the
response's task (``docs/benchmarks.md``, twelfth session); at one stream, no difference
beyond the noise.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import h11
import trio
from hypercorn.events import RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.utils import suppress_body

try:  # the writer h11 frames a chunked body with (private: checked by type where used)
    from h11._writers import ChunkedWriter as _ChunkedWriter
except ImportError:  # another h11 layout: every chunk goes through h11's send
    _ChunkedWriter = None  # type: ignore[assignment,misc]


@dataclass(slots=True)
class DirectSend:
    """One HTTP/1.1 connection's direct path; :meth:`of` finds it, or says there is none."""

    stream: HTTPStream
    protocol: H11Protocol
    connection: h11.Connection
    server: TCPServer
    socket: trio.socket.SocketType
    #: The server's tally: "direct" (a chunk written whole by ``os.write``), "fast_lane"
    #: (the same, by :meth:`write_now` from the engine's task) and "handed_over" (a chunk,
    #: or its rest, sent through hypercorn's path).
    counts: Counter[str]
    #: Framed bytes :meth:`write_now` could not write; they go out (through hypercorn)
    #: before anything else is sent on this response.
    pending: bytes = b""

    @classmethod
    def of(cls, send: Any, method: str, status: int, counts: Counter[str]) -> DirectSend | None:
        """The direct path behind an ASGI ``send`` callable for a response to ``method``
        with ``status``, if it is hypercorn's HTTP/1.1 on Trio as this module knows it and
        the response has a body (not HEAD, 1xx, 204 or 304: hypercorn drops those bodies);
        ``None`` otherwise. Every object it relies on is checked by type, so another
        hypercorn layout falls back rather than fails."""
        if suppress_body(method, status):
            return None
        stream = getattr(send, "__self__", None)
        if not isinstance(stream, HTTPStream) or not hasattr(stream, "state"):
            return None
        protocol = getattr(getattr(stream, "send", None), "__self__", None)
        if not isinstance(protocol, H11Protocol):
            return None
        connection = getattr(protocol, "connection", None)
        server = getattr(getattr(protocol, "send", None), "__self__", None)
        if not isinstance(connection, h11.Connection) or not isinstance(server, TCPServer):
            return None
        socket_stream = getattr(server, "stream", None)
        if not isinstance(socket_stream, trio.SocketStream) or not isinstance(
            getattr(server, "send_lock", None), trio.Lock
        ):
            return None
        return cls(stream, protocol, connection, server, socket_stream.socket, counts)

    def ready(self) -> bool:
        """Whether :meth:`write_now` may write a chunk now: the response is in its body,
        nothing is pending, no other write holds the connection, the socket is open."""
        return (
            not self.pending
            and self.stream.state is ASGIHTTPState.RESPONSE
            and self.connection.our_state is h11.SEND_BODY
            and not self.server.send_lock.locked()
            and self.socket.fileno() >= 0
        )

    def write_now(self, body: bytes) -> None:
        """Write one body chunk without awaiting (the engine's task calls it, through a
        stream's fast lane), after :meth:`ready` said yes. What the socket does not take
        now, or all of it if the write fails, is kept in :attr:`pending` for
        :meth:`send` to put through hypercorn first; never raises."""
        try:
            data = self.frame(body)
        except h11.LocalProtocolError:  # cannot happen after ready(); dropped, as hypercorn
            return
        written = self._write(data)
        if written == len(data):
            self.counts["fast_lane"] += 1
        else:
            self.pending = data[written:]

    def frame(self, body: bytes) -> bytes:
        """The wire bytes of one body chunk, while the response is in its body.

        In a chunked body (every stream) the chunk is framed here, as h11's chunked writer
        frames a ``Data`` event (its size in hex, CRLF, the bytes, CRLF), which changes none
        of h11's state. h11's ``send`` runs its state machine and writer for each event, and
        after a model step that code is out of the caches: in the live server it cost about
        20 us of the event loop's CPU per token against 5 here. Any other body (one with a
        ``Content-Length``, which h11 counts) is framed by h11's ``send``."""
        if type(getattr(self.connection, "_writer", None)) is _ChunkedWriter:
            # h11 writes nothing for an empty chunk: a zero size would end the body.
            return b"%x\r\n%b\r\n" % (len(body), body) if body else b""
        data = self.connection.send(h11.Data(data=body))
        assert data is not None  # None only for ConnectionClosed
        return data

    def _write(self, data: bytes) -> int:
        """One non-blocking ``os.write`` of ``data``: the bytes written, 0 where the
        connection's send lock is held, the socket closed, or the write failed."""
        # The descriptor is read each time: -1 once hypercorn closed the socket (a number
        # kept from before could by then name another file). No await until the write.
        fd = self.socket.fileno()
        if fd < 0 or self.server.send_lock.locked():
            return 0
        try:
            return os.write(fd, data)
        except OSError:  # BlockingIOError, or a broken connection: hypercorn's to handle
            return 0

    async def send(self, message: Any) -> bool:
        """Send ``message`` if it is a body chunk with more to follow; ``False`` (nothing
        done) for any other message, or while the response is not in its body. Whatever
        :meth:`write_now` left goes out first, whatever the message."""
        if self.pending:
            data, self.pending = self.pending, b""
            self.counts["handed_over"] += 1
            await self.protocol.send(RawData(data=data))
        body = message.get("body", b"")
        if (
            message["type"] != "http.response.body"
            or not message.get("more_body", False)
            or not body
            or self.stream.state is not ASGIHTTPState.RESPONSE
            or self.connection.our_state is not h11.SEND_BODY
        ):
            return False
        try:
            data = self.frame(bytes(body))
        except h11.LocalProtocolError:
            # As hypercorn's own send: ignored once the peer broke the protocol.
            if self.connection.their_state is not h11.ERROR:
                raise
            return True
        written = self._write(data)
        if written == len(data):
            self.counts["direct"] += 1
            return True
        self.counts["handed_over"] += 1
        await self.protocol.send(RawData(data=data[written:]))
        return True


def render_metrics(counts: Mapping[str, int]) -> str:
    """``furnace_direct_send_chunks_total{path=...}`` in Prometheus text format: body
    chunks written straight to the socket by the response's handler ("direct") or by the
    engine's task through a stream's fast lane ("fast_lane"), or handed to hypercorn
    ("handed_over": the send lock was held, the socket buffer was full, or the write
    failed)."""
    lines = [
        "# HELP furnace_direct_send_chunks_total Response body chunks by the path that wrote them.",
        "# TYPE furnace_direct_send_chunks_total counter",
    ]
    lines += [
        f'furnace_direct_send_chunks_total{{path="{path}"}} {counts.get(path, 0)}'
        for path in ("direct", "fast_lane", "handed_over")
    ]
    return "\n".join(lines) + "\n"
