"""Streaming loads: the model built tensor by tensor from the file's records.

The reference is the model built from every weight dequantized to float32 first (a dict of
float tensors, what the loaders returned before they streamed): the same logits, bitwise,
for GGUF files in F32, F16, Q8_0 and Q4_1 and Hugging Face directories in float32 and
bfloat16, on the float and the quantized (``auto``) runtimes. Then what the build hands
``linear_from_blocks`` (the file's blocks, un-permuted, fused by row), what the runtime
keeps (no float32 copy of a quantized weight), a resident-memory bound, and the progress
log.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from furnace_trio.core.plan import ChunkPlan, StepPlan
from furnace_trio.loading.gguf_loader import load_gguf
from furnace_trio.loading.hf_loader import load_hf_directory
from furnace_trio.loading.tensors import LazyWeights
from furnace_trio.runtime import build as build_module
from furnace_trio.runtime.build import runtime_weight_bytes
from furnace_trio.runtime.embedding import BlockEmbedding, TableEmbedding
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig

from .._model_fixtures import (
    llama_cpp_permute,
    tiny_hf_config,
    write_gguf,
    write_random_gguf,
    write_tiny_gguf,
)

Q = gguf.GGMLQuantizationType
BLOCK = 4


def _runner(weights: Any, config: Any, quantization: str, kv_dtype: str = "auto") -> ModelRunner:
    settings = RunnerConfig(
        device="cpu",
        kv_cache_bytes=1 << 22,
        block_size=BLOCK,
        quantization=quantization,
        kv_dtype=kv_dtype,
    )
    return ModelRunner(config, weights, settings)


def _logits(runner: ModelRunner) -> torch.Tensor:
    """A 13-token prefill, then three decode steps: every row's logits."""
    vocab = runner.config.vocab_size
    ids = torch.randint(0, vocab, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    table = tuple(range(8))
    rows = [runner.logits(StepPlan((ChunkPlan(1, tuple(ids[:13]), 0, table),)))]
    for pos in range(13, 16):
        rows.append(runner.logits(StepPlan((ChunkPlan(1, (ids[pos],), pos, table),))))
    return torch.cat(rows)


def _assert_streaming_equals_float_dict(config: Any, weights: LazyWeights) -> None:
    floats = dict(weights)  # every weight dequantized first
    for quantization in ("none", "auto"):
        streamed = _logits(_runner(weights, config, quantization))
        reference = _logits(_runner(floats, config, quantization))
        torch.testing.assert_close(streamed, reference, rtol=0, atol=0, msg=quantization)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False)])
def test_gguf_streaming_load_gives_todays_logits(
    tmp_path: Path, arch: str, tied: bool, qtype: Q
) -> None:
    path = write_tiny_gguf(tmp_path, arch, tied=tied, qtype=qtype)
    config, weights = load_gguf(path)
    assert weights.records["model.layers.0.mlp.up_proj.weight"].ggml_type == qtype
    _assert_streaming_equals_float_dict(config, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hf_streaming_load_gives_todays_logits(tmp_path: Path, dtype: torch.dtype) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("qwen2", tied=False))
    directory = tmp_path / "tiny"
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
    config, weights = load_hf_directory(directory)
    record = weights.records["model.layers.1.self_attn.q_proj.weight"]
    assert record.ggml_type == (Q.BF16 if dtype == torch.bfloat16 else Q.F32)
    for name, tensor in model.state_dict().items():  # values as safetensors stores them
        torch.testing.assert_close(weights[name], tensor.float(), rtol=0, atol=0, msg=name)
    _assert_streaming_equals_float_dict(config, weights)


def test_llama_qk_permutation_is_undone_on_quantized_rows(tmp_path: Path) -> None:
    """The file holds the quantized permuted rows; a record's blocks are the quantized
    Hugging Face rows (quantization is per row, so the two commute)."""
    import transformers

    hf_config = tiny_hf_config("llama", tied=False)
    torch.manual_seed(0)
    state = transformers.AutoModelForCausalLM.from_config(hf_config).state_dict()
    path = write_gguf(tmp_path / "q8.gguf", hf_config, state, qtype=Q.Q8_0)
    _, weights = load_gguf(path)
    for proj, heads in (("q_proj", 4), ("k_proj", 2)):
        name = f"model.layers.1.self_attn.{proj}.weight"
        hf = state[name].float().numpy()
        record = weights.records[name]
        assert record.n_head == heads
        np.testing.assert_array_equal(record.blocks(), gguf.quants.quantize(hf, Q.Q8_0))
        stored = gguf.quants.quantize(llama_cpp_permute(state[name].float(), heads).numpy(), Q.Q8_0)
        assert not np.array_equal(record.blocks(), stored)  # the permutation did something
        expected = gguf.quants.dequantize(gguf.quants.quantize(hf, Q.Q8_0), Q.Q8_0)
        np.testing.assert_array_equal(record.float().numpy(), expected)


