"""What the HTTP and Trio layers cost a single stream: engine level vs over HTTP, interleaved.

The same runtime (``--quant``, default q4) twice on this machine: a hypercorn server in a
subprocess (as ``bench_http.py`` starts it) and an in-process Engine on its own model thread
(as ``bench_engine.py`` runs it). Rounds alternate between the two, each a closed loop of one
stream (greedy, ``ignore_eos``, ``--max-tokens``), so both sides see the same moments of this
machine's memory bandwidth; medians over rounds are compared. Only one side runs at a time
(the other's threads sleep).

    python benchmarks/bench_overhead.py [--rounds 6] [--requests 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading

import httpx
import trio
from _common import PROMPTS, chat_ids, machine, pct
from bench_engine import closed_loop as engine_loop
from bench_engine import make_engine
from bench_http import closed_loop as http_loop
from bench_http import free_port, serve, wait_ready

from furnace_trio.loader import load_model
from furnace_trio.model_thread import ModelThread
from furnace_trio.runner import ModelRunner, RunnerConfig


def http_round(base_url: str, model: str, requests: int, max_tokens: int) -> tuple[float, float]:
    """One HTTP round, run to the end on a plain thread with its own asyncio loop (httpx's
    async backend must not see the Trio run of the engine side); blocks the caller."""

    async def go() -> tuple[float, float]:
        headers = {"x-bench-model": model}
        async with httpx.AsyncClient(base_url=base_url, timeout=600, headers=headers) as client:
            r = await http_loop(client, list(PROMPTS), 1, requests, max_tokens)
        return r.tokens / r.seconds, pct(r.itl, 50)

    out: list[tuple[float, float]] = []
    worker = threading.Thread(target=lambda: out.append(asyncio.run(go())))
    worker.start()
    worker.join()
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quant", default="q4")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    proc = serve(args.quant, port)
    try:
        wait_ready(base_url, proc)
        model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        thread = ModelThread()
        loaded = thread.call(load_model, None)
        settings = RunnerConfig(device="cpu", kv_cache_bytes=512 << 20, quantization=args.quant)
        runner = thread.call(ModelRunner.from_loaded, loaded, settings)
        prompts = [chat_ids(loaded, p) for p in PROMPTS]
        engine_side: list[tuple[float, float]] = []
        http_side: list[tuple[float, float]] = []

        async def engine_rounds() -> None:
            engine = make_engine(runner, thread, loaded)
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                await engine_loop(engine, prompts, 1, 1, 4)  # warm-up
                http_round(base_url, model, 1, 4)  # warm-up (blocks: nothing else runs)
                for _ in range(args.rounds):
                    r = await engine_loop(engine, prompts, 1, args.requests, args.max_tokens)
                    engine_side.append((r.tok_s, pct(r.itl, 50)))
                    http_side.append(http_round(base_url, model, args.requests, args.max_tokens))
                engine.shutdown()
                nursery.cancel_scope.cancel()

        trio.run(engine_rounds)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    e_tok = statistics.median(t for t, _ in engine_side)
    h_tok = statistics.median(t for t, _ in http_side)
    e_itl = statistics.median(i for _, i in engine_side)
    h_itl = statistics.median(i for _, i in http_side)
    print(
        f"\none stream, {args.quant}, max_tokens={args.max_tokens}, {args.rounds} rounds x "
        f"{args.requests} requests each side, medians\n"
    )
    print("| side | tok/s | ITL p50 ms | rounds (tok/s) |")
    print("| --- | --- | --- | --- |")
    print(
        f"| engine | {e_tok:.1f} | {e_itl * 1e3:.2f} | "
        f"{', '.join(f'{t:.0f}' for t, _ in engine_side)} |"
    )
    print(
        f"| HTTP | {h_tok:.1f} | {h_itl * 1e3:.2f} | "
        f"{', '.join(f'{t:.0f}' for t, _ in http_side)} |"
    )
    print(f"\nHTTP / engine: {h_tok / e_tok:.3f} (tok/s), ITL +{(h_itl - e_itl) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
