"""Runner-level step times: decode (1 and 16 sequences) and prefill chunks, A/B in one process.

Not a test. Builds a :class:`ModelRunner` for each quantization and times ``runner.step``
directly (no engine): a decode step of 1 and of 16 sequences at each ``--ctx`` tokens of
context (default 150; ``decode1@2000`` is one sequence at 2,000), a fresh 250-token
prefill, a 250-token chunk after 1,600 cached tokens, and short chunks: 8 tokens after
32 and 16 after 1,000. With
``--baseline DIR`` a copy of the package (importable as ``furnace_base`` from ``DIR``) is
timed in the same process, interleaved, and ratios are printed (baseline / current).
``--kv-dtype int8,auto`` times the runner with an int8 KV cache beside one with the
default cache instead (ratios: the second / the first).
``--thread`` also times the decode step from a Trio worker thread, as the engine calls it.
``--stub-kernels`` replaces the fused decode call and the 4-bit / 8-bit linear layers with
stubs (the LM head writes zeros), so a decode step times only the runner's own Python and
torch work around them.

    python benchmarks/bench_step.py [--baseline /tmp/base] [--quant none,int8] [--thread]
        [--ctx 150,2000] [--kv-dtype int8,auto] [--model PATH]

``--model``: another model than the default, e.g. ``_random_gguf.py``'s 1B-shaped Q4_K_M
(``--quant auto`` runs its linears on the file's own blocks).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from furnace_trio.loading.loader import load_model
from furnace_trio.runtime.kv_cache import KVCache


def _plans(
    mod: Any, ctx: int, n: int, block: int, contexts: tuple[int, ...] = ()
) -> dict[str, Any]:
    package = mod.__name__.split(".", 1)[0]  # furnace_trio or a baseline copy
    plan_mod = importlib.import_module(f"{package}.core.plan")
    params_mod = importlib.import_module(f"{package}.core.params")
    params = params_mod.SamplingParams(temperature=0.0, max_tokens=16)
    C, S, P = plan_mod.ChunkPlan, plan_mod.StepPlan, plan_mod.SampleSpec

    def dec(k: int, at: int = ctx) -> Any:
        """k sequences decoding at context ``at``, each with its own blocks."""
        per = -(-(at + 2) // block)
        return S(
            tuple(
                C(i, (100 + i,), at, tuple(range(i * per, (i + 1) * per)), (P(i, params),))
                for i in range(k)
            )
        )

    long_blocks = tuple(range(2000 // block + 1))
    fresh = S((C(999, tuple(range(1000, 1250)), 0, long_blocks, (P(999, params),)),))
    hist = S((C(999, tuple(range(1000, 1250)), 1600, long_blocks, (P(999, params),)),))
    plans = {"decode1": dec(1), f"decode{n}": dec(n)}
    for at in contexts:
        plans |= {f"decode1@{at}": dec(1, at), f"decode{n}@{at}": dec(n, at)}
    # A short chunk after a few cached tokens (the uncached tail of a chat prompt), and a
    # follow-up turn after a long conversation.
    tail = S((C(999, tuple(range(1000, 1008)), 32, long_blocks, (P(999, params),)),))
    turn = S((C(999, tuple(range(1000, 1016)), 1000, long_blocks, (P(999, params),)),))
    plans |= {"prefill250": fresh, "chunk250@1600": hist}
    return plans | {"chunk8@32": tail, "chunk16@1000": turn}


def _stub(kernels: Any) -> None:
    """No fused decode call, and linear layers that write zeros (no work, a valid argmax)."""
    kernels.decode_layers = lambda *args: None
    kernels.grouped_linear = lambda bits, x, packed, bias, out: out.zero_()


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--quant", default="none,int8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--thread", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated plan names")
    ap.add_argument("--ctx", default="150", help="decode contexts, comma-separated")
    ap.add_argument("--stub-kernels", action="store_true")
    ap.add_argument("--model", default=None, help="a GGUF or HF directory (default: SmolLM2)")
    ap.add_argument(
        "--kv-dtype",
        default="auto",
        help="the runners' KV cache dtype; two, comma-separated (auto,int8): the second "
        "runs beside the first as its reference (without --baseline)",
    )
    args = ap.parse_args()
    base_ctx, *contexts = (int(c) for c in args.ctx.split(","))
    loaded = load_model(args.model)
    cfg = loaded.config
    # Room for 16 sequences at the longest context and the prefills (float32, 16-token blocks).
    blocks = 16 * (max([base_ctx, *contexts]) // 16 + 2) + 200
    kv_bytes = blocks * KVCache.bytes_per_block(cfg, 16, torch.float32)
    kv_dtypes = args.kv_dtype.split(",")
    if args.baseline and len(kv_dtypes) > 1:
        raise SystemExit("--baseline takes one --kv-dtype")
    current = importlib.import_module("furnace_trio.runtime.runner")
    # side -> (runner module, KV dtype); the second side is the first's reference
    sides = {"current": (current, kv_dtypes[0])}
    if args.baseline:
        sys.path.insert(0, args.baseline)
        sides["baseline"] = (importlib.import_module("furnace_base.runtime.runner"), kv_dtypes[0])
    elif len(kv_dtypes) > 1:
        sides[f"kv {kv_dtypes[1]}"] = (current, kv_dtypes[1])
    print(f"threads {torch.get_num_threads()}, cpu {torch.backends.cpu.get_cpu_capability()}")
    for quant in args.quant.split(","):
        runners = {}
        for name, (mod, kv_dtype) in sides.items():
            settings = mod.RunnerConfig(
                device="cpu", kv_cache_bytes=kv_bytes, quantization=quant, kv_dtype=kv_dtype
            )
            if args.model:  # the file's own records (blocks), read by the side's own loader
                package = mod.__name__.split(".", 1)[0]
                own = importlib.import_module(f"{package}.loading.loader").load_model(args.model)
                runners[name] = mod.ModelRunner(own.config, own.weights, settings)
            else:
                runners[name] = mod.ModelRunner(loaded.config, dict(loaded.weights), settings)
            if args.stub_kernels:
                _stub(runners[name]._kernels)
        results: dict[str, dict[str, list[float]]] = {n: {} for n in sides}
        for name, (mod, _) in sides.items():
            plans = _plans(mod, base_ctx, 16, runners[name].block_size, tuple(contexts))
            # Fill the cache once so chunk@1600 attends real numbers.
            runners[name].step(plans["prefill250"])
        for rnd in range(args.rounds):
            order = [(name, mod) for name, (mod, _) in sides.items()]
            for name, mod in order if rnd % 2 == 0 else order[::-1]:
                plans = _plans(mod, base_ctx, 16, runners[name].block_size, tuple(contexts))
                r = runners[name]
                for key, plan in plans.items():
                    if args.only and key not in args.only.split(","):
                        continue
                    reps = args.reps if key.startswith("decode") else max(3, args.reps // 3)
                    t = _time(lambda r=r, plan=plan: r.step(plan), reps)
                    results[name].setdefault(key, []).append(t)
                if args.thread:
                    import trio

                    async def in_thread(r: Any = r, plan: Any = plans["decode1"]) -> float:
                        return await trio.to_thread.run_sync(
                            lambda: _time(lambda: r.step(plan), args.reps)
                        )

                    results[name].setdefault("decode1[trio thread]", []).append(trio.run(in_thread))
        names = list(sides)
        for key in results["current"]:
            cur = statistics.median(results["current"][key]) * 1e3
            line = f"{quant:5s} {key:22s} current {cur:8.2f} ms"
            if len(names) == 2:
                base = statistics.median(results[names[1]][key]) * 1e3
                line += f"  {names[1]} {base:8.2f} ms  speedup {base / cur:5.2f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
