"""The int8 and 4-bit linear layers (furnace_trio.runtime.quant) and both runtimes on the default model.

Tolerances: int8 weights (per output channel) times activations split into two 7-bit
passes (about 14 bits, per row) stay well within the asserted 3% relative error. Batch invariance is
claimed bitwise for the layer (per-row scales, exact int32 accumulation), so it is tested
with ``torch.equal``. Quality on the real model: int8 and q4 perplexity within 2% of
float32's on the fixed text in ``tests/data/perplexity.txt``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from furnace_trio.loading.loader import LoadedModel
from furnace_trio.runtime.layers import Linear
from furnace_trio.runtime.quant import (
    QUANTIZATIONS,
    Int8Linear,
    NativeInt8Linear,
    NativeLinear,
    NativeQ4Linear,
    NativeQ8Linear,
    dequantize_q4,
    dequantize_q8,
    quantize_linears,
    quantize_q4,
    quantize_q8,
    quantize_weight,
    resolve_quantization,
)
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig
from furnace_trio.server import config_values as config

DATA = Path(__file__).parent.parent / "data" / "perplexity.txt"
REL_TOL = 0.03


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_quantize_weight_round_trip() -> None:
    w = torch.randn(64, 96)
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8
    assert int(q.abs().max()) <= 127
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-6


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_int8_linear_close_to_float(rows: int) -> None:
    torch.manual_seed(rows)
    w = torch.randn(300, 200) * 0.05
    b = torch.randn(300)
    x = torch.randn(rows, 200)
    layer = Int8Linear(w, b)
    assert _rel_err(layer(x), F.linear(x, w, b)) < REL_TOL
    x3 = x.reshape(1, rows, 200)
    assert layer(x3).shape == (1, rows, 300)


def test_int8_linear_zero_row_gives_bias() -> None:
    w = torch.randn(8, 16)
    b = torch.randn(8)
    out = Int8Linear(w, b)(torch.zeros(2, 16))
    torch.testing.assert_close(out, b.expand(2, 8))


def test_int8_linear_rows_are_batch_invariant() -> None:
    """A row's output is bitwise the same alone and next to any neighbours."""
    torch.manual_seed(0)
    w = torch.randn(1000, 576) * 0.05
    layer = Int8Linear(w)
    x = torch.randn(1, 576)
    alone = layer(x)
    for neighbours in (1, 3, 15, 31):
        others = torch.randn(neighbours, 576) * torch.logspace(-3, 3, neighbours)[:, None]
        batch = torch.cat([others[: neighbours // 2], x, others[neighbours // 2 :]])
        got = layer(batch)[neighbours // 2]
        assert torch.equal(got, alone[0])


def test_resolve_quantization() -> None:
    assert resolve_quantization("none", torch.device("cpu")) == "none"
    assert resolve_quantization("int8", torch.device("cpu")) == "int8"
    assert resolve_quantization("q4", torch.device("cpu")) == "q4"
    assert resolve_quantization("auto", torch.device("cpu")) == "auto"
    assert resolve_quantization("auto", torch.device("cuda")) == "none"
    with pytest.raises(ValueError, match="unsupported quantization"):
        resolve_quantization("int4", torch.device("cpu"))
    # the server's settings (which do not import torch) accept the same names
    assert config.QUANTIZATIONS == QUANTIZATIONS


def test_quantize_q4_round_trip() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    q, d, m = quantize_q4(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert d.dtype == m.dtype == torch.float16 and d.shape == m.shape == (40, 3)
    back = dequantize_q4(q, d, m)
    step = d.float().repeat_interleave(32, dim=1)
    assert bool(((back - w).abs() <= step / 2 + 1e-3).all())
    # weights already on a 4-bit grid (what a Q4_1 file holds) come back exactly
    assert torch.equal(dequantize_q4(*quantize_q4(back)), back)


def test_quantize_q8_round_trip() -> None:
    torch.manual_seed(1)
    w = torch.randn(40, 96)
    q, d = quantize_q8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert d.dtype == torch.float16 and d.shape == (40, 3)
    back = dequantize_q8(q, d)
    step = d.float().repeat_interleave(32, dim=1)
    assert bool(((back - w).abs() <= step / 2 + 1e-3).all())
    assert torch.equal(dequantize_q8(*quantize_q8(back)), back)  # a Q8_0 file's: exact


def _layers() -> torch.nn.Module:
    torch.manual_seed(2)
    grid = dequantize_q4(*quantize_q4(torch.randn(48, 64)))
    module = torch.nn.Module()
    module.on_grid = Linear(grid.clone(), None)
    module.off_grid = Linear(torch.randn(48, 64), torch.randn(48))
    module.ragged = Linear(torch.randn(48, 40), None)  # 40 inputs: not whole groups of 32
    module.lm_head = Linear(torch.randn(100, 64), None)
    return module


def test_quantize_linears_picks_formats() -> None:
    from furnace_trio.runtime import native

    kernels = native.load()
    assert kernels is not None
    kinds = {}
    for four_bit in ("never", "lossless", "always"):
        module = _layers()
        counts = quantize_linears(module, Linear, kernels, four_bit)
        kinds[four_bit] = {n: type(c).__name__ for n, c in module.named_children()}
        assert sum(counts.values()) == 4
    assert set(kinds["never"].values()) == {NativeInt8Linear.__name__}
    assert kinds["lossless"] == {
        "on_grid": NativeQ4Linear.__name__,
        "off_grid": NativeInt8Linear.__name__,
        "ragged": NativeInt8Linear.__name__,
        "lm_head": NativeInt8Linear.__name__,
    }
    # always: every layer with whole groups in 4 bits, but the LM head gets Q8_0
    assert kinds["always"]["off_grid"] == NativeQ4Linear.__name__
    assert kinds["always"]["lm_head"] == NativeQ8Linear.__name__
    assert kinds["always"]["ragged"] == NativeInt8Linear.__name__
    # lossless also finds weights on a Q8_0 grid
    module = _layers()
    module.q8_grid = Linear(dequantize_q8(*quantize_q8(torch.randn(48, 64))), None)
    assert quantize_linears(module, Linear, kernels, "lossless") == {"q4": 1, "q8": 1, "int8": 3}
    assert isinstance(module.q8_grid, NativeQ8Linear)
    # without kernels: the fbgemm int8 layer whatever is asked
    module = _layers()
    assert quantize_linears(module, Linear, None, "always") == {"q4": 0, "q8": 0, "int8": 4}
    assert all(isinstance(c, Int8Linear) for c in module.children())


def test_q4_without_native_kernels_falls_back_to_int8(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    settings = RunnerConfig(device="cpu", kv_cache_bytes=16 << 20, quantization="q4", native=False)
    with caplog.at_level(logging.WARNING, logger="furnace_trio.runtime.runner"):
        runner = ModelRunner.from_loaded(loaded, settings)
    assert runner.quantization == "int8"
    assert isinstance(runner.model.lm_head, Int8Linear)
    assert "need the native kernels" in caplog.text


def test_auto_keeps_the_default_models_4_bit_weights(loaded: LoadedModel) -> None:
    """The default GGUF stores every layer's linears in Q4_1 and the embedding (the tied LM
    head) in Q8_0: ``auto`` runs all of them as the file's own weights (lossless)."""
    runner = ModelRunner.from_loaded(
        loaded, RunnerConfig(device="cpu", kv_cache_bytes=16 << 20, quantization="auto")
    )
    assert runner.quantization == "q4"
    linears = [
        m
        for name, m in runner.model.named_modules()
        if "layers." in name and hasattr(m, "counts_as")
    ]
    assert linears and {m.counts_as for m in linears} == {"q4"}
    assert not any(isinstance(m, NativeInt8Linear) for m in linears)
    assert isinstance(runner.model.lm_head, NativeLinear)
    assert runner.model.lm_head.counts_as == "q8"
    assert runner.cache.k.dtype == torch.float16


def _perplexity(runner: ModelRunner, ids: list[int]) -> float:
    logits = runner.prompt_logits(ids)
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(float(nll))


def test_quantized_perplexity_within_two_percent(loaded: LoadedModel) -> None:
    ids = loaded.tokenizer.encode(DATA.read_text(), add_special_tokens=False)
    assert len(ids) > 400
    ppl = {}
    for quant in ("none", "int8", "q4"):
        runner = ModelRunner.from_loaded(
            loaded, RunnerConfig(device="cpu", kv_cache_bytes=64 << 20, quantization=quant)
        )
        assert runner.quantization == quant
        ppl[quant] = _perplexity(runner, ids)
    assert ppl["none"] < 30  # the float reference itself is sane on plain English
    assert abs(ppl["int8"] - ppl["none"]) / ppl["none"] < 0.02, ppl
    assert abs(ppl["q4"] - ppl["none"]) / ppl["none"] < 0.02, ppl