class _Blocks(nn.Module):
    """What a native kernel would make of the blocks (here: y = x @ W.T from a copy)."""

    counts_as = "spy"

    def __init__(self, blocks: np.ndarray, qtype: Q, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = torch.from_numpy(gguf.quants.dequantize(np.array(blocks), qtype))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


def test_every_quantized_linear_goes_to_linear_from_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``auto``, each fused linear's file blocks (un-permuted, stacked by row), type,
    shape and bias reach ``linear_from_blocks``, and its module is what the model runs; a
    tied head gets the embedding's blocks."""
    calls: list[tuple[np.ndarray, int, tuple[int, int], torch.Tensor | None]] = []

    def spy(
        blocks: np.ndarray, qtype: int, shape: tuple[int, int], bias: Any, kernels: Any
    ) -> nn.Module:
        calls.append((np.array(blocks), qtype, shape, bias))
        return _Blocks(blocks, Q(qtype), bias)

    monkeypatch.setattr(build_module, "linear_from_blocks", spy)
    path = write_tiny_gguf(tmp_path, "llama", tied=True, qtype=Q.Q8_0)
    config, weights = load_gguf(path)
    runner = _runner(weights, config, "auto", kv_dtype="model")
    assert len(calls) == 4 * config.num_layers + 1
    by_shape = {(c[2], i) for i, c in enumerate(calls)}
    assert ((config.vocab_size, config.hidden_size), 0) in by_shape  # the head, first
    head_blocks = calls[0][0]
    np.testing.assert_array_equal(
        head_blocks, weights.records["model.embed_tokens.weight"].blocks()
    )
    qkv_names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    qkv = np.concatenate([weights.records[n].blocks() for n in qkv_names])
    assert any(np.array_equal(c[0], qkv) and c[1] == Q.Q8_0 for c in calls)
    assert all(c[3] is None for c in calls)  # llama has no biases
    model = runner.model
    assert isinstance(model.lm_head, _Blocks)
    assert isinstance(model.layers[0].mlp.gate_up_proj, _Blocks)
    assert isinstance(model.embed_tokens, BlockEmbedding)
    # The float reference's logits (the spy's layers are float32 on the same values; the
    # native kernels' sums differ from torch's in order only).
    reference = _logits(_runner(dict(weights), config, "none"))
    torch.testing.assert_close(_logits(runner), reference, rtol=1e-4, atol=1e-4)


def test_mixed_types_in_a_fused_linear_are_dequantized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k in one type and v in one that no native kernel takes (Q5_1): that fused linear
    is built from float (the same layer as from a float dict), the others go to
    ``linear_from_blocks`` (mixes of native types: ``test_concat_linear.py``)."""
    path = tmp_path / "mixed.gguf"
    write_random_gguf(
        path,
        layers=2,
        hidden=64,
        ff=96,
        vocab=320,
        qtype_of=lambda n: Q.Q5_1 if n == "blk.0.attn_v.weight" else Q.Q8_0,
    )
    config, weights = load_gguf(path)
    seen: list[tuple[int, int]] = []

    def spy(
        blocks: np.ndarray, qtype: int, shape: tuple[int, int], bias: Any, kernels: Any
    ) -> None:
        seen.append(shape)

    monkeypatch.setattr(build_module, "linear_from_blocks", spy)
    _runner(weights, config, "auto")
    fused = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    assert seen.count((fused, config.hidden_size)) == config.num_layers - 1
    assert len(seen) == 4 * config.num_layers  # the rest, and the tied head
    _assert_streaming_equals_float_dict(config, weights)


def test_no_float32_copy_of_a_quantized_weight_survives(tmp_path: Path) -> None:
    """After an ``auto`` build of a Q8_0 file the runtime holds no 2-D float32 tensor (the
    embedding in blocks, every linear packed), and about the file's bytes."""
    path = write_tiny_gguf(tmp_path, "llama", tied=True, qtype=Q.Q8_0)
    config, weights = load_gguf(path)
    model = _runner(weights, config, "auto").model
    for name, module in model.named_modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            assert not (tensor.dtype == torch.float32 and tensor.dim() >= 2), name
    assert isinstance(model.embed_tokens, BlockEmbedding)
    # The float runtime keeps a float table (and shares it with the tied head).
    float_model = _runner(weights, config, "none").model
    assert isinstance(float_model.embed_tokens, TableEmbedding)
    assert float_model.lm_head.weight.data_ptr() == float_model.embed_tokens.weight.data_ptr()
    assert runtime_weight_bytes(model) < 1.3 * weights.n_bytes + (1 << 20)


_PEAK_SCRIPT = """
import json, sys
from furnace_trio.loading.gguf_loader import load_gguf
from furnace_trio.runtime import native
from furnace_trio.runtime.build import runtime_weight_bytes
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10

native.load()
before = status("VmRSS")
config, weights = load_gguf(sys.argv[1])
settings = RunnerConfig(device="cpu", kv_cache_bytes=1 << 20, quantization="auto")
runner = ModelRunner(config, weights, settings)
added = status("VmHWM") - before
print(json.dumps({"added": added, "runtime": runtime_weight_bytes(runner.model)}))
"""


def test_peak_resident_memory_of_a_load(tmp_path: Path) -> None:
    """In a fresh process, what loading a deep Q8_0 GGUF (24 layers, 24 MB of blocks, 92 MB
    as float32) adds to resident memory at its
    peak is the runtime weights plus about one weight in conversion, far below the model
    in float32 (what holding every weight dequantized at once needed)."""
    path = tmp_path / "deep.Q8_0.gguf"
    float_bytes = write_random_gguf(path, layers=24, hidden=256, ff=1024, vocab=2048)
    script = textwrap.dedent(_PEAK_SCRIPT)
    src = str(Path(__file__).resolve().parents[2] / "src")
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": src},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["runtime"] < 0.35 * float_bytes
    # Measured: 57 MB added (26 MB runtime); 151 MB with every weight dequantized first.
    assert result["added"] < result["runtime"] + 0.5 * float_bytes, result


def test_load_progress_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_tiny_gguf(tmp_path, "llama", tied=True, qtype=Q.Q8_0)
    config, weights = load_gguf(path)
    with caplog.at_level(logging.INFO):
        _runner(weights, config, "auto")
    lines = [r.getMessage() for r in caplog.records if "building the model" in r.getMessage()]
    assert len(lines) >= 5
    assert lines[-1].startswith(f"building the model: {len(weights)}/{len(weights)} tensors")
    assert any("linear layers quantized" in r.getMessage() for r in caplog.records)
