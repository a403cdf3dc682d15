"""The KV cache's dtypes: which one a runtime takes, and the int8 cache (a byte per value and
a float32 scale per token and KV head) against the float one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furnace_trio.core.plan import ChunkPlan, StepPlan
from furnace_trio.loading.hf_loader import load_hf_directory
from furnace_trio.runtime.native import quantize_kv_rows
from furnace_trio.runtime.runner import KV_DTYPES, ModelRunner, RunnerConfig
from furnace_trio.server import config_values as server_config

from .._model_fixtures import write_tiny_model
from .model_helpers import (
    block_table,
    make_runner,
    ragged_decode,
    reference_logits,
    reference_model,
)


def test_kv_dtype_follows_the_runtime(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "llama", tied=False, rope_llama3=False)
    assert make_runner(path).cache.k.dtype == torch.float32  # float reference: float32 KV
    assert make_runner(path, native=False, quantization="int8").cache.k.dtype == torch.float32
    config, weights = load_hf_directory(path)
    settings = RunnerConfig(
        device="cpu", kv_cache_bytes=1 << 22, quantization="int8", kv_dtype="model"
    )
    assert ModelRunner(config, weights, settings).cache.k.dtype == torch.float32
    # float16 on request, for the float runtime too (native and torch paths): decodes that
    # read it stay close to a float32 cache's
    _, prompts, decodes = ragged_decode(config.vocab_size)
    for native in (True, False):
        half, full = (
            make_runner(path, native=native, kv_dtype="float16"),
            make_runner(path, native=native),
        )
        assert half.cache.k.dtype == torch.float16 and half.quantization == "none"
        assert full.cache.k.dtype == torch.float32
        half.logits(prompts)
        full.logits(prompts)
        got, want = half.logits(decodes), full.logits(decodes)
        assert not torch.equal(got, want)
        assert float((got - want).norm() / want.norm()) < 1e-3
    with pytest.raises(ValueError, match="kv_dtype"):
        ModelRunner(config, weights, RunnerConfig(device="cpu", kv_dtype="int4"))
    # the server's settings (which do not import torch) accept the same names
    assert server_config.KV_CACHE_DTYPES == KV_DTYPES


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_kv_cache(tmp_path: Path, arch: str) -> None:
    """``kv_dtype="int8"``: keys and values stored as int8 with a scale per token and KV
    head. The fused decode equals the per-op path bitwise, the torch path (no native
    kernels) stores the same bytes and stays close, and all of them stay close to a
    float16 cache; about 1.9 times the blocks of a float16 cache in the same bytes."""
    path = write_tiny_model(tmp_path, arch, tied=False, rope_llama3=False)
    runner = make_runner(path, quantization="int8", kv_dtype="int8")
    half = make_runner(path, quantization="int8")
    torch_path = make_runner(path, native=False, quantization="int8", kv_dtype="int8")
    assert runner.cache.k.dtype == torch.int8 and runner.cache.scales is not None
    assert torch_path.cache.k.dtype == torch.int8 and torch_path.model.kernels is None
    assert half.cache.k.dtype == torch.float16
    assert runner.cache.num_blocks / half.cache.num_blocks == pytest.approx(
        2 * runner.config.head_dim / (runner.config.head_dim + 4), rel=0.01
    )
    _, prompts, decodes = ragged_decode(runner.config.vocab_size)
    for r in (runner, half, torch_path):
        r.logits(prompts)
    assert runner.model._decode_layer_ptrs(runner.cache, runner.model.kernels) is not None
    fused = runner.logits(decodes)
    runner.model.fused_decode = False
    assert torch.equal(fused, runner.logits(decodes))
    want = half.logits(decodes)
    assert float((fused - want).norm() / want.norm()) < 0.02
    got = torch_path.logits(decodes)
    assert float((got - fused).norm() / fused.norm()) < 0.005
    assert bool((fused.argmax(-1) == want.argmax(-1)).all())


def test_layer_kv_int8_store_and_gather(tmp_path: Path) -> None:
    """The torch path's int8 store writes native.quantize_kv_rows' bytes and scales (the
    native store's, see test_native.test_rope_store); gather gives back ``q * scale``."""
    path = write_tiny_model(tmp_path, "llama", tied=False, rope_llama3=False)
    layer = make_runner(path, native=False, kv_dtype="int8").cache.layers[1]
    assert layer.scales is not None
    _, _, kv_heads, dim = layer.k.shape
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 5, kv_heads, dim, generator=gen) * 3
    slots = torch.tensor([4, 5, 6, 7, 13])  # blocks 1 and 3
    layer.store(slots, k, v)
    keys, values = layer.gather(torch.tensor([1, 3]), torch.float32)
    keys, values = keys.flatten(0, 1)[[0, 1, 2, 3, 5]], values.flatten(0, 1)[[0, 1, 2, 3, 5]]
    for got, x, cache, scale in (
        (keys, k, layer.k, layer.scales[0]),
        (values, v, layer.v, layer.scales[1]),
    ):
        q, s = quantize_kv_rows(x)
        assert torch.equal(cache.flatten(0, 1)[slots], q)
        assert torch.equal(scale.flatten(0, 1)[slots], s)
        torch.testing.assert_close(got, q.float() * s[..., None])
        assert float((got - x).abs().max()) <= float(s.max()) / 2 + 1e-6


