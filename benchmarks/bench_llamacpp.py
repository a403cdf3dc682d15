"""furnace-trio against llama.cpp's own server, on this machine, the same GGUF file.

Both servers run on loopback, each with both cores (``llama-server -t N -tb N`` for N
visible cores; furnace-trio as users run it, ``hypercorn furnace_trio.app:app``,
``FURNACE_QUANT`` per ``--quant``, default ``auto``: a GGUF's own blocks wherever a native
kernel takes them). They serve the default model's file (SmolLM2-135M-Instruct, Q4_1), or
``--model``: a GGUF path, or ``1b`` / ``8b`` for a Llama-3.2-1B- / Llama-3.1-8B-shaped model
with random weights, converted and quantized (``--model-type``, default Q4_K_M) by
llama.cpp's own tools (``_model_shapes.py``). Both decode at most ``--slots`` sequences at
once (default 16; furnace-trio's own default ``FURNACE_MAX_RUNNING`` on the CPU is 32):
llama-server gets that many slots, each with room for ``--slot-ctx`` tokens, and
furnace-trio ``FURNACE_MAX_RUNNING``. Continuous batching and prompt caching are on by
default in both, and both keep a float16 KV cache (1 GiB by default for furnace-trio; 16
slots of 2,048 tokens for llama-server, 1 GiB for a 1B shape).

Each round runs every workload on one server and then on the other, the order alternating
from round to round, so both see the same phases of this machine; a server's figures are
compared with the other's in the same round, and the table gives the median of those
ratios with their range. Workloads: closed loops of streaming chat completions (greedy,
``ignore_eos``, ``--max-tokens``) at 1, 4, 16 and 32 concurrent streams, as
``bench_http.py`` runs them (the same httpx client for both servers), and the time to
first token of a ~1,000-token prompt that starts with the round's number, so that neither
server's prompt cache holds more of it than the chat template's system message.

The servers start one after the other, each alone on the machine: the time until its
``/health`` (or llama-server's) answers 200 is its load time. Peak resident memory is
read at the end (``VmHWM`` of the server and its children). Before either starts, the
memory's speed is measured (a float32 sum over 1 GiB, as ``bench_kquant.py``): with one
stream, each server's ITL p50 is also given against the file's bytes read at that speed.
The speed is measured again before each server's round (shared hosts' memory speed moves
by the minute), and each round's one-stream ITL p50 is given against its own bound too.

Every completion must report ``--max-tokens`` completion tokens (``usage``), so both
servers did the same work; both servers' greedy answers to one prompt are printed.

    python benchmarks/bench_llamacpp.py [--llama-server PATH] [--rounds 5] [--quant q4]
                                        [--streams 1,4,16,32] [--max-tokens 64] [--quick]
                                        [--isa native|avx2] [--slots 16]
                                        [--llama-model GGUF] [--model GGUF|1b|8b]
                                        [--model-type Q4_K_M]

Without ``--llama-server`` (or ``$LLAMA_SERVER``, or ``llama-server`` on ``PATH``) it
builds one from PyPI's ``llama-cpp-python`` sources first (``_llama_server.py``).

``--isa avx2`` runs both without AVX-512, as on an AVX2-only CPU (AMD Zen 3): furnace-trio with
``FURNACE_NATIVE_FLAGS="-mno-avx512f -mno-avxvnni"`` (its AVX2 kernels), llama.cpp
built without AVX-512 and AVX-VNNI (``build-avx2``). The memory and the cores stay this
machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _common import PROMPTS, bandwidth, long_prompt_text, machine, pct
from _llama_server import find_llama_server, llama_server_version
from _model_shapes import SHAPES, gguf_file
from bench_http import Result, closed_loop, free_port, serve, wait_ready

from furnace_trio.loading.default_model import default_model_path

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("furnace-trio", "llama.cpp")
LLAMA_LOG = ROOT / "build" / "bench_llamacpp-llama-server.log"


def start_llama_server(
    binary: Path, gguf: Path, port: int, slots: int, slot_ctx: int, log: Path
) -> subprocess.Popen[bytes]:
    threads = str(os.cpu_count() or 1)
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", threads, "-tb", threads, "-np", str(slots), "-c", str(slots * slot_ctx)]
    cmd += ["--no-webui"]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """Resident memory of ``pid`` and its descendants (hypercorn runs its worker in a
    child); ``field="VmHWM"`` for each process's peak."""
    total = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                total += int(line.split()[1]) / 1024
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return total + sum(rss_mb(int(child), field) for child in f.read().split())


class RetryOnceTransport(httpx.AsyncHTTPTransport):
    """Sends a request again when the server closed its kept-alive connection without
    answering it. llama-server does that now and then when a stream starts on a connection
    that carried one before (no task of it in its log), which would end the run; the
    retries are counted and printed."""

    def __init__(self, limits: httpx.Limits) -> None:
        super().__init__(limits=limits)
        self.retries = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except httpx.RemoteProtocolError:
            self.retries += 1
            return await super().handle_async_request(request)


