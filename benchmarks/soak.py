"""Soak: many concurrent clients with early disconnects, then check nothing leaked.

Serves the app in this process on a free 127.0.0.1 port (hypercorn, Trio) and runs
``--clients`` closed-loop clients for ``--duration`` seconds (or ``--max-requests``),
mixing streaming and non-streaming chat and completions, stop strings, ``n > 1``, session
turns (``X-Session-Id``) and random early disconnects (right after sending, i.e. while
queued; before the first token, i.e. during prefill; after a few chunks, mid-stream).

Afterwards it checks and reports:

- no request lost: each got a complete response, an error object (or SSE error event), or
  was one this script disconnected; anything else (a truncated body, a hang past
  ``--request-timeout``, a transport error) counts as lost;
- no sequence or KV block leaked: the engine goes idle (running, waiting, in flight, open
  turns all 0) and every KV block reference it holds is a session pin; after deleting
  every session, no reference at all;
- resident memory (``VmRSS`` from ``/proc/self/status``, sampled every second):
  start, peak, end;
- hostile clients (``benchmarks/_hostile.py``, off with ``--no-hostile``): one client
  sends schemas and fan-outs that once stalled or flooded the server, beside the normal
  ones; each must get its expected status, and the event loop must never wake more than
  ``STALL_LIMIT_UNDER_LOAD_S`` late meanwhile (``/health`` round trips are reported: under
  load they include waiting behind the normal clients' work).

    python benchmarks/soak.py [--duration 180] [--clients 32]   # the default model
    nox -s soak -- --duration 60

``run_soak`` is also used by ``tests/test_soak.py`` with a scripted runner.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import hypercorn.trio
import trio
from hypercorn.config import Config

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "benchmarks"):  # tests.loop_watch; _hostile beside this file
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _hostile import (  # noqa: E402
    STALL_LIMIT_UNDER_LOAD_S,
    HostileReport,
    hostile_cases,
    run_hostile,
)
from tests.loop_watch import watch_loop  # noqa: E402

PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Count from one to ten.",
    "Explain what a cache is in one sentence.",
    "Give me a short list of fruits.",
)
STOPS = (".", "\n", " and", "e")


class Outcome(enum.Enum):
    COMPLETE = "complete"  # a full response (every choice finished; a stream with [DONE])
    ERROR = "error"  # an error object or SSE error event
    DISCONNECTED = "disconnected"  # this script left early on purpose
    LOST = "lost"  # anything else: truncated, hung, transport error


class Disconnect(enum.Enum):
    NONE = "none"
    QUEUED = "queued"  # right after sending
    PREFILL = "prefill"  # before the first token
    MID_STREAM = "mid-stream"  # after a few chunks (streams only)


@dataclass(slots=True)
class SoakReport:
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    disconnects: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    seconds: float = 0.0
    leaks: list[str] = field(default_factory=list)
    final_stats: dict[str, Any] = field(default_factory=dict)
    hostile: HostileReport | None = None

    def summary(self) -> str:
        rss = self.rss_kib or [0]
        return "\n".join(
            [
                f"requests: {self.requests} in {self.seconds:.0f} s",
                f"outcomes: {dict(self.outcomes)}",
                f"statuses: {dict(sorted(self.statuses.items()))}",
                f"disconnects: {dict(self.disconnects)}",
                f"kinds: {dict(self.kinds)}",
                f"RSS MiB: start {rss[0] / 1024:.0f}, peak {max(rss) / 1024:.0f}, "
                f"end {rss[-1] / 1024:.0f}",
                f"final engine: {self.final_stats}",
                f"leaks: {self.leaks or 'none'}",
                f"lost: {self.lost[:10] or 'none'}",
                self.hostile.summary() if self.hostile is not None else "hostile: off",
            ]
        )

    @property
    def passed(self) -> bool:
        hostile = self.hostile
        return not self.leaks and not self.lost and (hostile is None or not hostile.unexpected)


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@dataclass(slots=True)
class _Plan:
    path: str
    body: dict[str, Any]
    stream: bool
    n: int  # choices in the response: n times the prompts of a batch
    disconnect: Disconnect
    session: str | None
    label: str


def _plan(rng: random.Random, client: int, turn: int, max_tokens: int) -> _Plan:
    stream = rng.random() < 0.5
    chat = rng.random() < 0.7
    session = f"soak-{client}" if chat and rng.random() < 0.15 else None
    n = 2 if session is None and rng.random() < 0.1 else 1
    body: dict[str, Any] = {
        "max_tokens": rng.randint(max(1, max_tokens // 8), max_tokens),
        "stream": stream,
        "n": n,
        "temperature": rng.choice((0.0, 0.8)),
        "seed": rng.randint(0, 2**31),
    }
    if rng.random() < 0.2:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    prompt = (
        f"{rng.choice(PROMPTS)} ({client}.{turn})" if rng.random() < 0.5 else rng.choice(PROMPTS)
    )
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
        if rng.random() < 0.25:  # a batch of prompts: one engine request each
            body["prompt"] = [prompt, *rng.sample(PROMPTS, rng.randint(1, 2))]
        if rng.random() < 0.2:  # echo, half of them with the prompt scored
            body["echo"] = True
            if rng.random() < 0.5:
                body["logprobs"] = 1
    batch = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    roll = rng.random()
    disconnect = Disconnect.NONE
    if roll < 0.06:
        disconnect = Disconnect.QUEUED
    elif roll < 0.12:
        disconnect = Disconnect.PREFILL
    elif roll < 0.2 and stream:
        disconnect = Disconnect.MID_STREAM
    label = f"{'chat' if chat else 'completion'}{'-stream' if stream else ''}"
    label += f"{'-n2' if n > 1 else ''}{'-session' if session else ''}"
    label += f"{'-batch' if batch > 1 else ''}{'-stop' if 'stop' in body else ''}"
    label += "-echo" if "echo" in body else ""
    label += "-scored" if "logprobs" in body else ""
    return _Plan(path, body, stream, n * batch, disconnect, session, label)


def _complete_body(body: dict[str, Any], n: int) -> bool:
    choices = body.get("choices") or []
    return len(choices) == n and all(c.get("finish_reason") for c in choices)


async def _one(
    http: httpx.AsyncClient, plan: _Plan, rng: random.Random, report: SoakReport, limit_s: float
) -> None:
    headers = {"X-Session-Id": plan.session} if plan.session else {}
    outcome = Outcome.LOST
    why = ""
    report.kinds[plan.label] += 1
    leave_after = {
        Disconnect.QUEUED: rng.uniform(0.0, 0.005),
        Disconnect.PREFILL: rng.uniform(0.005, 0.15),
    }.get(plan.disconnect, math.inf)
    with trio.move_on_after(limit_s) as hang:
        with trio.move_on_after(leave_after) as left:
            try:
                if plan.stream:
                    outcome, why = await _stream(http, plan, rng, headers, report)
                else:
                    response = await http.post(plan.path, json=plan.body, headers=headers)
                    report.statuses[response.status_code] += 1
                    body = response.json()
                    if response.status_code == 200 and _complete_body(body, plan.n):
                        outcome = Outcome.COMPLETE
                    elif response.status_code >= 400 and "error" in body:
                        outcome = Outcome.ERROR
                    else:
                        why = f"status {response.status_code}: {str(body)[:200]}"
            except (httpx.HTTPError, ValueError) as exc:
                why = repr(exc)
        if left.cancelled_caught:
            outcome = Outcome.DISCONNECTED
            report.disconnects[plan.disconnect.value] += 1
    if hang.cancelled_caught:
        outcome, why = Outcome.LOST, f"no answer within {limit_s} s"
    report.outcomes[outcome.value] += 1
    if outcome is Outcome.LOST:
        report.lost.append(f"{plan.label}: {why}")


async def _stream(
    http: httpx.AsyncClient,
    plan: _Plan,
    rng: random.Random,
    headers: dict[str, str],
    report: SoakReport,
) -> tuple[Outcome, str]:
    leave_at = rng.randint(1, 6) if plan.disconnect is Disconnect.MID_STREAM else None
    async with http.stream("POST", plan.path, json=plan.body, headers=headers) as response:
        report.statuses[response.status_code] += 1
        if response.status_code != 200:
            body = json.loads(await response.aread())
            return (Outcome.ERROR, "") if "error" in body else (Outcome.LOST, str(body))
        chunks = 0
        finished: set[int] = set()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                if len(finished) == plan.n:
                    return Outcome.COMPLETE, ""
                return Outcome.LOST, f"[DONE] after {len(finished)}/{plan.n} choices finished"
            event = json.loads(data)
            if "error" in event:
                return Outcome.ERROR, ""
            for choice in event.get("choices", []):
                if choice.get("finish_reason"):
                    finished.add(choice["index"])
            chunks += 1
            if leave_at is not None and chunks >= leave_at:
                report.disconnects[Disconnect.MID_STREAM.value] += 1
                return Outcome.DISCONNECTED, ""
        return Outcome.LOST, f"stream ended without [DONE] after {chunks} chunks"


async def run_clients(
    url: str,
    *,
    clients: int,
    duration_s: float,
    max_requests: int,
    max_tokens: int,
    seed: int,
    request_timeout: float,
    report: SoakReport,
) -> None:
    """Closed-loop clients until the duration or the request budget is spent."""
    deadline = trio.current_time() + duration_s
    budget = [max_requests]

    async def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        limits = httpx.Limits(max_connections=2)
        # verify=False: plain HTTP on loopback needs no certificates, and loading them
        # (what httpx does for each client) holds the GIL for ~90 ms, which the loop watch
        # would count as a server stall: the clients run in the server's process.
        async with httpx.AsyncClient(
            base_url=url, timeout=request_timeout, limits=limits, verify=False
        ) as http:
            turn = 0
            while trio.current_time() < deadline and budget[0] > 0:
                budget[0] -= 1
                report.requests += 1
                await _one(http, _plan(rng, index, turn, max_tokens), rng, report, request_timeout)
                turn += 1

    async with trio.open_nursery() as nursery:
        for index in range(clients):
            nursery.start_soon(client, index)


async def run_soak(
    app: Any,
    engine_of: Any,
    *,
    clients: int = 32,
    duration_s: float = 180.0,
    max_requests: int = 1_000_000,
    max_tokens: int = 48,
    seed: int = 0,
    request_timeout: float = 120.0,
    idle_timeout: float = 60.0,
    hostile: bool = True,
) -> SoakReport:
    """Serve ``app`` on loopback, run the clients (and, with ``hostile``, the hostile one
    beside them), then check the engine (``engine_of()`` returns it once serving started).
    Everything is bounded in count and time."""
    report = SoakReport()
    cases = hostile_cases() if hostile else []
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 5
    config.accesslog = None
    config.errorlog = None
    config.startup_timeout = 900
    shutdown = trio.Event()
    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(hypercorn.trio.serve, app, config, shutdown_trigger=shutdown.wait)
        )
        url = binds[0]

        async def sample_rss() -> None:
            while True:
                report.rss_kib.append(rss_kib())
                await trio.sleep(1.0)

        nursery.start_soon(sample_rss)
        clients_run = partial(
            run_clients,
            url,
            clients=clients,
            duration_s=duration_s,
            max_requests=max_requests,
            max_tokens=max_tokens,
            seed=seed,
            request_timeout=request_timeout,
            report=report,
        )
        if cases:
            report.hostile = await _with_hostile(url, cases, clients_run, request_timeout)
        else:
            await clients_run()
        report.seconds = time.monotonic() - started
        engine = engine_of()
        with trio.move_on_after(idle_timeout):
            while not engine.statistics().idle:  # noqa: ASYNC110 (the engine has no event)
                await trio.sleep(0.05)
        stats = engine.statistics()
        if not stats.idle:
            report.leaks.append(
                f"not idle after {idle_timeout} s: running={stats.running} "
                f"waiting={stats.waiting} in_flight={stats.requests_in_flight} "
                f"turns={stats.turns_open}"
            )
        report.leaks.extend(stats.leaks())
        report.final_stats = {
            "running": stats.running,
            "waiting": stats.waiting,
            "kv_blocks_used": stats.kv_blocks_used,
            "kv_block_refs": stats.kv_block_refs,
            "kv_blocks_cached": stats.kv_blocks_cached,
            "kv_blocks_total": stats.kv_blocks_total,
            "sessions": stats.sessions,
            "session_pinned_blocks": stats.session_pinned_blocks,
            "requests": dict(stats.requests),
        }
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for index in range(clients):
                await http.delete(f"/v1/sessions/soak-{index}")
            health = await http.get("/health")
            if health.status_code != 200:
                report.leaks.append(f"/health answered {health.status_code} after the soak")
        after = engine.statistics()
        if after.kv_block_refs or after.kv_blocks_used:
            report.leaks.append(
                f"after deleting every session: {after.kv_block_refs} references, "
                f"{after.kv_blocks_used} blocks in use"
            )
        report.final_stats["kv_block_refs_after_session_delete"] = after.kv_block_refs
        report.rss_kib.append(rss_kib())
        shutdown.set()  # a graceful stop: hypercorn closes, then after_serving drains
        nursery.cancel_scope.deadline = trio.current_time() + 30
    return report


async def _with_hostile(
    url: str, cases: list[Any], clients_run: Any, request_timeout: float
) -> HostileReport:
    """Run the normal clients with the hostile one beside them, the loop watched."""
    hostile = HostileReport()
    done = trio.Event()
    async with watch_loop(url) as watch, trio.open_nursery() as nursery:
        nursery.start_soon(run_hostile, url, cases, done, hostile, request_timeout)
        await clients_run()
        done.set()
    hostile.longest_stall_s = watch.longest_lag_s
    hostile.watch = str(watch)
    if watch.longest_lag_s > STALL_LIMIT_UNDER_LOAD_S:
        hostile.unexpected.append(
            f"the event loop stalled {watch.longest_lag_s:.3f} s "
            f"(limit {STALL_LIMIT_UNDER_LOAD_S} s under load)"
        )
    return hostile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--no-hostile", action="store_true", help="leave out the hostile client")
    args = parser.parse_args()
    if not 0 < args.duration <= 3600 or not 0 < args.clients <= 256:
        raise ValueError("--duration must be in (0, 3600] s and --clients in (0, 256]")

    sys.path.insert(0, str(ROOT / "src"))
    from furnace_trio.server.app import STATE_KEY, create_app
    from furnace_trio.server.config import ServerConfig

    app = create_app(ServerConfig.from_env())
    # a line per client request (the loop watch alone sends 100 a second) is noise here
    logging.getLogger("httpx").setLevel(logging.WARNING)

    def engine_of() -> Any:
        return app.extensions[STATE_KEY].backend.engine

    print(f"soak: {args.clients} clients for {args.duration:.0f} s on 127.0.0.1", flush=True)
    report = trio.run(
        partial(
            run_soak,
            app,
            engine_of,
            clients=args.clients,
            duration_s=args.duration,
            max_requests=args.max_requests,
            max_tokens=args.max_tokens,
            seed=args.seed,
            request_timeout=args.request_timeout,
            hostile=not args.no_hostile,
        )
    )
    print(report.summary())
    ok = report.passed
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
