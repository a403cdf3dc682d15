"""What the runtime's model tests share: a runner over a tiny model written to disk, and
the transformers model of the same files as the reference."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from furnace_trio.core.plan import ChunkPlan, StepPlan
from furnace_trio.loading.hf_loader import load_hf_directory
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig

BLOCK = 4
TOL = 2e-5

ARCHS = [
    ("llama", False, False),
    ("llama", True, True),
    ("mistral", False, False),
    ("qwen2", True, False),
    ("qwen2", False, False),
    ("qwen3", True, False),
    ("qwen3", False, False),
    ("gemma3", True, False),
    ("gemma3", False, True),  # linear rope scaling on the global layer
]


def make_runner(
    path: Path,
    *,
    native: bool = True,
    quantization: str = "none",
    kv_dtype: str = "auto",
    split_chunks_upto: int | None = None,
) -> ModelRunner:
    config, weights = load_hf_directory(path)
    settings = RunnerConfig(
        device="cpu",
        kv_cache_bytes=1 << 22,
        block_size=BLOCK,
        native=native,
        quantization=quantization,
        kv_dtype=kv_dtype,
        split_chunks_upto=split_chunks_upto,
    )
    return ModelRunner(config, weights, settings)


def reference_model(path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return model.eval()


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def block_table(first: int, n: int = 16) -> tuple[int, ...]:
    return tuple(range(first, first + n))


def ragged_decode(vocab: int) -> tuple[list[list[int]], StepPlan, StepPlan]:
    """Three sequences of 6, 13 and 2 tokens: a prefill step of all but each one's last
    token, and the decode step of those last tokens (ragged contexts)."""
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 13, 2)]
    tables = [block_table(16 * i) for i in range(len(seqs))]
    prompts = StepPlan(tuple(ChunkPlan(i, tuple(s[:-1]), 0, tables[i]) for i, s in enumerate(seqs)))
    decodes = StepPlan(
        tuple(ChunkPlan(i, (s[-1],), len(s) - 1, tables[i]) for i, s in enumerate(seqs))
    )
    return seqs, prompts, decodes