def test_int8_kv_block_copies_carry_the_scales(tmp_path: Path) -> None:
    """A copied block (copy-on-write after a fork) takes its int8 values and their scales."""
    path = write_tiny_model(tmp_path, "llama", tied=False, rope_llama3=False)
    runner = make_runner(path, quantization="int8", kv_dtype="int8")
    runner.logits(StepPlan((ChunkPlan(1, tuple(range(1, 9)), 0, block_table(0)),)))
    cache = runner.cache
    assert cache.scales is not None
    cache.copy_blocks(((0, 40), (1, 41)))
    for src, dst in ((0, 40), (1, 41)):
        for tensor in (cache.k, cache.v, *cache.scales):
            assert torch.equal(tensor[:, dst], tensor[:, src])
    assert bool(cache.scales[0][:, 0].ne(0).all())  # the copied scales are real ones


@pytest.mark.parametrize("split", [0, None], ids=["chunk-path", "short-chunks-as-rows"])
@pytest.mark.parametrize(
    ("kv_dtype", "cache_dtype", "tol"), [("auto", torch.float16, 1e-2), ("int8", torch.int8, 2e-2)]
)
def test_int8_chunked_prefill_over_the_cache(
    tmp_path: Path, kv_dtype: str, cache_dtype: torch.dtype, tol: float, split: int | None
) -> None:
    """Chunks after cached tokens read the float16 KV, or the int8 one dequantized: through
    the torch attention path over the gathered cache (``split`` 0), or (the default with
    the native kernels) as rows of the decode path."""
    path = write_tiny_model(tmp_path, "qwen2", tied=False, rope_llama3=False)
    runner = make_runner(path, quantization="int8", kv_dtype=kv_dtype, split_chunks_upto=split)
    assert runner.cache.k.dtype == cache_dtype
    ids = torch.randint(
        0, runner.config.vocab_size, (30,), generator=torch.Generator().manual_seed(6)
    )
    ids_t = tuple(ids.tolist())
    whole = runner.logits(StepPlan((ChunkPlan(1, ids_t, 0, block_table(0)),)))[0]
    pos = 0
    for size in (7, 1, 9, 13):
        got = runner.logits(
            StepPlan((ChunkPlan(2, ids_t[pos : pos + size], pos, block_table(16)),))
        )
        pos += size
    assert float((got[0] - whole).norm() / whole.norm()) < tol
    ref = reference_logits(reference_model(path), list(ids_t))[-1]
    assert float((got[0] - ref).norm() / ref.norm()) < 0.02
