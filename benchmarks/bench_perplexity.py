"""Perplexity of a GGUF file through furnace-trio's runtime against llama.cpp's own
``llama-perplexity`` on the same file and text: the check that our native kernels for the
file's block types (Q4_0, Q5_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, and the int8 fallback) compute
what ggml's do, to the precision the quantized activations allow.

Both sides follow llama-perplexity's protocol: the text's tokens in chunks of ``--ctx``,
BOS first in each chunk when the model adds one, and only the second half of each chunk
scored (every position predicts the next token; the first half is context). The report
gives both perplexities and their ratio; the issue's bar is within 1%.

``--requantize TYPE`` makes a copy of the file in another type with ``llama-quantize
--allow-requantize`` (e.g. the default SmolLM2 Q4_1 as Q4_K_M: its 576-wide rows are not a
multiple of 256, so llama.cpp mixes in its fallback types, which exercises more kernels).

    python benchmarks/bench_perplexity.py [--model PATH] [--requantize Q4_K_M]
        [--text /usr/share/common-licenses/GPL-3] [--ctx 256] [--chunks 16] [--reference]
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine
from _llama_server import build_llama_tool

from furnace_trio.loading.default_model import default_model_path
from furnace_trio.loading.loader import load_model
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig


def ours(
    model: Path, ids: list[int], bos: int | None, ctx: int, chunks: int, quantization: str
) -> float:
    """Perplexity by llama-perplexity's protocol through our runner: ``auto`` is the
    server's default (the file's blocks through the native kernels), ``none`` float32 on
    the dequantized weights (the reference without quantized activations)."""
    loaded = load_model(str(model))
    runner = ModelRunner.from_loaded(
        loaded, RunnerConfig(device="cpu", kv_cache_bytes=64 << 20, quantization=quantization)
    )
    first = ctx // 2
    nll, count = 0.0, 0
    for c in range(chunks):
        chunk = list(ids[c * ctx : (c + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        logits = runner.prompt_logits(chunk)
        logp = F.log_softmax(logits[first : ctx - 1].double(), dim=-1)
        target = torch.tensor(chunk[first + 1 : ctx])
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += ctx - 1 - first
    return math.exp(nll / count)


def llama(model: Path, text: Path, ctx: int, chunks: int) -> float:
    binary = build_llama_tool("llama-perplexity")
    out = subprocess.run(
        [
            str(binary),
            "-m",
            str(model),
            "-f",
            str(text),
            "-c",
            str(ctx),
            "-b",
            str(ctx),
            "--chunks",
            str(chunks),
            "-t",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if found is None:
        raise RuntimeError(f"no final estimate in llama-perplexity's output:\n{out.stderr[-2000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    parser.add_argument("--requantize", default=None, help="a llama-quantize type, e.g. Q4_K_M")
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument(
        "--reference", action="store_true", help="also float32 on the dequantized weights"
    )
    args = parser.parse_args()
    model = Path(args.model) if args.model else default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        if args.requantize:
            target = Path(tmp) / f"{model.stem}.{args.requantize}.gguf"
            quantize = build_llama_tool("llama-quantize")
            subprocess.run(
                [str(quantize), "--allow-requantize", str(model), str(target), args.requantize],
                check=True,
                capture_output=True,
            )
            model = target
        text = Path(args.text).read_text()
        tokenizer = load_model(str(model)).tokenizer
        ids = tokenizer.encode(text, add_special_tokens=False)
        bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None
        chunks = min(args.chunks, len(ids) // args.ctx)
        print(f"{model.name}, {len(ids)} tokens, {chunks} chunks of {args.ctx}; {machine()}")
        started = time.perf_counter()
        ppl_llama = llama(model, Path(args.text), args.ctx, chunks)
        mid = time.perf_counter()
        ppl_ours = ours(model, ids, bos, args.ctx, chunks, "auto")
        done = time.perf_counter()
        ppl_float = ours(model, ids, bos, args.ctx, chunks, "none") if args.reference else None
    print(f"llama-perplexity {ppl_llama:.4f} ({mid - started:.1f} s)")
    print(f"furnace-trio     {ppl_ours:.4f} ({done - mid:.1f} s)")
    print(f"ratio (ours / llama.cpp) {ppl_ours / ppl_llama:.4f}")
    if ppl_float is not None:
        print(f"float32 on the dequantized weights {ppl_float:.4f}")
        print(f"ratio (ours / float32) {ppl_ours / ppl_float:.4f}")
        print(f"ratio (llama.cpp / float32) {ppl_llama / ppl_float:.4f}")


if __name__ == "__main__":
    main()
