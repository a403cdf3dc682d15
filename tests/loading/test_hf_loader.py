"""hf_loader: tiny random transformers checkpoints of each architecture round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from furnace_trio.loading.hf_loader import load_hf_directory
from furnace_trio.loading.model_config import RopeScaling, UnsupportedModelError

from .._model_fixtures import write_tiny_model

CASES = [
    ("llama", False, False),
    ("llama", True, False),
    ("llama", False, True),
    ("mistral", False, False),
    ("qwen2", True, False),
    ("qwen2", False, False),
    ("qwen3", True, False),
    ("qwen3", False, False),
]


def _saved_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(file))
    return state


@pytest.mark.parametrize(("arch", "tied", "rope_llama3"), CASES)
def test_tiny_model_config_and_weights(
    tmp_path: Path, arch: str, tied: bool, rope_llama3: bool
) -> None:
    directory = write_tiny_model(tmp_path, arch, tied=tied, rope_llama3=rope_llama3)
    config, weights = load_hf_directory(directory)

    assert config.architecture == arch
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (320, 64, 96)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 4, 2)
    assert config.head_dim == (24 if arch == "qwen3" else 16)
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.max_position_embeddings == 256
    assert config.tie_word_embeddings is tied
    assert config.attention_bias is (arch == "qwen2")
    assert config.qk_norm is (arch == "qwen3")
    if rope_llama3:
        assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
        assert config.rope_theta == 500000.0
    else:
        assert config.rope_scaling is None

    saved = _saved_state_dict(directory)
    assert set(weights) == set(saved) - ({"lm_head.weight"} if tied else set())
    assert ("lm_head.weight" in weights) is not tied
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, saved[name].float(), rtol=0, atol=0, msg=name)
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in weights
    if arch == "qwen3":
        assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (24,)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    directory = write_tiny_model(tmp_path, "llama", tied=False, sharded=True)
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("*.safetensors"))) > 1
    single = write_tiny_model(tmp_path / "single", "llama", tied=False)
    config, weights = load_hf_directory(directory)
    single_config, single_weights = load_hf_directory(single)
    assert config == single_config
    assert weights.keys() == single_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, single_weights[name], rtol=0, atol=0)


def test_transformers_4_config_keys(tmp_path: Path) -> None:
    """Older configs: ``rope_theta`` at top level, ``rope_scaling`` with ``type``."""
    directory = write_tiny_model(tmp_path, "llama", tied=True)
    raw = json.loads((directory / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 500000.0
    raw["rope_scaling"] = {
        "type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    (directory / "config.json").write_text(json.dumps(raw))
    config, _ = load_hf_directory(directory)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)


def test_unsupported_architecture(tmp_path: Path) -> None:
    directory = write_tiny_model(tmp_path, "llama", tied=True)
    raw = json.loads((directory / "config.json").read_text())
    raw["model_type"] = "gpt2"
    raw["architectures"] = ["GPT2LMHeadModel"]
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_hf_directory(directory)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_hf_directory(tmp_path)


def test_missing_safetensors(tmp_path: Path) -> None:
    directory = write_tiny_model(tmp_path, "qwen2", tied=True)
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_hf_directory(directory)


def test_missing_shard(tmp_path: Path) -> None:
    directory = write_tiny_model(tmp_path, "llama", tied=False, sharded=True)
    shard = sorted(directory.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_hf_directory(directory)


def test_tiny_model_loads_in_transformers(tmp_path: Path) -> None:
    """The fixture is usable as a reference: transformers loads model and tokenizer offline."""
    import transformers

    directory = write_tiny_model(tmp_path, "qwen3", tied=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids and max(ids) < 320
    _, weights = load_hf_directory(directory)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(weights[name], tensor.float(), rtol=0, atol=0)
