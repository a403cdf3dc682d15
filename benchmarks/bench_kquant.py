"""The GGUF block linears (runtime.blocks) per type: GEMV and a 16-row GEMM.

For each type, a 2048 x 8192 and an 8192 x 2048 weight (out x in, random valid blocks),
one row (decode: bound by reading the weight) and 16 rows (bound by arithmetic), in one
process with the types alternating round by round; the best of the rounds (on shared
cores the least disturbed one), and the median beside it. Reports the
effective GB/s of the packed weight bytes the kernel reads, the ratio to Q4_1 (the known-good
kernel) and to the memory bandwidth measured in the same run (a sum over 1 GiB of float32
and a 512 MiB copy, torch's threads).

    PYTHONPATH=src python benchmarks/bench_kquant.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _common import bandwidth
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from furnace_trio.runtime import native
from furnace_trio.runtime.blocks import linear_from_blocks
from runtime.test_blocks import random_blocks

TYPES = [T.Q4_1, T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
SHAPES = [(2048, 8192), (8192, 2048)]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    kernels = native.load()
    if kernels is None:
        raise SystemExit("no native kernels (a C compiler is needed)")
    print(
        f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, vector width {kernels.vector_width}"
    )
    rng = np.random.default_rng(0)
    cases = []
    for n, k in SHAPES:
        for t in TYPES:
            blocks = random_blocks(t, n, k, rng, 1.0 / np.sqrt(k))
            module = linear_from_blocks(blocks, t, (n, k), None, kernels)
            assert module is not None
            cases.append((t, (n, k), module, module.packed.numel()))
    inputs = {rows: {k: torch.randn(rows, k) for _, k in SHAPES} for rows in (1, 16)}
    timings: dict[tuple[int, tuple[int, int], int], list[float]] = {}
    sum_bw, copy_bw = bandwidth(3)
    for _ in range(args.rounds):
        for t, shape, module, _ in cases:
            for rows in (1, 16):
                x = inputs[rows][shape[1]]
                module(x)  # warm: the weight's first touch is not the measurement
                reps = 20 if rows == 1 else 5
                start = time.perf_counter()
                for _ in range(reps):
                    module(x)
                timings.setdefault((t, shape, rows), []).append(
                    (time.perf_counter() - start) / reps
                )
    sum_bw2, copy_bw2 = bandwidth(3)
    memory = max(sum_bw, sum_bw2)
    print(
        f"memory: sum {memory:.1f} GB/s read, copy {max(copy_bw, copy_bw2):.1f} GB/s (read + write)"
    )
    header = f"{'type':6} {'out x in':>11} {'rows':>4} {'ms':>8} {'median':>8} {'GB/s':>7} {'vs Q4_1':>8} {'vs mem':>7}"
    print(header)
    base: dict[tuple[tuple[int, int], int], float] = {}
    for t, shape, _, nbytes in cases:
        for rows in (1, 16):
            sec = min(timings[(t, shape, rows)])
            median = statistics.median(timings[(t, shape, rows)])
            gbs = nbytes / sec / 1e9
            if t == T.Q4_1:
                base[(shape, rows)] = gbs
            ratio = gbs / base[(shape, rows)]
            print(
                f"{t.name:6} {shape[0]:>5}x{shape[1]:<5} {rows:>4} {sec * 1e3:8.3f} {median * 1e3:8.3f} "
                f"{gbs:7.1f} {ratio:8.2f} {gbs / memory:7.2f}"
            )


if __name__ == "__main__":
    main()
