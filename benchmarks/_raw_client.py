"""The benchmarks' lean HTTP client: blocking loopback sockets, HTTP/1.1 written by hand.

Standard library only, so it also runs as a client process of its own
(:class:`ClientProcess`: one JSON command per stdin line, one JSON result per stdout
line), for a server that runs inside the benchmark's own process, whose interpreter (and
GIL) the client must not share.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def stream_request(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The benchmarks' request: a streamed greedy chat completion of exactly ``max_tokens``
    tokens (``ignore_eos``), with the usage chunk at the end."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


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
            body = json.dumps(stream_request(model, prompts[r % len(prompts)], max_tokens)).encode()
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


def fetch(port: int, request: bytes) -> tuple[str, int]:
    """Send one raw ``request`` and read the response until its chunked body ends (or the
    server closes); its status code and the number of SSE events in it."""
    body = bytearray()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request)
        while not body.endswith(b"\r\n0\r\n\r\n"):
            data = sock.recv(1 << 16)
            if not data:
                break
            body += data
    return body[9:12].decode(errors="replace"), body.count(b"data: ")


class ClientProcess:
    """This module in a process of its own; its methods block until the answer comes."""

    def __init__(self, cpus: set[int] | None = None, *, idle: bool = False) -> None:
        """``cpus``: the CPUs the client may run on (default: this process's); ``idle``:
        Linux's ``SCHED_IDLE`` policy, so that the client runs only on CPU time that no
        other thread wants (where every core is the model's, it reads what has arrived
        whenever the model's threads let a core go)."""

        def setup() -> None:
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            if idle:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=setup if cpus is not None or idle else None,
        )

    def _call(self, command: list[object]) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the client process ended (its error is above)")
        return json.loads(line)

    def requests(
        self,
        port: int,
        model: str,
        prompts: Sequence[str],
        streams: int,
        requests: int,
        max_tokens: int,
    ) -> tuple[int, float, float, float]:
        """:func:`raw_requests` in the client process."""
        command = ["requests", port, model, list(prompts), streams, requests, max_tokens]
        tokens, seconds, itl, cpu = self._call(command)
        return int(tokens), float(seconds), float(itl), float(cpu)

    def fetch(self, port: int, request: bytes) -> tuple[str, int]:
        """:func:`fetch` in the client process."""
        status, events = self._call(["fetch", port, request.hex()])
        return str(status), int(events)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def main() -> None:
    for line in sys.stdin:
        kind, *args = json.loads(line)
        if kind == "fetch":
            port, request = args
            result: object = fetch(port, bytes.fromhex(request))
        else:
            result = raw_requests(*args)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
