"""Loading Phi-3 and mixture-of-experts checkpoints: Hugging Face and GGUF agree.

The GGUFs are written as llama.cpp's converter writes these architectures
(:func:`tests._arch_fixtures.write_arch_gguf`): fused Phi-3 projections, stacked experts,
LongRoPE factor tensors. Both loaders must give the same config and, name by name, the
same weights.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from furnace_trio.loading.gguf_loader import load_gguf
from furnace_trio.loading.hf_loader import load_hf_directory
from furnace_trio.loading.model_config import LongRope, MoE

from .._arch_fixtures import ARCHES, write_arch_gguf, write_arch_model


@pytest.mark.parametrize("name", list(ARCHES))
def test_gguf_and_hugging_face_give_the_same_model(tmp_path: Path, name: str) -> None:
    directory, path = write_arch_gguf(tmp_path, name)
    hf_config, hf_weights = load_hf_directory(directory)
    gguf_config, gguf_weights = load_gguf(path)
    # GGUF metadata and factor tensors are float32: equal to float32's rounding
    assert gguf_config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    if hf_config.longrope is not None:
        assert gguf_config.longrope is not None
        for field in ("short_factor", "long_factor", "attention_factor"):
            got, want = getattr(gguf_config.longrope, field), getattr(hf_config.longrope, field)
            assert got == pytest.approx(want, rel=1e-6)
    same = dataclasses.replace(
        gguf_config, rms_norm_eps=hf_config.rms_norm_eps, longrope=hf_config.longrope
    )
    assert same == hf_config
    assert sorted(gguf_weights) == sorted(hf_weights)
    for weight in hf_weights:
        torch.testing.assert_close(gguf_weights[weight], hf_weights[weight], rtol=0, atol=0)


def test_the_configs_say_what_each_model_does(tmp_path: Path) -> None:
    configs = {
        name: load_hf_directory(write_arch_model(tmp_path, name))[0]
        for name in ("phi3", "phi3-longrope", "phi3-window", "qwen2moe", "qwen3moe", "mixtral")
    }
    assert configs["phi3"].longrope is None and not configs["phi3"].sliding_layers
    assert configs["phi3-window"].sliding_layers == (True, True)
    assert configs["phi3-window"].sliding_window == 6
    assert configs["phi3-longrope"].longrope == LongRope(
        short_factor=(1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0, 2.5),
        long_factor=(1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0),
        original_max_position_embeddings=16,
        attention_factor=2**0.5,  # sqrt(1 + ln(256 / 16) / ln(16))
    )
    assert configs["qwen2moe"].moe == MoE(4, 2, 32, False, 48)
    assert configs["qwen2moe"].attention_bias
    assert configs["qwen3moe"].moe == MoE(6, 2, 32, True, 0, (True, False, True))
    assert configs["qwen3moe"].qk_norm
    assert [configs["qwen3moe"].sparse(i) for i in range(3)] == [True, False, True]
    assert configs["mixtral"].moe == MoE(4, 2, 32, True)


def test_phi3_fused_projections_are_read_as_slices_of_the_file(tmp_path: Path) -> None:
    """q, k and v (and gate, up) are records over their own rows of the fused tensor:
    nothing is copied at load, and each reads exactly its part."""
    directory = write_arch_model(tmp_path, "phi3")
    _, weights = load_hf_directory(directory)
    from safetensors.torch import load_file

    stored = load_file(directory / "model.safetensors")
    qkv = stored["model.layers.1.self_attn.qkv_proj.weight"]
    parts = [weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in ("q", "k", "v")]
    assert [p.shape[0] for p in parts] == [64, 32, 32]
    torch.testing.assert_close(torch.cat(parts), qkv, rtol=0, atol=0)
    gate_up = stored["model.layers.0.mlp.gate_up_proj.weight"]
    gate, up = (
        weights["model.layers.0.mlp.gate_proj.weight"],
        weights["model.layers.0.mlp.up_proj.weight"],
    )
    torch.testing.assert_close(torch.cat((gate, up)), gate_up, rtol=0, atol=0)
    assert "model.layers.0.self_attn.qkv_proj.weight" not in weights


def test_experts_stored_stacked_load_as_experts_stored_one_by_one(tmp_path: Path) -> None:
    """A checkpoint of transformers' in-memory layout (``mlp.experts.gate_up_proj``
    ``[experts, 2 * ff, hidden]`` and ``down_proj``) gives the per-expert weights of the
    usual layout."""
    import transformers

    directory = write_arch_model(tmp_path, "qwen3moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(directory / "config.json", stacked / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, stacked / "model.safetensors")
    config, weights = load_hf_directory(stacked)
    _, reference = load_hf_directory(directory)
    assert sorted(weights) == sorted(reference)
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], rtol=0, atol=0)
    assert json.loads((stacked / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert config.moe is not None
