"""Quality and batch invariance of the quantized runtimes against float32 (runner level, greedy).

- Token agreement: 20 chat prompts x 64 greedy tokens, each quantized runtime vs float32:
  free-running (the share of positions before the first divergence; sequences drift apart
  after it), and teacher-forced (its top-1 on float32's greedy continuation, position by
  position).
- Batch invariance: each prompt decoded alone vs inside a batch of all 20 (prefilled in one
  step, then decoded together): the share of prompts whose 64 tokens differ, per runtime.
- Perplexity of every runtime on ``tests/data/perplexity.txt``.

``q4`` is the 4-bit native kernel (the default model's own Q4_1 weights, int8 activations
per group of 32), ``int8`` the native weight-only kernel, ``int8-torch`` the fbgemm path
(int8 activations in two 7-bit passes); ``+kv8`` (``q4+kv8``) adds an int8 KV cache.

Perplexity and teacher-forced agreement come from one prefill per text, where attention
reads a chunk's own keys, not the cache; ``--chunk 16`` feeds the text 16 tokens at a time
instead, each chunk after the cached ones, so attention reads the KV cache as decoding
does (what ``+kv8`` changes).

    python benchmarks/bench_quality.py [--runtimes none,q4,int8,int8-torch] [--chunk 16]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import PROMPTS, TEXT, chat_ids, machine, runtime_config

from furnace_trio.core.plan import ChunkPlan, StepPlan
from furnace_trio.loading.loader import load_model
from furnace_trio.runtime.runner import ModelRunner

STEPS = 64


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens of all ``prompts`` decoded together (one prefill step, then decodes)."""
    per_seq = -(-(max(len(p) for p in prompts) + steps) // runner.block_size)
    tables = [tuple(range(b * per_seq, (b + 1) * per_seq)) for b in range(len(prompts))]
    plan = StepPlan(tuple(ChunkPlan(b, tuple(p), 0, tables[b]) for b, p in enumerate(prompts)))
    logits = runner.logits(plan)
    out: list[list[int]] = [[] for _ in prompts]
    for i in range(steps):
        ids = logits.argmax(-1).tolist()
        for b, t in enumerate(ids):
            out[b].append(t)
        chunks = tuple(
            ChunkPlan(b, (ids[b],), len(p) + i, tables[b]) for b, p in enumerate(prompts)
        )
        logits = runner.logits(StepPlan(chunks))
    return out


def perplexity(runner: ModelRunner, ids: list[int], chunk: int | None) -> float:
    logits = runner.prompt_logits(ids, chunk)
    return math.exp(float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtimes", default="none,q4,int8,int8-torch")
    ap.add_argument("--chunk", type=int, default=None, help="tokens per step (default: one)")
    args = ap.parse_args()
    quants = ["none", *(q for q in args.runtimes.split(",") if q != "none")]
    print(f"machine: {machine()}")
    loaded = load_model(None)
    prompts = [chat_ids(loaded, p) for p in PROMPTS]
    text_ids = loaded.tokenizer.encode(Path(TEXT).read_text(), add_special_tokens=False)
    alone: dict[str, list[list[int]]] = {}
    runners: dict[str, ModelRunner] = {}
    for quant in quants:
        runner = ModelRunner.from_loaded(loaded, runtime_config(quant, 256 << 20))
        runners[quant] = runner
        alone[quant] = [greedy(runner, [p], STEPS)[0] for p in prompts]
        batched = greedy(runner, prompts, STEPS)
        differ = sum(a != b for a, b in zip(alone[quant], batched, strict=True))
        print(
            f"{quant}: batch invariance: {differ}/{len(prompts)} prompts differ alone vs in "
            f"a batch of {len(prompts)}; perplexity {perplexity(runner, text_ids, args.chunk):.3f} "
            f"({len(text_ids)} tokens, {args.chunk or 'one step'} per step)"
        )
    for quant in quants[1:]:
        agreement(quant, prompts, alone, runners[quant], args.chunk)


def agreement(
    quant: str,
    prompts: list[list[int]],
    alone: dict[str, list[list[int]]],
    runner: ModelRunner,
    chunk: int | None,
) -> None:
    same = prefix = total = 0
    for f, q in zip(alone["none"], alone[quant], strict=True):
        same += sum(a == b for a, b in zip(f, q, strict=True))
        first = next((i for i, (a, b) in enumerate(zip(f, q, strict=True)) if a != b), len(f))
        prefix += first
        total += len(f)
    identical = sum(f == q for f, q in zip(alone["none"], alone[quant], strict=True))
    forced = 0
    for p, f in zip(prompts, alone["none"], strict=True):
        logits = runner.prompt_logits(p + f[:-1], chunk)[len(p) - 1 :]
        forced += sum(int(a) == b for a, b in zip(logits.argmax(-1).tolist(), f, strict=True))
    print(
        f"{quant} vs float32 over {len(prompts)} prompts x {STEPS} greedy tokens: teacher-forced "
        f"top-1 agreement {forced / total:.1%}; free-running {prefix / total:.1%} of positions "
        f"before the first divergence ({same / total:.1%} equal anywhere), "
        f"{identical}/{len(prompts)} sequences identical"
    )


if __name__ == "__main__":
    main()
