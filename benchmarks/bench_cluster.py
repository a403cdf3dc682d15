"""Throughput of two replicas behind nginx against one replica, on this machine.

Starts Redis, two replicas of the default model and nginx exactly as ``nox -s cluster``
does (``deploy/cluster.py`` and ``deploy/nginx.conf.template``), then alternates rounds:
``one``, ``--streams`` concurrent streaming clients sending to the first replica directly
(the second idles), and ``two``, the same clients sending through nginx, which spreads them
over both replicas (least-connections). Each client sends ``--requests`` greedy requests of
``--max-tokens`` tokens (``ignore_eos``); a round's figure is completion tokens per second
over its wall time. Both sides run in the same minutes, so the machine's drift and other
load fall on both; the table gives each side's median and the ratio of medians.

Every replica uses torch's default thread count (the machine's cores): on a machine with
fewer cores than replicas x threads, two replicas share the same cores and memory
bandwidth, and expect no gain. On several GPUs (``--gpus``, one replica each) they do not.

    python benchmarks/bench_cluster.py [--rounds 3] [--streams 8] [--requests 2]
                                       [--max-tokens 48] [--gpus 0,1]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.cluster import (  # noqa: E402
    gpu_list,
    make_replicas,
    render_nginx,
    start_nginx,
    start_redis,
    wait_http,
)

PROMPTS = (
    "Tell me about rivers.",
    "Describe a quiet morning.",
    "Explain how bread is made.",
    "Write about the sea.",
)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def one_round(base: str, streams: int, requests: int, max_tokens: int) -> float:
    """Completion tokens per second of ``streams`` clients against ``base``."""
    tokens = [0] * streams

    def client(number: int) -> None:
        with httpx.Client(base_url=base, timeout=600) as http:
            for i in range(requests):
                body = {
                    "model": "SmolLM2-135M-Instruct",
                    "messages": [{"role": "user", "content": PROMPTS[(number + i) % 4]}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                response = http.post("/v1/chat/completions", json=body)
                response.raise_for_status()
                tokens[number] += response.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(n,)) for n in range(streams)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(tokens) / (time.monotonic() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="per client and round")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--gpus", help="one replica per device, e.g. 0,1")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    listen, redis_port, base_port = free_ports(3)
    redis = start_redis(redis_port, directory)
    env = {
        "FURNACE_SESSION_STORE": f"redis://127.0.0.1:{redis_port}/0",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    gpus = gpu_list(args.gpus) if args.gpus else None
    replicas = make_replicas(2, base_port, directory, env, gpus)
    nginx = None
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready(600)
        config = render_nginx(
            prefix=directory,
            listen=f"127.0.0.1:{listen}",
            replicas=[r.address for r in replicas],
        )
        nginx = start_nginx(config, directory)
        wait_http(f"http://127.0.0.1:{listen}/health", 30, nginx)
        sides = {"one": replicas[0].url, "two": f"http://127.0.0.1:{listen}"}
        for base in sides.values():  # warm-up: the native kernels, the first steps
            one_round(base, 2, 1, 8)
        results: dict[str, list[float]] = {name: [] for name in sides}
        for number in range(args.rounds):
            order = list(sides) if number % 2 == 0 else list(reversed(sides))
            for name in order:
                rate = one_round(sides[name], args.streams, args.requests, args.max_tokens)
                results[name].append(rate)
                print(f"round {number + 1} {name}: {rate:.1f} tok/s", flush=True)
        one = statistics.median(results["one"])
        two = statistics.median(results["two"])
        print(f"cores: {os.cpu_count()}; {args.streams} streams, {args.max_tokens} tokens each")
        print("| side | tok/s (median) | rounds |")
        print("| --- | --- | --- |")
        for name, rates in results.items():
            print(f"| {name} | {statistics.median(rates):.1f} | {len(rates)} |")
        print(f"two replicas / one: {two / one:.2f}")
    finally:
        for replica in replicas:
            replica.stop(signal.SIGTERM, 120)
        for process, sig in ((nginx, signal.SIGQUIT), (redis, signal.SIGTERM)):
            if process is not None:
                process.send_signal(sig)
                process.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
