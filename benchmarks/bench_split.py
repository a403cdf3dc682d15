"""Would an HTTP front end in a process of its own cost the engine less? A prototype.

furnace-trio serves HTTP in the engine's process: on 2 cores the HTTP side's Python holds
the GIL the model thread needs between steps (``bench_timeline.py``). vLLM runs its API
server and its engine core as separate processes. This script measures that split on this
machine, against the engine alone and against furnace-trio's app, in one run:

- ``engine``: an Engine in this process, consumed in process (as ``bench_engine.py``);
- ``HTTP``: furnace-trio's app served by hypercorn in this process over that engine (as
  ``bench_overhead.py``'s same-process side);
- ``split``: a front end in a process of its own (quart-trio on hypercorn, as ours), which
  for each request opens a Unix socket to this process, where a relay task submits the
  request to the same engine and writes every token's text back as one JSON line; the
  front end turns each line into an SSE chunk of a real chunk's shape.

The clients are the raw client in a process of its own (``_raw_client.py``); sides rotate
from round to round, and each round's speed is divided by the engine's in that round. The
front end is a prototype: streaming chat only, no errors, no cancellation.

    python benchmarks/bench_split.py [--streams 1] [--rounds 10] [--requests 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator

import trio

CHUNK_HEAD = (
    b'data: {"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":'
    b'"chat.completion.chunk","created":1764000000,"model":"bench-split",'
    b'"choices":[{"index":0,"delta":{"content":'
)
CHUNK_TAIL = b'},"logprobs":null,"finish_reason":null}]}\n\n'


def front_end(port: int, path: str) -> None:
    """The front end's process: a quart-trio app on hypercorn, relaying to ``path``."""
    from hypercorn.config import Config
    from hypercorn.trio import serve
    from quart import Response, request
    from quart_trio import QuartTrio

    app = QuartTrio(__name__)

    @app.get("/health")
    async def health() -> str:
        return "ok"

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        body = await request.get_json()
        ask = {"prompt": body["messages"][-1]["content"], "max_tokens": body["max_tokens"]}
        conn = await trio.open_unix_socket(path)
        await conn.send_all(json.dumps(ask).encode() + b"\n")

        async def chunks() -> AsyncIterator[bytes]:
            pending = b""
            try:
                yield b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
                while data := await conn.receive_some(1 << 16):
                    pending += data
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        message = json.loads(line)
                        if "text" in message:
                            yield CHUNK_HEAD + json.dumps(message["text"]).encode() + CHUNK_TAIL
                            continue
                        usage = {"choices": [], "usage": {"completion_tokens": message["tokens"]}}
                        yield b"data: " + json.dumps(usage).encode() + b"\n\n"
                        yield b"data: [DONE]\n\n"
                        return
            finally:
                await conn.aclose()

        response = Response(chunks(), mimetype="text/event-stream")
        response.timeout = None
        return response

    # bench_http.quiet_config's settings, written out: importing bench_http loads torch.
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = None
    trio.run(serve, app, config)


def main() -> None:
    # Imported here, not at the top: the front end's process runs this file too, and
    # should load neither torch nor the engine.
    from _common import PROMPTS, chat_ids, machine
    from _raw_client import ClientProcess
    from bench_engine import closed_loop, load_on_thread, make_engine
    from bench_http import app_over, free_port, quiet_config, wait_ready
    from hypercorn.trio import serve

    from furnace_trio.core.params import SamplingParams
    from furnace_trio.engine import Delta, GenerationRequest

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quant", default="q4")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=2, help="per stream and side")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    thread, loaded, runner = load_on_thread(args.quant)
    prompts = [chat_ids(loaded, p) for p in PROMPTS]
    prompt_ids = dict(zip(PROMPTS, prompts, strict=True))
    model = "bench-split"
    client = ClientProcess()
    socket_dir = tempfile.TemporaryDirectory()
    path = os.path.join(socket_dir.name, "engine.sock")
    front_port = free_port()
    front = subprocess.Popen([sys.executable, __file__, "--front-end", str(front_port), path])
    speeds: dict[str, list[float]] = {"engine": [], "HTTP": [], "split": []}

    async def run() -> None:
        engine = make_engine(runner, thread, loaded)

        async def relay(conn: trio.SocketStream) -> None:
            pending = b""
            while b"\n" not in pending:
                pending += await conn.receive_some(1 << 16)
            ask = json.loads(pending.split(b"\n", 1)[0])
            params = SamplingParams(temperature=0.0, max_tokens=ask["max_tokens"], ignore_eos=True)
            stream = engine.submit(GenerationRequest(tuple(prompt_ids[ask["prompt"]]), params))
            tokens = 0
            async with stream:
                async for event in stream:
                    if isinstance(event, Delta) and event.token_ids:
                        tokens += len(event.token_ids)
                        await conn.send_all(json.dumps({"text": event.text}).encode() + b"\n")
            await conn.send_all(json.dumps({"tokens": tokens}).encode() + b"\n")
            await conn.aclose()

        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await listener.bind(path)
        listener.listen(64)
        port = free_port()
        config = quiet_config(port)
        app = app_over(engine, loaded, model, runner.max_context)
        ports = {"HTTP": port, "split": front_port}
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, config)
            nursery.start_soon(trio.serve_listeners, relay, [trio.SocketListener(listener)])
            await trio.to_thread.run_sync(wait_ready, f"http://127.0.0.1:{port}")
            await trio.to_thread.run_sync(wait_ready, f"http://127.0.0.1:{front_port}", front)
            for side_port in ports.values():  # warm-up
                await trio.to_thread.run_sync(client.requests, side_port, model, PROMPTS, 1, 1, 4)
            await closed_loop(engine, prompts, 1, 1, 4)
            sides = list(speeds)
            for k in range(args.rounds):
                for side in sides[k % 3 :] + sides[: k % 3]:
                    if side == "engine":
                        r = await closed_loop(
                            engine, prompts, args.streams, args.requests, args.max_tokens
                        )
                        tokens, seconds = r.tokens, r.seconds
                    else:
                        tokens, seconds, _, _ = await trio.to_thread.run_sync(
                            client.requests,
                            ports[side],
                            model,
                            PROMPTS,
                            args.streams,
                            args.requests,
                            args.max_tokens,
                        )
                    speeds[side].append(tokens / seconds)
            nursery.cancel_scope.cancel()

    try:
        trio.run(run)
    finally:
        client.close()
        front.kill()
        front.wait()
        socket_dir.cleanup()
    print(
        f"\n{args.streams} stream(s), {args.quant}, max_tokens={args.max_tokens}, "
        f"{args.rounds} rounds; '/ engine': each round's speed over the engine's in that round, "
        "median [quartiles]\n"
    )
    print("| side | tok/s | / engine |")
    print("| --- | --- | --- |")
    for side, values in speeds.items():
        ratios = [v / e for v, e in zip(values, speeds["engine"], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(
            f"| {side} | {statistics.median(values):.1f} | "
            f"{statistics.median(ratios):.3f} [{q1:.3f}, {q3:.3f}] |"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--front-end"]:
        front_end(int(sys.argv[2]), sys.argv[3])
    else:
        main()
