"""What the HTTP and Trio layers cost: engine level vs over HTTP, interleaved, in one run.

The same runtime (``--quant``, default q4) on this machine: an Engine on its own model
thread in this process (as ``bench_engine.py`` runs it); the app served by hypercorn in
this process too, over that same engine (same weights, same KV cache, same threads); and a
hypercorn server in a subprocess (as ``bench_http.py`` starts it, as users run it). The raw
client runs in a process of its own (``_raw_client.py``) for both servers, the same one. Two processes' copies of
the weights can differ in speed by several percent (where their pages fall in memory), as
much as the whole HTTP side costs; the same-process side has none of that. Each round runs ``--streams`` concurrent streams (default
1) of ``--requests`` streaming requests each (greedy, ``ignore_eos``, ``--max-tokens``) on
every side, one side at a time (the others' threads sleep), in an order that rotates from
round to round, so every side sees the same moments of this machine's memory bandwidth,
which drifts by tens of percent within a minute. A side's speed is compared with the
engine's in the same round; the table gives the median and the quartiles of those ratios,
and a 95% interval for that median (bootstrap over the rounds): where the interval's low
end is above 0.95, the run says the side costs under 5% of the engine's speed, beyond its
own noise.

HTTP clients (``--client``, default ``raw,httpx``): ``raw`` (a blocking socket, HTTP/1.1 by
hand, SSE events counted per read: what the server costs, with as little Python client as
possible on the same 2 cores), ``httpx`` (an asyncio ``httpx.AsyncClient`` parsing every
chunk as JSON, as ``bench_http.py`` does) and ``curl`` (``_curl_client.py``: C, a few
microseconds per chunk; its CPU column includes each curl process's start, and it times
requests, not tokens, so it has no ITL).

CPU time per token is read per thread (``/proc/<pid>/task/*/schedstat``): the Trio thread
(the server's, or this process's for the engine side), the model's threads (the model thread
and its OpenMP team), and the client's thread. On 2 cores every millisecond a thread other
than the model's spends during a step is taken from the step.

    python benchmarks/bench_overhead.py [--streams 1] [--rounds 16] [--requests 1]
                                        [--max-tokens 64] [--client raw,httpx,curl]
                                        [--warm-up] [--also-env KEY=VALUE,...]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import trio
from _common import PROMPTS, chat_ids, machine, pct
from _curl_client import curl_requests
from _raw_client import ClientProcess
from bench_engine import closed_loop as engine_loop
from bench_engine import load_on_thread, make_engine
from bench_http import app_over, free_port, quiet_config, serve, wait_ready
from bench_http import closed_loop as http_loop
from hypercorn.trio import serve as serve_asgi


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of every thread of ``pid`` (``schedstat``: nanoseconds on a CPU)."""
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except FileNotFoundError:
            continue  # the thread ended
    return out


@dataclass
class Round:
    tokens: int
    seconds: float
    itl_p50: float
    trio_cpu: float  # seconds
    model_cpu: float
    client_cpu: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Side:
    name: str
    rounds: list[Round] = field(default_factory=list)


def measured(pid: int, trio_tid: int, run: Callable[[], tuple[int, float, float, float]]) -> Round:
    """Run one side's round; ``run`` returns (tokens, seconds, ITL p50, client CPU s)."""
    before = thread_cpu(pid)
    tokens, seconds, itl, client = run()
    after = thread_cpu(pid)
    delta = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    trio_cpu = delta.pop(trio_tid, 0.0)
    return Round(tokens, seconds, itl, trio_cpu, sum(delta.values()), client)


def httpx_requests(
    base_url: str, model: str, streams: int, requests: int, max_tokens: int
) -> tuple[int, float, float, float]:
    """The same with httpx, on a plain thread with its own asyncio loop (httpx's async
    backend must not see the Trio run of the engine side)."""

    async def go() -> tuple[int, float, float, float]:
        cpu = time.thread_time()
        headers = {"x-bench-model": model}
        async with httpx.AsyncClient(base_url=base_url, timeout=600, headers=headers) as client:
            r = await http_loop(client, list(PROMPTS), streams, requests, max_tokens)
        return r.tokens, r.seconds, pct(r.itl, 50), time.thread_time() - cpu

    out: list[tuple[int, float, float, float]] = []
    worker = threading.Thread(target=lambda: out.append(asyncio.run(go())))
    worker.start()
    worker.join()
    return out[0]


