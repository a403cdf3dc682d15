"""A/B of the GGUF block linears: this tree's kernels against a git revision's, one process.

Both ``cpu_kernels.c`` builds (the working tree's and ``--base``'s, compiled with the
server's flags for this CPU into a temporary directory) are loaded side by side through
ctypes and called on the same weights (random valid blocks, each build packing its own
copies) and inputs, call by call alternating: on shared
cores only ratios measured this way mean anything. One row reads its weight from memory
(copies of 160 MiB in all, called in turn), as a model's decode step does. Shapes are the
1B Llama's (out x in): q/o 2048x2048, gate/up fused 16384x2048, down 2048x8192 and the
49,152-row LM head, at 1 and 16 rows. Reports per kernel the best call, new / old speed
from the best calls and as the median of the paired calls' ratios, and whether the two
builds' outputs are bitwise equal.

    PYTHONPATH=src python benchmarks/bench_kquant_ab.py [--base main] [--rounds 40]
        [--rows 1,16] [--flags -mno-avx512f] [--new-flags "-DKQ_ROWS=2 -DKQ_VECS=4"]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from furnace_trio.runtime.native import library  # noqa: E402
from runtime.test_blocks import random_blocks  # noqa: E402

RUNTIME = "src/furnace_trio/runtime"
SOURCES = ("cpu_kernels.c", "cpu_kquants.c", "cpu_repack.c")
CASES = [
    (T.Q4_K, 2048, 2048),
    (T.Q4_K, 16384, 2048),
    (T.Q4_K, 2048, 8192),
    (T.Q6_K, 2048, 8192),
    (T.Q6_K, 49152, 2048),
]
COPY_BYTES = 160 << 20
# The server's flags for this CPU (its tuning too: -DKQ_ROWS=4 on AMD's AVX-512).
FLAGS = [*library.FLAGS, *library.tuning_flags()]


def build(directory: Path, name: str, flags: list[str]) -> ctypes.CDLL:
    target = directory / f"{name}.so"
    subprocess.run(
        ["cc", *FLAGS, *flags, str(directory / name / "cpu_kernels.c"), "-o", str(target), "-lm"],
        check=True,
    )
    lib = ctypes.CDLL(str(target))
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.furnace_kq_linear.argtypes = [ctypes.c_int, p, i, i, p, p, i, p, p]
    lib.furnace_kq_linear.restype = ctypes.c_int
    lib.furnace_kq_scratch.argtypes = [ctypes.c_int, i, i]
    lib.furnace_kq_scratch.restype = i
    lib.furnace_kq_pack.argtypes = [ctypes.c_int, p, i, i, p]
    lib.furnace_kq_pack.restype = ctypes.c_int
    lib.furnace_kq_packed_size.argtypes = [ctypes.c_int, i, i]
    lib.furnace_kq_packed_size.restype = i
    return lib


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def run(
    lib: ctypes.CDLL,
    t: int,
    x: np.ndarray,
    rows: int,
    k: int,
    packed: np.ndarray,
    n: int,
    y: np.ndarray,
    scratch: np.ndarray,
) -> None:
    rc = lib.furnace_kq_linear(int(t), ptr(x), rows, k, ptr(packed), None, n, ptr(y), ptr(scratch))
    assert rc == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="main")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--flags", default="", help="extra compiler flags for both builds")
    parser.add_argument("--new-flags", default="", help="extra compiler flags for the new build")
    parser.add_argument("--rows", default="1,16")
    args = parser.parse_args()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    print(f"CPU: {cpu}; base {args.base}; flags {args.flags or '(none)'}")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for name, read in (
            (
                "old",
                lambda f: (
                    subprocess.run(
                        ["git", "show", f"{args.base}:{RUNTIME}/{f}"],
                        cwd=ROOT,
                        check=True,
                        capture_output=True,
                    ).stdout
                ),
            ),
            ("new", lambda f: (ROOT / RUNTIME / f).read_bytes()),
        ):
            (directory / name).mkdir()
            for f in SOURCES:
                try:
                    (directory / name / f).write_bytes(read(f))
                except subprocess.CalledProcessError:
                    # a revision from before cpu_repack.c kept that code in cpu_kquants.c
                    if f != "cpu_repack.c":
                        raise
        libs = {
            "old": build(directory, "old", args.flags.split()),
            "new": build(directory, "new", [*args.flags.split(), *args.new_flags.split()]),
        }
        rng = np.random.default_rng(0)
        print(
            f"{'type':5} {'out x in':>11} {'rows':>4} {'old ms':>8} {'new ms':>8} {'best':>9} {'paired':>9} bitwise"
        )
        for t, n, k in CASES:
            blocks = random_blocks(t, n, k, rng, 1.0 / np.sqrt(k))
            # Copies enough to overflow the caches, called in turn: one row reads its
            # weight from memory, as a model's decode step does. Each build packs its own
            # (builds of different widths lay out their panels differently).
            copies: dict[str, list[np.ndarray]] = {}
            for name, lib in libs.items():
                size = lib.furnace_kq_packed_size(int(t), n, k)
                copies[name] = [np.empty(size, np.uint8) for _ in range(-(-COPY_BYTES // size))]
                for packed in copies[name]:
                    assert lib.furnace_kq_pack(int(t), ptr(blocks), n, k, ptr(packed)) == 0
            for rows in (int(r) for r in args.rows.split(",")):
                x = rng.standard_normal((rows, k)).astype(np.float32)
                scratch = np.empty(
                    max(lib.furnace_kq_scratch(int(t), rows, k) for lib in libs.values()) // 4 + 16,
                    np.float32,
                )
                ys = {name: np.empty((rows, n), np.float32) for name in libs}
                times: dict[str, list[float]] = {name: [] for name in libs}
                turn = itertools.count()
                for name, lib in libs.items():  # warm: first touch, thread start
                    run(lib, t, x, rows, k, copies[name][0], n, ys[name], scratch)
                for i in range(args.rounds):
                    order = list(libs.items())
                    for name, lib in order if i % 2 else order[::-1]:
                        packed = copies[name][next(turn) % len(copies[name])]
                        start = time.perf_counter()
                        run(lib, t, x, rows, k, packed, n, ys[name], scratch)
                        times[name].append(time.perf_counter() - start)
                best = {name: min(times[name]) for name in libs}
                paired = statistics.median(
                    o / w for o, w in zip(times["old"], times["new"], strict=True)
                )
                same = np.array_equal(ys["old"].view(np.uint32), ys["new"].view(np.uint32))
                print(
                    f"{t.name:5} {n:>5}x{k:<5} {rows:>4} {best['old'] * 1e3:8.3f} {best['new'] * 1e3:8.3f} "
                    f"{best['old'] / best['new']:9.2f} {paired:9.2f} {'yes' if same else 'NO'}"
                )


if __name__ == "__main__":
    main()
