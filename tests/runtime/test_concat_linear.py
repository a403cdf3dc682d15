"""Fused projections whose parts a file stores in different block types (llama.cpp's
mixes: Q4_K_M keeps ``attn_v`` in Q6_K beside Q4_K queries and keys) run natively from
their blocks as a :class:`~furnace_trio.runtime.blocks.ConcatLinear`, in the per-op path
and in ``furnace_decode_layers`` alike."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from furnace_trio.core.plan import ChunkPlan, StepPlan
from furnace_trio.loading.gguf_loader import load_gguf
from furnace_trio.runtime import native
from furnace_trio.runtime.blocks import ConcatLinear, linear_from_blocks
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig

from .._model_fixtures import write_random_gguf
from .test_blocks import random_blocks

Q = gguf.GGMLQuantizationType


def test_parts_compute_what_they_compute_alone() -> None:
    """Each part's columns are bitwise its own layer's output, a row alone or in a batch."""
    kernels = native.load()
    assert kernels is not None
    rng = np.random.default_rng(3)
    k = 512
    shapes = ((Q.Q4_K, 256), (Q.Q6_K, 64), (Q.Q8_0, 96))
    parts = []
    for ggml_type, n in shapes:
        layer = linear_from_blocks(
            random_blocks(ggml_type, n, k, rng, 0.05), ggml_type, (n, k), None, kernels
        )
        assert layer is not None
        parts.append(layer)
    concat = ConcatLinear(parts, kernels)
    x = torch.randn(7, k)
    got = concat(x)
    assert torch.equal(got, torch.cat([p(x) for p in parts], dim=1))
    assert torch.equal(concat(x[3:4]), got[3:4])


def test_a_mixed_fused_projection_loads_natively_and_decodes_fused(tmp_path: Path) -> None:
    """A GGUF with Q4_0 queries and keys beside Q8_0 values: q/k/v load as one native
    concatenated layer (no int8 re-quantization), the fused all-decode step gives bitwise
    the per-op path's logits, and both stay close to float32 on the dequantized weights."""
    path = tmp_path / "mixed.gguf"

    def qtype_of(name: str) -> Q:
        return Q.Q8_0 if name.endswith("attn_v.weight") else Q.Q4_0

    write_random_gguf(path, layers=2, hidden=128, ff=256, vocab=320, qtype_of=qtype_of)

    def runner(quantization: str) -> ModelRunner:
        config, weights = load_gguf(str(path))
        settings = RunnerConfig(device="cpu", kv_cache_bytes=1 << 22, quantization=quantization)
        return ModelRunner(config, weights, settings)

    quantized, reference = runner("auto"), runner("none")
    qkv = quantized.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ConcatLinear)
    assert [p.counts_as for p in qkv.parts] == ["q4_0", "q4_0", "q8"]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (9, 4)]
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    prefill = StepPlan(
        tuple(ChunkPlan(i, tuple(p[:-1]), 0, tables[i]) for i, p in enumerate(prompts))
    )
    decode = StepPlan(
        tuple(ChunkPlan(i, (p[-1],), len(p) - 1, tables[i]) for i, p in enumerate(prompts))
    )
    for r in (quantized, reference):
        r.logits(prefill)
    kernels = quantized.model.kernels
    assert kernels is not None
    table = quantized.model._decode_layer_ptrs(quantized.cache, kernels)
    assert table is not None and int(table[0]) == native.LINEAR_CONCAT
    fused = quantized.logits(decode)
    quantized.model.fused_decode = False
    assert torch.equal(fused, quantized.logits(decode))
    want = reference.logits(decode)
    assert float((fused - want).norm() / want.norm()) < 0.05
