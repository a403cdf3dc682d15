"""What each layer of the serving stack costs per streamed chunk, with no model.

The model is replaced by a step that sleeps ``--step-ms`` on the model thread (the GIL is
released, as the kernels release it), so the Trio thread's CPU time per chunk is what the
layers above the model cost. Every row streams ``--chunks`` chunks of a real chunk's size
to a client in a subprocess (a blocking socket that reads until the body ends) and reads
the Trio thread's CPU time (``time.thread_time``) around the whole request:

- ``wake``: ``ModelThread.run`` of the sleep, nothing sent per chunk (the hand-off alone);
- ``socket``: + the socket's own ``send`` per chunk (the kernel: loopback TCP, waking the
  client);
- ``trio``: + ``trio.SocketStream.send_all`` instead (Trio's checkpoint around it);
- ``hypercorn``: a bare ASGI app under hypercorn's Trio worker (+ hypercorn and h11);
- ``quart``: a quart-trio route streaming an async generator (+ quart): the stack the
  server runs on, with nothing of ours;
- ``engine``: furnace-trio's Engine over the sleeping runner, its stream consumed in
  process (scheduler, detokenizer, stream events: no HTTP);
- ``furnace``: the server's app (``create_app``) over that engine under hypercorn, a
  streamed chat completion (each delta sent by the response's task through hypercorn).

So ``quart - wake`` is the stack's own cost per chunk, and ``furnace - engine`` what the
HTTP side of furnace-trio costs on top of its engine, the stack included. Rows run in an
order that rotates every round; the table gives medians over rounds.

    python benchmarks/bench_stack.py [--chunks 256] [--rounds 5] [--step-ms 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio
from _common import machine
from _raw_client import ClientProcess
from bench_engine import closed_loop
from bench_http import free_port, quiet_config, wait_ready
from hypercorn.trio import serve
from quart import Response, request
from quart_trio import QuartTrio

from furnace_trio.core.plan import SampledToken, StepPlan
from furnace_trio.engine import Engine, EngineConfig
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.loading.default_model import default_model_path
from furnace_trio.loading.tokenizer import Tokenizer
from furnace_trio.server.app import create_app
from furnace_trio.server.backend import Backend
from furnace_trio.server.config import ServerConfig

MODEL = "bench-stack"
# The size of one streamed token's chat chunk.
CHUNK = (
    b'data: {"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":'
    b'"chat.completion.chunk","created":1764000000,"model":"SmolLM2-135M-Instruct",'
    b'"choices":[{"index":0,"delta":{"content":" the"},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
ROWS = (
    "wake",
    "socket",
    "trio",
    "hypercorn",
    "quart",
    "engine",
    "furnace",
)
FURNACE_ROWS = ("furnace",)


class SleepRunner:
    """A ``StepRunner`` whose step sleeps (GIL released) and samples one fixed token."""

    block_size = 16
    num_blocks = 4096
    max_context = 8192

    def __init__(self, seconds: float, token_id: int) -> None:
        self.seconds = seconds
        self.token_id = token_id

    def step(self, plan: StepPlan) -> list[SampledToken]:
        time.sleep(self.seconds)
        return [
            SampledToken(spec.seq_id, self.token_id)
            for chunk in plan.chunks
            for spec in chunk.samples
        ]


def get_request(chunks: int) -> bytes:
    return f"GET /?n={chunks} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode()


def chat_request(chunks: int) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": chunks,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def plain_handler(
    mode: str, thread: ModelThread, step_s: float
) -> Callable[[trio.SocketStream], Awaitable[None]]:
    """A hand-written HTTP/1.1 chunked response: the ``wake``, ``socket``, ``trio`` rows."""

    async def handler(stream: trio.SocketStream) -> None:
        head = await stream.receive_some(1 << 16)
        chunks = int(head.split(b"n=", 1)[1].split(b" ", 1)[0])
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        framed = b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
        for _ in range(chunks):
            await thread.run(time.sleep, step_s)
            if mode == "socket":
                try:
                    sent = os.write(stream.socket.fileno(), framed)  # the send syscall alone
                except BlockingIOError:
                    sent = 0
                if sent < len(framed):
                    await stream.send_all(framed[sent:])
            elif mode == "trio":
                await stream.send_all(framed)
        await stream.send_all(b"0\r\n\r\n")
        await stream.aclose()

    return handler


def asgi_app(thread: ModelThread, step_s: float) -> Callable[..., Awaitable[None]]:
    """A bare ASGI app streaming the chunks: the ``hypercorn`` row."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks = int(scope["query_string"].split(b"=", 1)[1])
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(chunks):
            await thread.run(time.sleep, step_s)
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def quart_app(thread: ModelThread, step_s: float) -> QuartTrio:
    """A quart-trio route streaming an async generator: the ``quart`` row."""
    app = QuartTrio("bench_stack")

    @app.route("/")
    async def stream() -> Response:
        chunks = int(request.args["n"])

        async def body() -> AsyncIterator[bytes]:
            for _ in range(chunks):
                await thread.run(time.sleep, step_s)
                yield CHUNK

        response = Response(body(), mimetype="text/event-stream")
        response.timeout = None
        return response

    return app


