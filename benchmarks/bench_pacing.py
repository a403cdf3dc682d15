"""Prefill paced by step time (``FURNACE_TARGET_ITL_MS``) against the fixed token budget.

The mixed workload: 8 streams decode (a chat prompt each, ``ignore_eos``); while they do,
long prompts (1,000 to 4,000 tokens, ``max_tokens=1``) arrive one after another, each
when the previous one has its token. Measured: the inter-token latency (p50, p99) of the
8 streams over the window in which the long prompts are in flight, and each long prompt's
time to first token.

Two engines as the server builds them (server defaults, the default model, one model
thread, no HTTP) share one runner: the fixed budget (``FURNACE_MAX_STEP_TOKENS``'s
default, 512 on a CPU) and the same budget paced to ``--target-ms`` (50 by default,
about three times an 8-stream decode step of the default model on a 2-core CPU). Rounds alternate
between them (ABBA order), so both see the same machine; the paced engine keeps what it
learned from round to round, as a server would. The prefix cache is off in both (every
prompt is computed in full each round; the two engines also share the runner's KV memory,
which a prefix cache would assume is its own).

    python benchmarks/bench_pacing.py [--rounds 4] [--prompts 2] [--target-ms MS] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import dataclass, field

import trio
from _common import PROMPTS, chat_ids, long_prompt_ids, machine, pct

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine import Delta, Engine, GenerationRequest
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.loading.loader import LoadedModel, load_model
from furnace_trio.runtime.runner import ModelRunner
from furnace_trio.server.backend import build_engine, engine_config, runner_config, warm_up
from furnace_trio.server.config import ServerConfig

STREAMS = 8


@dataclass
class Figures:
    itl: list[float] = field(default_factory=list)  # the streams' gaps while prompts ran
    decode_only: list[float] = field(default_factory=list)  # their gaps before the prompts
    ttft: list[float] = field(default_factory=list)  # the long prompts'
    prompt_tokens: int = 0
    window_s: float = 0.0


async def one_round(
    engine: Engine, streams: list[list[int]], longs: list[list[int]], into: Figures
) -> None:
    """8 decoding streams; the long prompts one after another while they decode."""
    window: list[float] = []  # [start, end] of the long prompts' window
    gaps: list[tuple[float, float]] = []  # (time, gap) of every stream token after the first
    decoding = trio.Event()

    async def stream(ids: list[int], done: trio.Event) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
        last: float | None = None
        async with engine.submit(GenerationRequest(tuple(ids), params)) as events:
            async for event in events:
                if isinstance(event, Delta) and event.token_ids:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((now, (now - last) / len(event.token_ids)))
                        if len(gaps) >= 10 * len(streams):
                            decoding.set()
                    last = now
                if done.is_set():
                    return  # leaving the stream aborts the request

    done = trio.Event()
    async with trio.open_nursery() as nursery:
        for ids in streams:
            nursery.start_soon(stream, ids, done)
        await decoding.wait()  # some 10 decode-only steps first
        window.append(time.perf_counter())
        for ids in longs:
            params = SamplingParams(temperature=0.0, max_tokens=1)
            start = time.perf_counter()
            async with engine.submit(GenerationRequest(tuple(ids), params)) as events:
                async for event in events:
                    if isinstance(event, Delta) and event.token_ids:
                        into.ttft.append(time.perf_counter() - start)
            into.prompt_tokens += len(ids)
        window.append(time.perf_counter())
        done.set()
    into.itl += [gap for at, gap in gaps if window[0] <= at <= window[1]]
    into.decode_only += [gap for at, gap in gaps if at < window[0]]
    into.window_s += window[1] - window[0]


def row(label: str, f: Figures) -> str:
    return (
        f"| {label} | {pct(f.itl, 50) * 1e3:.0f} | {pct(f.itl, 99) * 1e3:.0f} | "
        f"{max(f.itl) * 1e3:.0f} | {pct(f.ttft, 50):.2f} | {max(f.ttft):.2f} | "
        f"{f.prompt_tokens / f.window_s:.0f} | {len(f.itl)} |"
    )


async def bench(
    thread: ModelThread, runner: ModelRunner, loaded: LoadedModel, args: argparse.Namespace
) -> None:
    def engine(**config: object) -> Engine:
        settings = ServerConfig(device="cpu", prefix_cache=False, **config)  # type: ignore[arg-type]
        return build_engine(runner, loaded.tokenizer, settings, "cpu", thread)

    engines = {"fixed": engine()}
    budget = engines["fixed"].config.max_step_tokens
    streams = [chat_ids(loaded, PROMPTS[i % len(PROMPTS)]) for i in range(STREAMS)]
    text = long_prompt_ids(loaded, 4000)
    rng = random.Random(7)
    sizes = [500, 600] if args.quick else [1000, 4000]
    figures = {"fixed": Figures(), "paced": Figures()}
    gc.collect()
    gc.freeze()  # as the server does (see bench_engine.py)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engines["fixed"].run)
            for _ in range(2):  # warm-up, not measured; the second's decode steps count
                warm = Figures()
                await one_round(engines["fixed"], streams, [text[:300]], warm)
            decode_ms = pct(warm.decode_only, 50) * 1e3
            print(f"8-stream decode ITL p50 {decode_ms:.1f} ms; target {args.target_ms:g} ms")
            engines["paced"] = engine(target_itl_ms=args.target_ms)
            await nursery.start(engines["paced"].run)
            await one_round(engines["paced"], streams, [text[:300]], Figures())
            order = ["fixed", "paced"]
            for r in range(args.rounds):
                # every round its own prompts (an offset into the text), the same both ways
                longs = []
                for _ in range(args.prompts):
                    n = rng.randint(*sizes)
                    offset = rng.randint(0, 50)
                    longs.append((text[offset:] + text)[:n])
                for name in order if r % 2 == 0 else order[::-1]:
                    await one_round(engines[name], streams, longs, figures[name])
                    print(f"round {r} {name}: {len(figures[name].itl)} gaps", flush=True)
            status = engines["paced"].status().pacing
            for engine in engines.values():
                engine.shutdown()
            nursery.cancel_scope.cancel()
    finally:
        gc.unfreeze()
    print(
        f"\n{STREAMS} streams decoding, {args.rounds} rounds x {args.prompts} prompts of "
        f"{sizes[0]}-{sizes[1]} tokens, step budget {budget}, target {args.target_ms:g} ms\n"
    )
    print(
        "| prefill | ITL p50 ms | ITL p99 ms | ITL max ms | TTFT p50 s | TTFT max s "
        "| prompt tok/s | gaps |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(row(f"fixed {budget} tokens", figures["fixed"]))
    print(row(f"paced to {args.target_ms:g} ms", figures["paced"]))
    fixed, paced = figures["fixed"], figures["paced"]
    print(
        f"\npaced / fixed: ITL p50 {pct(paced.itl, 50) / pct(fixed.itl, 50):.2f}, "
        f"ITL p99 {pct(paced.itl, 99) / pct(fixed.itl, 99):.2f}, "
        f"TTFT p50 {pct(paced.ttft, 50) / pct(fixed.ttft, 50):.2f}, "
        f"TTFT max {max(paced.ttft) / max(fixed.ttft):.2f}"
    )
    if status is not None:
        print(
            f"learned: {(status.prefill_token_s or 0) * 1e3:.3f} ms per prefill token, "
            f"decode step {(status.decode_base_s or 0) * 1e3:.1f} ms + "
            f"{(status.decode_row_s or 0) * 1e3:.2f} ms per row, "
            f"last chunk {status.chunk_tokens} tokens"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2, help="long prompts per round")
    parser.add_argument(
        "--target-ms",
        type=float,
        default=50.0,
        help="the paced engine's target ITL (default 50: about 3 x an 8-stream decode step "
        "of the default model on a 2-core CPU)",
    )
    parser.add_argument("--quick", action="store_true", help="short prompts, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.prompts = 1, 2
    print(f"machine: {machine()}")
    thread = ModelThread()
    config = ServerConfig(device="cpu")
    loaded = thread.call(load_model, None)
    runner = thread.call(ModelRunner.from_loaded, loaded, runner_config(config, "cpu", "cpu"))
    thread.call(warm_up, runner, engine_config(config, "cpu").max_running)  # as the server does
    trio.run(bench, thread, runner, loaded, args)
    thread.close()


if __name__ == "__main__":
    main()