def median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (a fixed seed: the same rounds
    give the same interval)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def report(sides: list[Side], args: argparse.Namespace) -> None:
    print(
        f"\n{args.streams} stream(s), {args.quant}, max_tokens={args.max_tokens}, {args.rounds} rounds x "
        f"{args.requests} request(s) per stream per side; medians over rounds; '/ engine': each round's "
        "tok/s over the engine's in the same round, median [quartiles], and the median's 95% "
        "interval (bootstrap); CPU in ms per token\n"
    )
    print(
        "| side | tok/s | ITL p50 ms | / engine | median's 95% interval | Trio thread "
        "| model threads | client |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    engine = sides[0].rounds
    e_itl = statistics.median(r.itl_p50 for r in engine)
    for side in sides:
        rs = side.rounds
        itl = statistics.median(r.itl_p50 for r in rs)
        ratios = [r.tok_s / e.tok_s for r, e in zip(rs, engine, strict=True)]
        lo, mid, hi = quartiles(ratios)
        ci_lo, ci_hi = median_interval(ratios)
        extra = "" if side is sides[0] else f" (+{(itl - e_itl) * 1e3:.2f})"
        itl_cell = "n/a" if math.isnan(itl) else f"{itl * 1e3:.2f}{extra}"  # curl: no ITL

        def per_token(cpu: Callable[[Round], float], rs: list[Round] = rs) -> str:
            return f"{statistics.median(cpu(r) / r.tokens for r in rs) * 1e3:.2f}"

        client = "" if side is sides[0] else per_token(lambda r: r.client_cpu)
        print(
            f"| {side.name} | {statistics.median(r.tok_s for r in rs):.1f} | "
            f"{itl_cell} | {mid:.3f} [{lo:.3f}, {hi:.3f}] | [{ci_lo:.3f}, {ci_hi:.3f}] | "
            f"{per_token(lambda r: r.trio_cpu)} | {per_token(lambda r: r.model_cpu)} | {client} |"
        )


@dataclass
class Server:
    """A hypercorn server in a subprocess and the pid of its worker (where the app runs)."""

    label: str
    proc: subprocess.Popen[bytes]
    port: int
    worker: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_server(label: str, quant: str, extra_env: dict[str, str]) -> Server:
    port = free_port()
    server = Server(label, serve(quant, port, extra_env), port)
    wait_ready(server.base_url, server.proc)
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        server.worker = int(f.read().split()[-1])  # hypercorn's worker process
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quant", default="q4")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--requests", type=int, default=1, help="per stream")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--client",
        default="raw,httpx",
        help="comma-separated HTTP clients: raw, httpx, curl ('both': raw,httpx); the "
        "same-process side uses the first of raw and curl listed",
    )
    parser.add_argument(
        "--warm-up",
        action="store_true",
        help="an untimed 4-token request on each side right before its round (with one "
        "request per round, the rounds otherwise include each side's first-request cost)",
    )
    parser.add_argument(
        "--also-env",
        metavar="KEY=VALUE,...",
        help="a second server with this extra environment, measured with the raw client "
        "(an A/B of a server setting in the same run)",
    )
    parser.add_argument(
        "--client-cpus",
        metavar="N,...",
        help="run the raw client on these CPUs only (start this script under taskset to "
        "keep the servers and the model off them): whether the HTTP side's cost is the "
        "client sharing the model's cores",
    )
    parser.add_argument(
        "--client-idle",
        action="store_true",
        help="run the raw client under SCHED_IDLE: it reads only on CPU time the model's "
        "threads leave, as a client on another core or machine would take none of theirs",
    )
    args = parser.parse_args()
    print(f"machine: {machine()}")
    clients = ["raw", "httpx"] if args.client == "both" else args.client.split(",")
    if not set(clients) <= {"raw", "httpx", "curl"}:
        parser.error(f"unknown client in {args.client!r}")
    # The same-process side's client must run in a process of its own (not httpx, which
    # would share this process's interpreter with the server).
    lean = next((c for c in clients if c != "httpx"), "raw")
    servers: list[Server] = []
    cpus = None if args.client_cpus is None else {int(c) for c in args.client_cpus.split(",")}
    client_process = ClientProcess(cpus, idle=args.client_idle)
    mine = sorted(os.sched_getaffinity(0))
    print(
        f"CPUs: this process {mine}, the raw client {'the same' if cpus is None else sorted(cpus)}"
        f"{' (SCHED_IDLE)' if args.client_idle else ''}"
    )
    try:
        servers.append(start_server("", args.quant, {}))
        if args.also_env:
            extra = dict(item.split("=", 1) for item in args.also_env.split(","))
            servers.append(start_server(f", {args.also_env}", args.quant, extra))
        model = httpx.get(f"{servers[0].base_url}/v1/models").json()["data"][0]["id"]
        thread, loaded, runner = load_on_thread(args.quant)
        prompts = [chat_ids(loaded, p) for p in PROMPTS]

        def over_http(
            port: int, client: str, streams: int, requests: int, max_tokens: int = args.max_tokens
        ) -> tuple[int, float, float, float]:
            if client == "raw":
                return client_process.requests(port, model, PROMPTS, streams, requests, max_tokens)
            if client == "curl":
                return curl_requests(port, model, PROMPTS, streams, requests, max_tokens)
            base_url = f"http://127.0.0.1:{port}"
            return httpx_requests(base_url, model, streams, requests, max_tokens)

        # sides[0]: the engine; sides[1]: the server in this process over that same engine;
        # then (side, server, client) for every server in a process of its own.
        http_sides = [(Side(f"HTTP ({c})"), servers[0], c) for c in clients]
        http_sides += [(Side(f"HTTP ({lean}{s.label})"), s, lean) for s in servers[1:]]
        sides = [Side("engine"), Side(f"HTTP ({lean}, same process)")]
        sides += [side for side, _, _ in http_sides]

        async def rounds() -> None:
            engine = make_engine(runner, thread, loaded)
            me, trio_tid = os.getpid(), threading.get_native_id()
            port = free_port()

            def engine_side() -> tuple[int, float, float, float]:
                r = trio.from_thread.run(
                    engine_loop, engine, prompts, args.streams, args.requests, args.max_tokens
                )
                return r.tokens, r.seconds, pct(r.itl, 50), 0.0

            def same_process_side() -> tuple[int, float, float, float]:
                return over_http(port, lean, args.streams, args.requests)

            async def warm_up(i: int) -> None:
                """A 4-token request on side ``i``, untimed, right before its round."""
                if i == 0:
                    await engine_loop(engine, prompts, 1, 1, 4)
                else:
                    side_port, client = (
                        (port, lean)
                        if i == 1
                        else (http_sides[i - 2][1].port, http_sides[i - 2][2])
                    )
                    await trio.to_thread.run_sync(over_http, side_port, client, 1, 1, 4)

            config = quiet_config(port)
            app = app_over(engine, loaded, model, runner.max_context)
            async with trio.open_nursery() as nursery:
                # The app runs the engine (its lifespan starts it), which the engine side
                # also drives directly: one engine, one set of weights, one process.
                await nursery.start(serve_asgi, app, config)
                await trio.to_thread.run_sync(wait_ready, f"http://127.0.0.1:{port}")
                await engine_loop(engine, prompts, 1, 1, 4)  # warm-up
                await trio.to_thread.run_sync(over_http, port, lean, 1, 1, 4)
                for _, server, client in http_sides:
                    over_http(server.port, client, 1, args.requests)  # warm-up (blocks)
                for k in range(args.rounds):
                    order = list(range(len(sides)))
                    order = order[k % len(order) :] + order[: k % len(order)]
                    for i in order:
                        if args.warm_up:
                            await warm_up(i)
                        if i < 2:
                            # Both serve from this Trio run; the clock is read from a
                            # worker thread, so the Trio thread's CPU is all theirs.
                            run = engine_side if i == 0 else same_process_side
                            r = await trio.to_thread.run_sync(measured, me, trio_tid, run)
                        else:
                            _, server, client = http_sides[i - 2]
                            r = measured(
                                server.worker,
                                server.worker,
                                lambda s=server, c=client: over_http(
                                    s.port, c, args.streams, args.requests
                                ),
                            )
                        sides[i].rounds.append(r)
                nursery.cancel_scope.cancel()

        trio.run(rounds)
    finally:
        client_process.close()
        for server in servers:
            server.proc.terminate()
            server.proc.wait(timeout=30)
    report(sides, args)


if __name__ == "__main__":
    main()
