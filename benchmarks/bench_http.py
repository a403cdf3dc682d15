"""Streaming over HTTP: hypercorn on loopback serving the default model, httpx clients.

Starts ``hypercorn -c hypercorn.toml furnace_trio.app:app`` on a free loopback port (with
``FURNACE_QUANT`` set per runtime), then runs closed loops of 1, 4, 16 and 32 concurrent
streaming chat completions (greedy, ``ignore_eos``, fixed ``max_tokens``): time to first
token p50/p95 (first content chunk), inter-token latency p50/p95, aggregate completion
tok/s (from ``usage``), and prefill tok/s of a 1,000-token prompt (its time to first token).

    python benchmarks/bench_http.py [--quick] [--quant q4,int8,none,int8-torch]

``-torch`` runtimes run without the native kernels (``FURNACE_NATIVE=0``).

Requests per stream: 3, 2, 3 and 2 at 1, 4, 16 and 32 streams (with one request per
stream a "closed loop" would never send a request after another finished).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from _common import PROMPTS, long_prompt_text, machine, split_runtime
from _raw_client import stream_request
from bench_engine import Result
from hypercorn.config import Config
from quart_trio import QuartTrio

from furnace_trio.engine import Engine
from furnace_trio.loading.loader import LoadedModel
from furnace_trio.server.app import create_app
from furnace_trio.server.backend import Backend
from furnace_trio.server.config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quiet_config(port: int) -> Config:
    """hypercorn's settings for ``127.0.0.1:port``, without access or error log."""
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = None
    return config


def app_over(engine: Engine, loaded: LoadedModel, model: str, max_context: int) -> QuartTrio:
    """furnace-trio's app over an engine of this process (the app's lifespan runs it), to
    serve in this process with hypercorn.trio.serve."""
    return create_app(
        ServerConfig(log_level="WARNING"),
        backend_factory=lambda _: Backend(engine, loaded.tokenizer, model, max_context),
    )


async def one_request(
    client: httpx.AsyncClient, content: str, max_tokens: int, ttft: list[float], itl: list[float]
) -> int:
    body = stream_request(client.headers["x-bench-model"], content, max_tokens)
    start = time.perf_counter()
    last: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - start)
                else:
                    itl.append(now - last)
                last = now
    return tokens


async def closed_loop(
    client: httpx.AsyncClient, prompts: list[str], streams: int, rounds: int, max_tokens: int
) -> Result:
    ttft: list[float] = []
    itl: list[float] = []
    counts: list[int] = []

    async def worker(w: int) -> None:
        for r in range(rounds):
            prompt = prompts[(w * rounds + r) % len(prompts)]
            counts.append(await one_request(client, prompt, max_tokens, ttft, itl))

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(streams)))
    return Result(streams, sum(counts), time.perf_counter() - start, ttft, itl)


async def run(
    base_url: str, model: str, workloads: list[tuple[int, int]], max_tokens: int
) -> list[Result]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    headers = {"x-bench-model": model}
    async with httpx.AsyncClient(
        base_url=base_url, timeout=600, limits=limits, headers=headers
    ) as client:
        await closed_loop(client, list(PROMPTS), 1, 1, 4)  # warm-up
        results = [await closed_loop(client, list(PROMPTS), s, r, max_tokens) for s, r in workloads]
        prefill = await closed_loop(client, [long_prompt_text()], 1, 1, 1)
        results.append(prefill)
        return results


def serve(
    quant: str, port: int, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    name, native, kv_dtype = split_runtime(quant)
    env = dict(os.environ, FURNACE_QUANT=name, FURNACE_LOG_LEVEL="WARNING", **(extra_env or {}))
    env["FURNACE_NATIVE"] = "1" if native else "0"
    env["FURNACE_KV_CACHE_DTYPE"] = kv_dtype
    cmd = [sys.executable, "-m", "hypercorn", "-c", str(ROOT / "hypercorn.toml")]
    cmd += ["--bind", f"127.0.0.1:{port}", "--access-logfile", "/dev/null"]
    cmd += ["furnace_trio.app:app"]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)


def wait_ready(
    base_url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 300
) -> None:
    """Until ``/health`` answers 200 (the model is loaded); fails if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("the server exited during startup")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--quant", default="q4,int8,none,int8-torch")
    args = parser.parse_args()
    max_tokens = 16 if args.quick else 64
    workloads = [(1, 1), (4, 1)] if args.quick else [(1, 3), (4, 2), (16, 3), (32, 2)]
    print(f"machine: {machine()}")
    table: list[str] = []
    prefills: list[str] = []
    for quant in args.quant.split(","):
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        proc = serve(quant, port)
        try:
            wait_ready(base_url, proc)
            model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
            results = asyncio.run(run(base_url, model, workloads, max_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        table.extend(r.row(quant) for r in results[:-1])
        prefill = results[-1]
        prefills.append(f"| {quant} | {prefill.ttft[0] * 1e3:.0f} |")
    print(f"\nHTTP streaming, max_tokens={max_tokens}, greedy, closed loop\n")
    print("| runtime | streams | tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(table))
    print("\n| runtime | TTFT of a ~1,000-token prompt, ms |")
    print("| --- | --- |")
    print("\n".join(prefills))


if __name__ == "__main__":
    main()