@dataclass
class Server:
    name: str
    base_url: str
    proc: subprocess.Popen[bytes]
    model: str = ""
    results: dict[str, list[Result]] = field(default_factory=dict)
    load_s: float = 0.0
    # GB/s of the float32 sum measured just before each of its rounds (the host's memory
    # speed moves by the minute, so each round's one-stream ITL meets its own bound)
    gbs: list[float] = field(default_factory=list)
    transports: list[RetryOnceTransport] = field(default_factory=list)

    def client(self) -> httpx.AsyncClient:
        # llama-server closes a connection idle for 5 s, httpx's default expiry: a request
        # sent on one at that moment fails. Expire them sooner on this side.
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=2)
        headers = {"x-bench-model": self.model}
        transport = RetryOnceTransport(limits)
        self.transports.append(transport)
        return httpx.AsyncClient(
            base_url=self.base_url, timeout=600, transport=transport, headers=headers
        )


async def one_round(
    server: Server, round_number: int, workloads: list[tuple[int, int]], max_tokens: int
) -> None:
    async with server.client() as client:
        for streams, requests in workloads:
            result = await closed_loop(client, list(PROMPTS), streams, requests, max_tokens)
            expected = streams * requests * max_tokens
            if result.tokens != expected:
                raise RuntimeError(
                    f"{server.name} reported {result.tokens} completion tokens at "
                    f"{streams} streams, not {expected}"
                )
            server.results.setdefault(str(streams), []).append(result)
        prefill = await closed_loop(client, [long_prompt_text(f"Round {round_number}. ")], 1, 1, 1)
        server.results.setdefault("prefill", []).append(prefill)


