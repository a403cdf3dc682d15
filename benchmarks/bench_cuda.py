"""The CUDA path on a GPU: engine level and over HTTP, against transformers on the same GPU.

- Engine level: the default model on ``cuda`` (``--dtype``, default bfloat16, no
  quantization), the server's CUDA engine defaults, closed loops of 1, 16 and 64 streams
  (greedy, ``ignore_eos``, ``--max-tokens``); TTFT, ITL and aggregate tok/s; prefill of a
  1,000-token prompt. Twice, after an untimed pass that takes the process's first-use
  costs: with the decode steps replayed from CUDA graphs (the default) and with every op
  launched from Python, printed as a ratio; each model step timed by kind (graph replay,
  other decode, with a prefill chunk), and each request's time to first token at 1 stream.
  transformers ``generate`` on the same GPU, dtype and weights (one sequence, static
  batches of 16 and 64) in the same run, printed as ratios.
- Over HTTP: ``hypercorn furnace_trio.app:app`` in a subprocess with ``FURNACE_DEVICE=cuda``
  (as users run it), streams from an httpx client at 1, 16 and 64.
- Batch invariance: 20 chat prompts x 32 greedy tokens decoded alone and inside a batch of
  all 20 (runner level), the share whose tokens differ, for bfloat16 and float32.

    python benchmarks/bench_cuda.py [--dtype bfloat16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from typing import Any

import httpx
import torch
import trio
from _common import PROMPTS, chat_ids, machine, pct, transformers_model
from bench_engine import pad_id, padded_batch, run_engine
from bench_http import free_port, run, serve, wait_ready
from bench_quality import greedy

from furnace_trio.core.plan import SampledToken, StepPlan
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.loading.loader import LoadedModel, load_model
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig
from furnace_trio.server.backend import engine_config
from furnace_trio.server.config import ServerConfig

WORKLOADS = [(1, 3), (16, 3), (64, 2)]  # (streams, requests per stream)
#: ``--quick``: a smoke run of the script itself (``--device cpu`` checks it without a GPU).
QUICK = [(1, 1), (4, 1)]
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_runner(
    loaded: LoadedModel, dtype: str, kv_gb: int = 8, graphs: bool | None = None
) -> ModelRunner:
    settings = RunnerConfig(
        device=DEVICE, dtype=dtype, kv_cache_bytes=kv_gb << 30, cuda_graphs=graphs
    )
    runner = ModelRunner.from_loaded(loaded, settings)
    # As the server warms up: every batch size's decode graph captured before serving.
    runner.capture_graphs(engine_config(ServerConfig(), DEVICE).max_running)
    return runner


def transformers_figures(
    loaded: LoadedModel, dtype: torch.dtype, batches: list[int], max_tokens: int
) -> dict[int, float]:
    model = transformers_model(loaded).to(DEVICE, dtype)
    pad = pad_id(loaded)
    figures: dict[int, float] = {}
    with torch.inference_mode():
        for batch in batches:
            ids, mask, width = padded_batch(loaded, batch, DEVICE)
            kwargs = {"do_sample": False, "pad_token_id": pad, "attention_mask": mask}
            model.generate(ids, max_new_tokens=4, **kwargs)  # warm-up
            sync()
            start = time.perf_counter()
            out = model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs
            )
            sync()
            figures[batch] = (out.shape[1] - width) * batch / (time.perf_counter() - start)
    return figures


def http_figures(workloads: list[tuple[int, int]], max_tokens: int) -> list[Any]:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    proc = serve("none", port, {"FURNACE_DEVICE": DEVICE})
    try:
        wait_ready(base_url, proc)
        model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        return asyncio.run(run(base_url, model, workloads, max_tokens))[:-1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class StepTrace:
    """Every step of ``runner`` timed (the device synchronized after it), by kind: decode
    graph replays, other all-decode steps, steps with a prefill chunk; and every pause of
    Python's cyclic garbage collector, so that a slow first token can be explained."""

    KINDS = ("graph", "decode", "prefill")

    def __init__(self, runner: ModelRunner) -> None:
        #: (start, end, kind, sequences, tokens) of every step, in order.
        self.steps: list[tuple[float, float, str, int, int]] = []
        #: (start, end, generation) of every collection while the trace is on.
        self.pauses: list[tuple[float, float, int]] = []
        step = runner.step
        graphs = runner.graphs
        self.warm = graphs.captured if graphs is not None else ()

        def timed(plan: StepPlan) -> list[SampledToken]:
            start = time.perf_counter()
            out = step(plan)
            sync()
            if graphs is not None and graphs.accepts(plan):
                kind = "graph"
            elif all(len(c.token_ids) == 1 for c in plan.chunks):
                kind = "decode"
            else:
                kind = "prefill"
            tokens = sum(len(c.token_ids) for c in plan.chunks)
            self.steps.append((start, time.perf_counter(), kind, len(plan.chunks), tokens))
            return out

        runner.step = timed  # type: ignore[method-assign]
        self._graphs = graphs
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.pauses.append((self._gc_start, time.perf_counter(), info["generation"]))

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def summary(self) -> str:
        parts = []
        for kind in self.KINDS:
            ms = [(b - a) * 1e3 for a, b, k, *_ in self.steps if k == kind]
            if ms:
                parts.append(
                    f"{kind} {len(ms)} steps, p50 {pct(ms, 50):.1f} p95 {pct(ms, 95):.1f} ms"
                )
        # From the first step on: not the run's own gc.collect() before gc.freeze().
        first = self.steps[0][0] if self.steps else 0.0
        pauses = [b - a for a, b, _ in self.pauses if a >= first]
        slow = sum(1 for p in pauses if p > 0.01)
        worst = max(pauses, default=0.0)
        parts.append(f"{len(pauses)} GC pauses ({slow} over 10 ms, longest {worst * 1e3:.0f} ms)")
        if self._graphs is not None:
            late = [g for g in self._graphs.captured if g not in self.warm]
            parts.append(f"captured while serving: {late or 'none'}")
        return "; ".join(parts)

    def first_tokens(self, result: Any, which: list[int]) -> list[str]:
        """Where the time to first token of requests ``which`` of ``result`` went: the steps
        that ran from submit to first token, the collector's pauses, and the rest."""
        lines = []
        for start, ttft in [(result.starts[i], result.ttft[i]) for i in which]:
            end = start + ttft
            inside = [s for s in self.steps if s[1] > start and s[0] < end]
            in_steps = sum(min(b, end) - max(a, start) for a, b, *_ in inside)
            in_gc = sum(
                min(b, end) - max(a, start) for a, b, _ in self.pauses if b > start and a < end
            )
            steps = ", ".join(f"{k} {n}x{t} {1e3 * (b - a):.1f}" for a, b, k, n, t in inside[:8])
            lines.append(
                f"TTFT {ttft * 1e3:.0f} ms = steps {in_steps * 1e3:.0f} + GC {in_gc * 1e3:.0f} + "
                f"other {(ttft - in_steps - in_gc) * 1e3:.0f} ms; steps (kind seqs x tokens ms): "
                f"{steps}{' ...' if len(inside) > 8 else ''}"
            )
        return lines

    def longest(self, count: int = 5) -> str:
        top = sorted(self.steps, key=lambda s: s[0] - s[1])[:count]
        return ", ".join(f"{k} {n}x{t} {1e3 * (b - a):.0f} ms" for a, b, k, n, t in top)


