"""What happens between two model steps, and when: engine level vs over HTTP, one process.

``bench_overhead.py`` measures what the HTTP and Trio layers cost; this script shows where
that cost lands. It serves the app with hypercorn in this process over the engine it also
drives directly (as ``bench_overhead.py``'s same-process side does; the raw client runs in
a process of its own), and puts a clock (``time.perf_counter``, appended to a list) around
the stages of a token, by wrapping, in this process only:

- ``ModelRunner.step``: ``step start`` and ``step end``, on the model thread;
- ``TrioToken.run_sync_soon`` called from the model thread: ``hand-off called`` and
  ``hand-off returned`` (the model thread handing a step's result to Trio; it returns once
  the model thread holds the GIL again);
- ``ModelThread.run``: ``next step submitted`` (the engine task hands the next plan over)
  and ``engine task resumed`` (it has the last step's result);
- ``RequestStream.__anext__``: ``consumer has its event`` (a request's handler, or the
  engine side's consumer, woke with its token);
- hypercorn's ``HTTPStream.app_send``: ``ASGI send`` (a chunk enters hypercorn);
- Trio's ``SocketStream.send_all``: ``socket send`` and ``socket send returned``;

Every event is placed after the step end that precedes it; the table gives, per stage, the
median over steps of its first occurrence in microseconds after the step end (and of its
last occurrence, where a step has one per stream), and below it the median step and gap
(the gap: from one step's end to the next step's start), and the median gap before a step
that has a prompt chunk: at one stream, the model's wait between a request's last token
and the next request's prefill (the client's next request, the HTTP stack, parsing,
rendering, tokenizing). The wrappers cost a few microseconds per stage; both sides carry
them.

    python benchmarks/bench_timeline.py [--streams 1,16] [--requests 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from _common import PROMPTS, chat_ids, machine
from _raw_client import ClientProcess
from bench_engine import closed_loop, load_on_thread, make_engine
from bench_http import app_over, free_port, quiet_config, wait_ready
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio import serve as serve_asgi
from trio.lowlevel import TrioToken

from furnace_trio.core.plan import StepPlan
from furnace_trio.engine import RequestStream
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.runtime.runner import ModelRunner

STAGES = (
    "hand-off called",
    "hand-off returned",
    "engine task resumed",
    "next step submitted",
    "consumer has its event",
    "ASGI send",
    "socket send",
    "socket send returned",
    "step start",
)
clock = time.perf_counter
events: list[tuple[str, float]] = []


def mark(stage: str) -> None:
    events.append((stage, clock()))


def instrument(runner: ModelRunner, model_thread_id: int) -> None:
    """Wrap the stages' functions (this process only; the benchmark's own objects)."""
    step = runner.step

    def timed_step(plan: StepPlan) -> Any:
        if any(len(chunk.token_ids) > 1 for chunk in plan.chunks):
            mark("prompt step")  # the step about to start has a prompt chunk
        mark("step start")
        try:
            return step(plan)
        finally:
            mark("step end")

    runner.step = timed_step  # type: ignore[method-assign]

    run_sync_soon = TrioToken.run_sync_soon

    def timed_run_sync_soon(self: TrioToken, *args: Any, **kwargs: Any) -> None:
        if threading.get_ident() != model_thread_id:
            return run_sync_soon(self, *args, **kwargs)
        mark("hand-off called")
        run_sync_soon(self, *args, **kwargs)
        mark("hand-off returned")

    TrioToken.run_sync_soon = timed_run_sync_soon  # type: ignore[method-assign,assignment]

    def around(cls: type, name: str, before: str | None, after: str | None) -> None:
        inner: Callable[..., Awaitable[Any]] = getattr(cls, name)

        async def timed(self: Any, *args: Any) -> Any:
            if before:
                mark(before)
            result = await inner(self, *args)
            if after:
                mark(after)
            return result

        setattr(cls, name, timed)

    around(ModelThread, "run", "next step submitted", "engine task resumed")
    around(RequestStream, "__anext__", None, "consumer has its event")
    around(HTTPStream, "app_send", "ASGI send", None)
    around(trio.SocketStream, "send_all", "socket send", "socket send returned")


def timeline(recorded: list[tuple[str, float]]) -> dict[str, Any]:
    """Per stage, the medians of its first and last offsets after each step end; with the
    step and gap medians (only gaps under 50 ms: longer ones are idle between requests),
    and the median gap before a step with a prompt chunk (at one stream: how long the
    model waits between one request's last token and the next request's prefill)."""
    first: dict[str, list[float]] = {s: [] for s in STAGES}
    last: dict[str, list[float]] = {s: [] for s in STAGES}
    steps: list[float] = []
    gaps: list[float] = []
    prompt_gaps: list[float] = []
    prompt_next = False
    end: float | None = None
    start: float | None = None
    seen: dict[str, float] = {}

    def close() -> None:
        for stage, offset in seen.items():
            last[stage].append(offset)

    for stage, at in recorded:
        if stage == "step end":
            if start is not None:
                steps.append(at - start)
            close()
            end, seen = at, {}
            continue
        if stage == "prompt step":
            prompt_next = True
            continue
        if stage == "step start":
            start = at
            if end is not None and at - end < 0.05:
                gaps.append(at - end)
            if end is not None and prompt_next:
                prompt_gaps.append(at - end)
            prompt_next = False
        if end is None:
            continue
        offset = (at - end) * 1e6
        if stage not in seen:
            first[stage].append(offset)
        seen[stage] = offset
    close()

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return {
        "first": {s: median(v) for s, v in first.items()},
        "last": {s: median(v) for s, v in last.items()},
        "step": median(steps),
        "gap": median(gaps),
        "prompt gap": median(prompt_gaps),
    }


def cell(value: float | None, scale: float = 1.0) -> str:
    return "" if value is None else f"{value * scale:.0f}"


def report(streams: int, sides: dict[str, dict[str, Any]]) -> None:
    print(
        f"\n{streams} stream(s): microseconds after a step ends, median over steps "
        "(first occurrence / last occurrence)\n"
    )
    print("| stage | " + " | ".join(sides) + " |")
    print("| --- |" + " --- |" * len(sides))
    for stage in STAGES:
        cells = []
        for side in sides.values():
            a, b = side["first"][stage], side["last"][stage]
            both = cell(a) if a is None or b is None or abs(b - a) < 1 else f"{a:.0f} / {b:.0f}"
            cells.append(both)
        print(f"| {stage} | " + " | ".join(cells) + " |")
    for key, label in (
        ("step", "**step** (start to end)"),
        ("gap", "**gap** (end to next start)"),
        ("prompt gap", "**gap before a step with a prompt chunk**"),
    ):
        print(f"| {label} | " + " | ".join(cell(s[key], 1e6) for s in sides.values()) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quant", default="q4")
    parser.add_argument("--streams", default="1,16", help="comma-separated")
    parser.add_argument("--requests", type=int, default=4, help="per stream and side")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    thread, loaded, runner = load_on_thread(args.quant)
    model_thread_id = thread.call(threading.get_ident)
    prompts = [chat_ids(loaded, p) for p in PROMPTS]
    client = ClientProcess()
    model = "bench-timeline"
    results: dict[int, dict[str, dict[str, Any]]] = {}

    async def run() -> None:
        engine = make_engine(runner, thread, loaded)
        port = free_port()
        config = quiet_config(port)
        app = app_over(engine, loaded, model, runner.max_context)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_asgi, app, config)
            await trio.to_thread.run_sync(wait_ready, f"http://127.0.0.1:{port}")
            await trio.to_thread.run_sync(client.requests, port, model, PROMPTS, 1, 1, 4)
            await closed_loop(engine, prompts, 1, 1, 4)  # warm-up
            instrument(runner, model_thread_id)
            for streams in (int(s) for s in args.streams.split(",")):
                sides: dict[str, dict[str, Any]] = {}
                for side in ("engine", "HTTP"):
                    events.clear()
                    if side == "engine":
                        await closed_loop(engine, prompts, streams, args.requests, args.max_tokens)
                    else:
                        await trio.to_thread.run_sync(
                            client.requests,
                            port,
                            model,
                            PROMPTS,
                            streams,
                            args.requests,
                            args.max_tokens,
                        )
                    sides[side] = timeline(list(events))
                results[streams] = sides
            nursery.cancel_scope.cancel()

    try:
        trio.run(run)
    finally:
        client.close()
    for streams, sides in results.items():
        report(streams, sides)


if __name__ == "__main__":
    main()
