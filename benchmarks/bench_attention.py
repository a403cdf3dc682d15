"""The native decode attention alone: one layer's call over a paged cache, A/B in one process.

Not a test. Times ``Kernels.paged_decode_attention`` for S sequences at a context of
``ctx`` positions each (SmolLM2's heads: 9 query heads over 3 KV heads of 64), with a
float16 and an int8 cache (random keys and values in shuffled blocks of 16). With
``--baseline-source FILE`` a second build of the kernels from an older ``cpu_kernels.c``
runs beside the current one, rounds alternated, and the per-round ratio (baseline time /
current time) is printed with its quartiles, and whether both builds give bitwise the same
output. ``--flags`` builds both with extra compiler flags (``-mno-avx512f``: the AVX2 build).

    python benchmarks/bench_attention.py [--shapes 16x2000,1x2000,16x300]
        [--baseline-source /tmp/old/cpu_kernels.c] [--flags=-mno-avx512f] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from furnace_trio.runtime import native
from furnace_trio.runtime.native import library

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def build(source: Path | None, flags: tuple[str, ...]) -> native.Kernels:
    saved = library.SOURCE
    if source is not None:
        library.SOURCE = source
    try:
        kernels = native.load(extra_flags=flags)
    finally:
        library.SOURCE = saved
    if kernels is None:
        raise SystemExit("the native kernels did not build (a C compiler is needed)")
    return kernels


Cache = tuple[torch.Tensor, torch.Tensor, native.KVScales | None]


def caches(blocks: int, gen: torch.Generator) -> dict[str, Cache]:
    """name -> (k, v, scales or None): float16, and int8 with its scales."""
    k = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    (kq, ks), (vq, vs) = native.quantize_kv_rows(k), native.quantize_kv_rows(v)
    return {"float16": (k.half(), v.half(), None), "int8": (kq, vq, (ks, vs))}


def call(
    kernels: native.Kernels,
    cache: Cache,
    q: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    k, v, scales = cache
    kernels.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5, out, scales)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="16x2000,1x2000,16x300", help="SEQUENCESxCONTEXT,...")
    ap.add_argument("--baseline-source", type=Path, default=None)
    ap.add_argument("--flags", default="", help="extra compiler flags for both builds")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    flags = tuple(args.flags.split())
    builds = {"current": build(None, flags)}
    if args.baseline_source is not None:
        builds["baseline"] = build(args.baseline_source, flags)
    print(f"threads {torch.get_num_threads()}, vector width {builds['current'].vector_width}")
    for shape in args.shapes.split(","):
        seqs, ctx = (int(x) for x in shape.split("x"))
        per = -(-ctx // BLOCK)
        gen = torch.Generator().manual_seed(seqs * 7919 + ctx)
        tables = torch.randperm(seqs * per, generator=gen).view(seqs, per).contiguous()
        lens = torch.full((seqs,), ctx, dtype=torch.int64)
        q = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen)
        for kind, cache in caches(seqs * per, gen).items():
            outs = {}
            for name, kernels in builds.items():
                outs[name] = torch.empty_like(q)
                call(kernels, cache, q, tables, lens, outs[name])
            times: dict[str, list[float]] = {name: [] for name in builds}
            order = list(builds)
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    out = torch.empty_like(q)
                    start = time.perf_counter()
                    for _ in range(args.reps):
                        call(builds[name], cache, q, tables, lens, out)
                    times[name].append((time.perf_counter() - start) / args.reps * 1e3)
            line = f"{shape:>9s} {kind:8s} current {statistics.median(times['current']):7.3f} ms"
            if "baseline" in builds:
                ratios = sorted(
                    b / c for b, c in zip(times["baseline"], times["current"], strict=True)
                )
                q1, q3 = ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]
                same = torch.equal(outs["baseline"], outs["current"])
                line += (
                    f"  baseline {statistics.median(times['baseline']):7.3f} ms"
                    f"  speedup {statistics.median(ratios):.2f}x [{q1:.2f}, {q3:.2f}]"
                    f"  bitwise the same: {same}"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