def invariance(loaded: LoadedModel, dtype: str, steps: int) -> int:
    runner = cuda_runner(loaded, dtype, kv_gb=1)
    prompts = [chat_ids(loaded, p) for p in PROMPTS]
    alone = [greedy(runner, [p], steps)[0] for p in prompts]
    batched = greedy(runner, prompts, steps)
    return sum(a != b for a, b in zip(alone, batched, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="a smoke run of this script")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    workloads = QUICK if args.quick else WORKLOADS
    steps = 4 if args.quick else 32
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "no GPU"
    print(f"machine: {machine()}, {gpu}")
    loaded = load_model(None)
    runs = {}
    traces = {}
    # An untimed pass first (every op launched), so that neither measured engine pays the
    # process's first-use costs; then the default (graphs on a GPU), then every op launched.
    passes = ((False, False, QUICK), (True, True, workloads), (True, False, workloads))
    for timed, graphs, loads in passes:
        thread = ModelThread()  # the engine closes it when it stops
        kv_gb = 8 if DEVICE == "cuda" else 1
        runner = thread.call(cuda_runner, loaded, args.dtype, kv_gb, graphs)
        trace = StepTrace(runner)
        results = trio.run(run_engine, runner, thread, loaded, loads, args.max_tokens, DEVICE)
        trace.close()
        if timed:
            runs[graphs], traces[graphs] = results, trace
        del runner
        gc.collect()  # the engine's reference cycles hold the runner's KV cache
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    ours, prefill = runs[True]
    eager = runs[False][0]
    batches = [s for s, _ in workloads]
    ref = transformers_figures(loaded, getattr(torch, args.dtype), batches, args.max_tokens)
    over_http = http_figures(workloads, args.max_tokens)

    print(f"\n{args.dtype} on {DEVICE}, max_tokens={args.max_tokens}, greedy, closed loop\n")
    print("| side | streams | tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in ours:
        print(r.row("engine"))
    for r in eager:
        print(r.row("engine, no CUDA graphs"))
    for graphs, trace in traces.items():
        label = "with" if graphs else "without"
        print(f"engine {label} graphs, model steps: {trace.summary()}")
        print(f"  longest steps: {trace.longest()}")
        results = runs[graphs][0]
        print(
            f"  TTFT of each request at 1 stream, ms: {sorted(round(t * 1e3) for t in results[0].ttft)}"
        )
        for line in trace.first_tokens(results[0], [0, 1, 2][: len(results[0].ttft)]):
            print(f"  1 stream: {line}")
        slowest = max(results, key=lambda r: pct(r.ttft, 95))
        worst = sorted(range(len(slowest.ttft)), key=lambda i: -slowest.ttft[i])[:2]
        for line in trace.first_tokens(slowest, worst):
            print(f"  {slowest.streams} streams, a slowest request: {line}")
    for r in over_http:
        print(r.row("HTTP (hypercorn subprocess)"))
    print(
        "\n| streams | transformers generate tok/s | engine / transformers | HTTP / engine "
        "| graphs / no graphs (engine) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for mine, http, plain in zip(ours, over_http, eager, strict=True):
        t = ref[mine.streams]
        print(
            f"| {mine.streams} | {t:.0f} | {mine.tok_s / t:.2f}x | {http.tok_s / mine.tok_s:.3f} "
            f"| {mine.tok_s / plain.tok_s:.2f}x |"
        )
    print(f"\nprefill, 1,000-token prompt: {prefill:.0f} tok/s")
    for dtype in ("bfloat16", "float32"):
        differ = invariance(loaded, dtype, steps)
        print(
            f"batch invariance ({dtype}): {differ}/{len(PROMPTS)} prompts differ alone vs in a batch"
        )


if __name__ == "__main__":
    main()