async def greedy_answer(server: Server, prompt: str, max_tokens: int) -> str:
    async with server.client() as client:
        response = await client.post(
            "/v1/chat/completions",
            json={
                "model": server.model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        )
        response.raise_for_status()
        return str(response.json()["choices"][0]["message"]["content"])


def ratios(ours: list[float], theirs: list[float]) -> str:
    values = sorted(a / b for a, b in zip(ours, theirs, strict=True))
    return f"{statistics.median(values):.2f}x [{values[0]:.2f}, {values[-1]:.2f}]"


def report(furnace: Server, llama: Server, gguf: Path, memory_gbs: float) -> None:
    print(
        "\n| streams | furnace-trio tok/s | llama.cpp tok/s | furnace / llama.cpp, median "
        "[range] | TTFT p50 ms (furnace / llama.cpp) | ITL p50 ms (furnace / llama.cpp) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for key, ours in furnace.results.items():
        if key == "prefill":
            continue
        theirs = llama.results[key]
        ours_tps = [r.tokens / r.seconds for r in ours]
        theirs_tps = [r.tokens / r.seconds for r in theirs]

        def p50(results: list[Result], attr: str) -> float:
            return pct([x for r in results for x in getattr(r, attr)], 50) * 1e3

        print(
            f"| {key} | {statistics.median(ours_tps):.1f} | {statistics.median(theirs_tps):.1f} "
            f"| {ratios(ours_tps, theirs_tps)} | {p50(ours, 'ttft'):.0f} / "
            f"{p50(theirs, 'ttft'):.0f} | {p50(ours, 'itl'):.1f} / {p50(theirs, 'itl'):.1f} |"
        )
    if "1" in furnace.results:
        # issue 28's bound: the file's bytes read once a token at the measured bandwidth
        size = gguf.stat().st_size
        bound_ms = size / (memory_gbs * 1e9) * 1e3
        parts = []
        for server in (furnace, llama):
            itl = pct([x for r in server.results["1"] for x in r.itl], 50) * 1e3
            parts.append(f"{server.name} {itl:.1f} ms ({bound_ms / itl:.0%} of the bound)")
        print(
            f"\nOne stream against the memory bound: {size / 1e6:.0f} MB at "
            f"{memory_gbs:.1f} GB/s (a float32 sum, before the servers started) is "
            f"{bound_ms:.1f} ms a token; ITL p50 {', '.join(parts)}"
        )
        parts = []
        for server in (furnace, llama):
            shares = sorted(
                size / (speed * 1e9) / pct(result.itl, 50)
                for speed, result in zip(server.gbs, server.results["1"], strict=True)
            )
            speeds = ", ".join(f"{speed:.1f}" for speed in server.gbs)
            parts.append(
                f"{server.name} {statistics.median(shares):.0%} [{shares[0]:.0%}, "
                f"{shares[-1]:.0%}] (GB/s {speeds})"
            )
        print(
            "Each round's one-stream ITL p50 against the bound at the bandwidth measured just "
            f"before that round: {'; '.join(parts)}"
        )
    ours_ttft = [r.ttft[0] for r in furnace.results["prefill"]]
    theirs_ttft = [r.ttft[0] for r in llama.results["prefill"]]
    print(
        f"\nTime to first token of a ~1,000-token prompt never sent before: furnace-trio "
        f"{statistics.median(ours_ttft) * 1e3:.0f} ms, llama.cpp "
        f"{statistics.median(theirs_ttft) * 1e3:.0f} ms; llama.cpp's time / furnace-trio's "
        f"{ratios(theirs_ttft, ours_ttft)} (above 1: furnace-trio is faster)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", help="the llama-server binary (else found or built)")
    parser.add_argument("--quant", default="auto", help="furnace-trio's FURNACE_QUANT")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", default="1,4,16,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16, help="sequences decoding at once")
    parser.add_argument(
        "--llama-model", help="another GGUF for llama.cpp only (e.g. a Q4_0 requantization)"
    )
    parser.add_argument("--model", help="a GGUF both serve, or 1b / 8b (built by _model_shapes.py)")
    parser.add_argument("--model-type", default="Q4_K_M", help="the type of a built 1b / 8b")
    parser.add_argument("--slot-ctx", type=int, default=2048, help="llama-server's per slot")
    parser.add_argument("--quick", action="store_true", help="1 round, 1 and 4 streams")
    parser.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="avx2: both servers without AVX-512 (and llama.cpp without AVX-VNNI)",
    )
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    rounds, max_tokens = args.rounds, args.max_tokens
    if args.quick:
        streams, rounds, max_tokens = [1, 4], 1, 16
    # Requests per stream, as bench_http.py: a closed loop needs more than one per stream.
    workloads = [(s, 3 if s == 1 else 2) for s in streams]

    binary = find_llama_server(args.llama_server, args.isa)
    LLAMA_LOG.parent.mkdir(parents=True, exist_ok=True)
    if args.model in SHAPES:
        gguf = gguf_file(args.model, args.model_type)
    else:
        gguf = Path(args.model) if args.model else default_model_path()
    print(f"machine: {machine()}")
    print(f"llama-server: {binary} ({llama_server_version(binary)})")
    llama_gguf = Path(args.llama_model) if args.llama_model else gguf
    print(f"model: {gguf.name}; furnace-trio runtime {args.quant}; max_tokens {max_tokens}")
    print(f"llama.cpp's model: {llama_gguf}")
    print(f"instruction sets: {args.isa}; at most {args.slots} sequences decoding at once")
    furnace_env = {"FURNACE_MAX_RUNNING": str(args.slots), "FURNACE_MODEL": str(gguf)}
    if args.isa == "avx2":
        furnace_env["FURNACE_NATIVE_FLAGS"] = "-mno-avx512f -mno-avxvnni"

    memory_gbs = bandwidth(3)[0]
    print(f"memory: {memory_gbs:.1f} GB/s (float32 sum over 1 GiB, best of 3)")
    port = free_port()
    started = time.perf_counter()
    furnace = Server(SERVERS[0], f"http://127.0.0.1:{port}", serve(args.quant, port, furnace_env))
    servers: tuple[Server, ...] = (furnace,)
    try:
        wait_ready(furnace.base_url, furnace.proc, timeout=1800)
        furnace.load_s = time.perf_counter() - started
        port = free_port()
        started = time.perf_counter()
        llama = Server(
            SERVERS[1],
            f"http://127.0.0.1:{port}",
            start_llama_server(binary, llama_gguf, port, args.slots, args.slot_ctx, LLAMA_LOG),
        )
        servers = (furnace, llama)
        wait_ready(llama.base_url, llama.proc, timeout=1800)
        llama.load_s = time.perf_counter() - started
        for server in servers:
            server.model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
            # Warm-up: the first requests of a process pay for lazy setup in both.
            asyncio.run(one_round(server, -1, [(1, 1), (4, 1)], 8))
            server.results.clear()
        for r in range(rounds):
            for server in servers if r % 2 == 0 else servers[::-1]:
                server.gbs.append(bandwidth(3)[0])
                start = time.perf_counter()
                asyncio.run(one_round(server, r, workloads, max_tokens))
                print(f"round {r + 1}/{rounds}: {server.name} {time.perf_counter() - start:.1f} s")
        for server in servers:
            answer = asyncio.run(greedy_answer(server, PROMPTS[0], 32))
            print(
                f"{server.name}: healthy {server.load_s:.1f} s after its start, RSS "
                f"{rss_mb(server.proc.pid):.0f} MB, peak {rss_mb(server.proc.pid, 'VmHWM'):.0f}"
                f" MB, greedy: {answer!r}"
            )
    except Exception:
        print(f"llama-server's log: {LLAMA_LOG}; exit status {servers[-1].proc.poll()}")
        raise
    finally:
        for server in servers:
            server.proc.terminate()
        for server in servers:
            server.proc.wait(timeout=30)
    report(furnace, llama, gguf, memory_gbs)
    retried = (f"{s.name} {sum(t.retries for t in s.transports)}" for s in servers)
    print(
        f"\nrequests sent again (a kept-alive connection closed unanswered): {', '.join(retried)}"
    )


if __name__ == "__main__":
    main()
