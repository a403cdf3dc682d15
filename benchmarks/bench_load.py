"""Load time and peak resident memory of a model load, against the bytes the runtime keeps.

Loads a GGUF file or Hugging Face directory (default: the embedded default model) the way
the server does (``load_model`` then ``ModelRunner.from_loaded``, CPU, ``FURNACE_QUANT``'s
default ``auto``) and prints:

- load time (seconds from ``load_model`` to a built runner, native kernels' first build aside:
  they are compiled, or found in their cache, before the clock starts);
- peak resident memory (``VmHWM``), and the resident memory before the load (the Python,
  torch and kernel baseline);
- the runtime weight bytes (every tensor the model holds, counted once) and the KV cache's;
- the ratio of what the load added at its peak to weights + KV cache.

Run: ``python benchmarks/bench_load.py [MODEL] [--quant auto] [--kv-mb 1024]``. Use a fresh
process per measurement (the peak is the process's).

``--blocks-stand-in`` measures the loader alone, as if a native kernel took every quantized
type: each ``linear_from_blocks`` call returns a module that keeps a copy of the blocks
and computes nothing (the model cannot run; the load time and memory are the loader's,
with no dequantize/quantize round trip).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
import torch
from _common import machine
from torch import nn

from furnace_trio.loading.loader import load_model
from furnace_trio.runtime import build, native
from furnace_trio.runtime.build import runtime_weight_bytes
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class _KeptBlocks(nn.Module):
    """A stand-in for a native block layer: a copy of the blocks, no forward."""

    counts_as = "kept blocks"

    def __init__(self, blocks: np.ndarray) -> None:
        super().__init__()
        self.blocks = torch.from_numpy(np.array(blocks))


def _stand_in(blocks: np.ndarray, *_: object) -> nn.Module:
    return _KeptBlocks(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="GGUF file or HF directory")
    parser.add_argument("--quant", default="auto", help="FURNACE_QUANT (auto, none, int8, q4)")
    parser.add_argument("--kv-mb", type=int, default=1024, help="KV cache size (MiB)")
    parser.add_argument("--quiet", action="store_true", help="no load progress lines")
    parser.add_argument(
        "--blocks-stand-in", action="store_true", help="linear_from_blocks keeps every type"
    )
    args = parser.parse_args()
    if args.blocks_stand_in:
        build.linear_from_blocks = _stand_in
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(relativeCreated)8.0f ms %(name)s: %(message)s",
    )
    native.load()  # the kernels' one-time build is not part of the load
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    loaded = load_model(args.model)
    settings = RunnerConfig(device="cpu", kv_cache_bytes=args.kv_mb << 20, quantization=args.quant)
    runner = ModelRunner.from_loaded(loaded, settings)
    elapsed = time.perf_counter() - started
    peak = _status_kib("VmHWM") << 10
    weights = runtime_weight_bytes(runner.model)
    kv = sum(t.numel() * t.element_size() for t in (runner.cache.k, runner.cache.v))
    kv += sum(s.numel() * s.element_size() for s in runner.cache.scales or ())
    added = peak - (before << 10)
    print(f"machine: {machine()}")
    print(f"model: {loaded.source} ({loaded.source.stat().st_size / 2**20:.0f} MiB on disk)")
    print(f"quantization: {args.quant} -> {runner.quantization}")
    print(f"load time: {elapsed:.2f} s")
    print(f"resident before the load: {before / 2**10:.0f} MiB")
    print(f"peak resident (VmHWM): {peak / 2**20:.0f} MiB")
    print(f"runtime weights: {weights / 2**20:.0f} MiB, KV cache: {kv / 2**20:.0f} MiB")
    print(f"peak / (weights + KV): {peak / (weights + kv):.2f}")
    print(f"(peak - before) / (weights + KV): {added / (weights + kv):.2f}")


if __name__ == "__main__":
    main()