async def main_async(args: argparse.Namespace, client: ClientProcess) -> dict[str, list[float]]:
    step_s = args.step_ms / 1000
    tokenizer = Tokenizer.from_gguf(default_model_path())
    token = tokenizer.encode(" the", add_special_tokens=False)[0]
    thread = ModelThread()

    def make_engine() -> Engine:
        return Engine(
            SleepRunner(step_s, token),
            decode=tokenizer.decode,
            eos_token_ids=tokenizer.eos_token_ids,
            config=EngineConfig(),
            model_thread=thread,
        )

    engine = make_engine()

    def factory(config: ServerConfig) -> Backend:
        return Backend(make_engine(), tokenizer, MODEL, SleepRunner.max_context)

    ports = {row: free_port() for row in ROWS if row != "engine"}
    apps = {
        "hypercorn": asgi_app(thread, step_s),
        "quart": quart_app(thread, step_s),
        "furnace": create_app(ServerConfig(), backend_factory=factory),
    }

    def exchange(port: int, request: bytes, expected: int) -> None:
        """One request through the client; fails unless ``expected`` events arrived."""
        status, events = client.fetch(port, request)
        if status != "200" or events < expected:
            raise RuntimeError(f"port {port}: status {status}, {events} events")

    async def measure(row: str) -> float:
        """Trio-thread CPU seconds per chunk for one request of ``args.chunks`` chunks."""
        start = time.thread_time()
        if row == "engine":
            result = await closed_loop(engine, [[token] * 8], 1, 1, args.chunks)
            if result.tokens != args.chunks:
                raise RuntimeError(f"the engine streamed {result.tokens} tokens")
        elif row in FURNACE_ROWS:
            # the chat stream adds its role chunk and [DONE]: at least one event per chunk
            await trio.to_thread.run_sync(
                exchange, ports[row], chat_request(args.chunks), args.chunks
            )
        else:
            expected = 0 if row == "wake" else args.chunks
            await trio.to_thread.run_sync(exchange, ports[row], get_request(args.chunks), expected)
        return (time.thread_time() - start) / args.chunks

    cpu: dict[str, list[float]] = {row: [] for row in ROWS}
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        for mode in ("wake", "socket", "trio"):
            handler = plain_handler(mode, thread, step_s)
            await nursery.start(trio.serve_tcp, handler, ports[mode])
        for row, app in apps.items():
            await nursery.start(serve, app, quiet_config(ports[row]))
        for row in FURNACE_ROWS:
            await trio.to_thread.run_sync(wait_ready, f"http://127.0.0.1:{ports[row]}")
        for row in ROWS:
            await measure(row)  # warm-up
        for k in range(args.rounds):
            order = ROWS[k % len(ROWS) :] + ROWS[: k % len(ROWS)]
            for row in order:
                cpu[row].append(await measure(row))
        engine.shutdown()
        nursery.cancel_scope.cancel()
    return cpu


def paired(cpu: dict[str, list[float]], row: str, base: str) -> float:
    """The median over rounds of ``row - base`` within each round, in us."""
    return statistics.median(a - b for a, b in zip(cpu[row], cpu[base], strict=True)) * 1e6


def report(cpu: dict[str, list[float]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.chunks} chunks per request, a {args.step_ms} ms sleeping step, "
        f"{args.rounds} rounds; Trio-thread CPU per chunk in us: the median over rounds, "
        "and the median of each round's difference to the row above"
    )
    print("\n| row | CPU per chunk | over the row above | rounds (min, max) |")
    print("| --- | --- | --- | --- |")
    for i, row in enumerate(ROWS):
        values = [v * 1e6 for v in cpu[row]]
        above = "" if i == 0 or row == "engine" else f"{paired(cpu, row, ROWS[i - 1]):+.1f}"
        print(
            f"| {row} | {statistics.median(values):.1f} | {above} "
            f"| {min(values):.1f}, {max(values):.1f} |"
        )
    print(
        f"\nthe stack (quart - wake): {paired(cpu, 'quart', 'wake'):.1f} us per chunk; "
        f"furnace-trio's HTTP side (furnace - engine): {paired(cpu, 'furnace', 'engine'):.1f}; "
        "without the fast lane (furnace-no-fast-lane - engine): "
        f"{paired(cpu, 'furnace-no-fast-lane', 'engine'):.1f}; "
        "with hypercorn's send path (furnace-hypercorn-send - engine): "
        f"{paired(cpu, 'furnace-hypercorn-send', 'engine'):.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=8.0)
    args = parser.parse_args()
    print(machine())
    client = ClientProcess()
    try:
        cpu = trio.run(main_async, args, client)
    finally:
        client.close()
    report(cpu, args)


if __name__ == "__main__":
    main()
