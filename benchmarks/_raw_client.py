"""The benchmarks' lean HTTP client: blocking loopback sockets, HTTP/1.1 written by hand.

Standard library only, so it also runs as a client process of its own (``python
_raw_client.py``: one JSON command per stdin line, ``[port, model, prompts, streams,
requests, max_tokens]``, one JSON result per stdout line), for a server that runs inside
the benchmark's own process, whose interpreter the client must not share.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Sequence


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def raw_stream(
    port: int, model: str, prompts: Sequence[str], first: int, requests: int, max_tokens: int
) -> tuple[int, list[float], float]:
    """One stream's requests on one keep-alive connection with a lean client: a blocking
    loopback socket, HTTP/1.1 written by hand, SSE events counted per read, one JSON parse
    per request (the usage chunk). Returns tokens, ITLs and this thread's CPU seconds."""
    tokens = 0
    itl: list[float] = []
    cpu = time.thread_time()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for r in range(first, first + requests):
            body = json.dumps(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": prompts[r % len(prompts)]}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode()
            head = (
                "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            sock.sendall(head.encode() + body)
            received = bytearray()
            last: float | None = None
            while not received.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of the body
                data = sock.recv(1 << 16)
                if not data:
                    raise ConnectionError("the server closed the connection")
                now = time.perf_counter()
                events = data.count(b'"content":"') - data.count(b'"content":""')
                if events:
                    if last is not None:
                        itl.extend([(now - last) / events] * events)
                    last = now
                received += data
            if b" 200 " not in received[:16]:
                raise RuntimeError(received[:300].decode(errors="replace"))
            at = received.rindex(b"data: {")
            usage = json.loads(received[at + 6 : received.index(b"\n\n", at)])["usage"]
            tokens += usage["completion_tokens"]
    return tokens, itl, time.thread_time() - cpu


def raw_requests(
    port: int, model: str, prompts: Sequence[str], streams: int, requests: int, max_tokens: int
) -> tuple[int, float, float, float]:
    """``streams`` concurrent raw streams (a thread each) of ``requests`` requests."""
    out: list[tuple[int, list[float], float]] = []

    def stream(w: int) -> None:
        out.append(raw_stream(port, model, prompts, w * requests, requests, max_tokens))

    workers = [threading.Thread(target=stream, args=(w,)) for w in range(streams)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - start
    if len(out) != streams:
        raise RuntimeError("a client stream failed")
    itl = [i for _, itls, _ in out for i in itls]
    return sum(t for t, _, _ in out), seconds, _p50(itl), sum(c for _, _, c in out)


def main() -> None:
    for line in sys.stdin:
        port, model, prompts, streams, requests, max_tokens = json.loads(line)
        result = raw_requests(port, model, prompts, streams, requests, max_tokens)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
