"""Engine-level speed (Engine + ModelRunner, no HTTP), float32, int8 and q4, against transformers.

Workloads, each in a closed loop (every stream sends its next request as soon as the last
one finishes) with fixed ``max_tokens`` and ``ignore_eos``: 1, 4, 16 and 32 concurrent
streams over the 20 chat prompts; time to first token p50/p95, inter-token latency p50/p95
and aggregate completion tok/s. Prefill: a 1,000-token prompt with ``max_tokens=1``.
transformers ``generate`` (float32, greedy, same weights) runs one sequence and a static
batch of 16 with the same prompt lengths and token counts, and a 1,000-token forward; its
figures are printed next to ours as ratios (ours / transformers).

    python benchmarks/bench_engine.py [--quick]

Requests per stream: 3, 2, 3 and 2 at 1, 4, 16 and 32 streams (with one request per
stream a "closed loop" would never send a request after another finished).
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, field

import torch
import trio
from _common import (
    PROMPTS,
    chat_ids,
    long_prompt_ids,
    machine,
    pct,
    runtime_config,
    transformers_model,
)

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine import Delta, Engine, GenerationRequest
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.loading.loader import LoadedModel, load_model
from furnace_trio.runtime.runner import ModelRunner
from furnace_trio.server.backend import build_engine
from furnace_trio.server.config import ServerConfig


@dataclass
class Result:
    streams: int
    tokens: int
    seconds: float
    ttft: list[float]
    itl: list[float]
    #: Each request's submit time (``time.perf_counter``), in the order of ``ttft``.
    starts: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def row(self, label: str) -> str:
        return (
            f"| {label} | {self.streams} | {self.tok_s:.1f} | {pct(self.ttft, 50) * 1e3:.0f} | "
            f"{pct(self.ttft, 95) * 1e3:.0f} | {pct(self.itl, 50) * 1e3:.1f} | "
            f"{pct(self.itl, 95) * 1e3:.1f} |"
        )


async def closed_loop(
    engine: Engine, prompts: list[list[int]], streams: int, rounds: int, max_tokens: int
) -> Result:
    ttft: list[float] = []
    itl: list[float] = []
    starts: list[float] = []
    total = 0

    async def worker(w: int) -> None:
        nonlocal total
        for r in range(rounds):
            ids = prompts[(w * rounds + r) % len(prompts)]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            last: float | None = None
            stream = engine.submit(GenerationRequest(tuple(ids), params))
            async with stream:
                async for event in stream:
                    if isinstance(event, Delta) and event.token_ids:
                        now = time.perf_counter()
                        if last is None:
                            ttft.append(now - start)
                            starts.append(start)
                        else:
                            itl.append((now - last) / len(event.token_ids))
                        last = now
                        total += len(event.token_ids)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for w in range(streams):
            nursery.start_soon(worker, w)
    return Result(streams, total, time.perf_counter() - start, ttft, itl, starts)


def load_on_thread(quant: str) -> tuple[ModelThread, LoadedModel, ModelRunner]:
    """The default model loaded on a model thread of its own, and its runner for the
    benchmark runtime ``quant``, built on that thread (as the server does)."""
    thread = ModelThread()
    loaded = thread.call(load_model, None)
    return thread, loaded, thread.call(ModelRunner.from_loaded, loaded, runtime_config(quant))


def make_engine(
    runner: ModelRunner, thread: ModelThread, loaded: LoadedModel, device: str = "cpu"
) -> Engine:
    """An engine as the server builds one on ``device``: the server's default settings
    (not :class:`EngineConfig`'s own), every step on ``thread``."""
    return build_engine(runner, loaded.tokenizer, ServerConfig(), device, thread)


async def run_engine(
    runner: ModelRunner,
    thread: ModelThread,
    loaded: LoadedModel,
    workloads: list[tuple[int, int]],
    max_tokens: int,
    device: str = "cpu",
) -> tuple[list[Result], float]:
    """Closed loops of ``workloads`` ((streams, requests per stream) each) and the
    1,000-token prompt's prefill (tok/s), on an engine as the server builds one on
    ``device``."""
    prompts = [chat_ids(loaded, p) for p in PROMPTS]
    engine = make_engine(runner, thread, loaded, device)
    results = []
    # As the server does once it has loaded the model: what exists now (the tokenizer's
    # vocabulary, the GGUF metadata: some 200,000 objects) leaves the cyclic collector,
    # whose every full pass over them would otherwise stall a step by about 100 ms.
    gc.collect()
    gc.freeze()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            await closed_loop(engine, prompts, 4, 1, 4)  # warm-up (a batch, too)
            for streams, rounds in workloads:
                results.append(await closed_loop(engine, prompts, streams, rounds, max_tokens))
            long = long_prompt_ids(loaded)
            prefill = await closed_loop(engine, [long], 1, 1, 1)
            engine.shutdown()
            nursery.cancel_scope.cancel()
    finally:
        gc.unfreeze()
    return results, len(long) / prefill.ttft[0]


def padded_batch(
    loaded: LoadedModel, batch: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``batch`` of the chat prompts (cycled), left-padded for transformers ``generate``:
    ids, attention mask, and the padded width; the pad id is the smallest EOS id."""
    prompts = [chat_ids(loaded, p) for p in PROMPTS]
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    width = max(len(r) for r in rows)
    pad = pad_id(loaded)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask, width


def pad_id(loaded: LoadedModel) -> int:
    return min(loaded.tokenizer.eos_token_ids or (0,))


def transformers_figures(loaded: LoadedModel, max_tokens: int) -> dict[str, float]:
    model = transformers_model(loaded)
    pad = pad_id(loaded)
    figures: dict[str, float] = {}
    with torch.inference_mode():
        for batch in (1, 16):
            ids, mask, width = padded_batch(loaded, batch)
            model.generate(ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=2)
            start = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
            seconds = time.perf_counter() - start
            figures[f"tok_s_{batch}"] = (out.shape[1] - width) * batch / seconds
        long = torch.tensor([long_prompt_ids(loaded)])
        start = time.perf_counter()
        model(long)
        figures["prefill"] = long.shape[1] / (time.perf_counter() - start)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    parser.add_argument(
        "--quant",
        default="q4,int8,none,int8-torch",
        help="comma-separated runtimes: q4, int8, none, and none-torch / int8-torch without "
        "the native kernels",
    )
    args = parser.parse_args()
    max_tokens = 16 if args.quick else 64
    workloads = [(1, 3), (4, 2), (16, 3), (32, 2)] if not args.quick else [(1, 1), (4, 1)]
    print(f"machine: {machine()}")
    # As the server does: all model work of a runtime on its one model thread (OpenMP
    # teams are per thread; see furnace_trio/model_thread.py). The loader's thread exits.
    loader = ModelThread()
    loaded = loader.call(load_model, None)
    loader.close()
    ours: dict[str, tuple[list[Result], float]] = {}
    for quant in args.quant.split(","):
        thread = ModelThread()
        runner = thread.call(ModelRunner.from_loaded, loaded, runtime_config(quant))
        ours[quant] = trio.run(run_engine, runner, thread, loaded, workloads, max_tokens)
        del runner
    ref = transformers_figures(loaded, max_tokens)

    print(f"\nengine level, max_tokens={max_tokens}, greedy, closed loop\n")
    print("| runtime | streams | tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for quant, (results, _) in ours.items():
        for r in results:
            print(r.row(quant))
    print("\n| runtime | prefill tok/s (1,000-token prompt) |")
    print("| --- | --- |")
    for quant, (_, prefill) in ours.items():
        print(f"| {quant} | {prefill:.0f} |")
    print(f"| transformers float32 | {ref['prefill']:.0f} |")
    print("\nratios, ours / transformers generate (float32, same weights, same run)\n")
    print("| runtime | 1 stream | 16 streams (vs static batch 16) | prefill |")
    print("| --- | --- | --- | --- |")
    print(
        f"| transformers (tok/s) | {ref['tok_s_1']:.1f} | {ref['tok_s_16']:.1f} | "
        f"{ref['prefill']:.0f} |"
    )
    for quant, (results, prefill) in ours.items():
        by = {r.streams: r for r in results}
        one = by[1].tok_s / ref["tok_s_1"]
        sixteen = f"{by[16].tok_s / ref['tok_s_16']:.2f}x" if 16 in by else "not run"
        print(f"| {quant} | {one:.2f}x | {sixteen} | {prefill / ref['prefill']:.2f}x |")


if __name__ == "__main__":
    main()
