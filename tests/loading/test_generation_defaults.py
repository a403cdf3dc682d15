"""The sampling defaults a model ships: ``generation_config.json``, GGUF
``general.sampling.*``, and the embedded default model's from its model card."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest

from furnace_trio.loading.default_model import DEFAULT_MODEL_GENERATION
from furnace_trio.loading.generation_defaults import (
    GGUF_SAMPLING_KEYS,
    GenerationDefaults,
    from_gguf_metadata,
    read_generation_config,
)
from furnace_trio.loading.gguf_file import read_gguf
from furnace_trio.loading.loader import LoadedModel


def _write(directory: Path, config: object) -> Path:
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_generation_config_json(tmp_path: Path) -> None:
    """Qwen2.5-Instruct's file, as shipped: every sampler this server has is read."""
    qwen = {
        "bos_token_id": 151643,
        "do_sample": True,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "repetition_penalty": 1.05,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "transformers_version": "4.37.0",
    }
    defaults = read_generation_config(_write(tmp_path, qwen))
    assert defaults == GenerationDefaults(
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
        source="generation_config.json",
    )
    assert defaults.as_dict() == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }


def test_a_file_with_token_ids_only_or_none_gives_no_defaults(tmp_path: Path) -> None:
    assert read_generation_config(tmp_path) == GenerationDefaults()
    ids_only = read_generation_config(_write(tmp_path, {"bos_token_id": 1, "eos_token_id": 2}))
    assert ids_only == GenerationDefaults() and ids_only.as_dict() == {}
    assert read_generation_config(_write(tmp_path, [0.7])) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_config(tmp_path) == GenerationDefaults()


def test_invalid_values_are_ignored_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = {"temperature": -1, "top_p": 0, "top_k": 2.5, "min_p": "0.1", "repetition_penalty": True}
    with caplog.at_level(logging.WARNING):
        defaults = read_generation_config(_write(tmp_path, {**bad, "temperature": 3.0}))
    assert defaults.as_dict() == {}
    assert caplog.text.count("ignoring") == 5
    mixed = read_generation_config(_write(tmp_path, {"temperature": 0, "top_k": 0, "min_p": 1}))
    assert mixed.as_dict() == {"temperature": 0.0, "top_k": 0, "min_p": 1.0}


def test_gguf_sampling_keys_match_llama_cpp() -> None:
    """The key names are llama.cpp's own (its gguf package's constants)."""
    keys = gguf.Keys.General
    assert dict(GGUF_SAMPLING_KEYS) == {
        "temperature": keys.SAMPLING_TEMP,
        "top_p": keys.SAMPLING_TOP_P,
        "top_k": keys.SAMPLING_TOP_K,
        "min_p": keys.SAMPLING_MIN_P,
        "repetition_penalty": keys.SAMPLING_PENALTY_REPEAT,
    }


def test_gguf_general_sampling_metadata(tmp_path: Path) -> None:
    """Written by gguf's own writer (as ``convert_hf_to_gguf.py`` does), read back by our
    header parser."""
    path = tmp_path / "sampling.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_sampling_temp(0.6)
    writer.add_sampling_top_p(0.95)
    writer.add_sampling_top_k(40)
    writer.add_sampling_min_p(0.05)
    writer.add_sampling_penalty_repeat(1.1)
    writer.add_sampling_mirostat(2)  # a sampler we do not have: not read
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    defaults = from_gguf_metadata(read_gguf(path).metadata)
    assert defaults.source == "GGUF general.sampling"
    assert defaults.as_dict() == pytest.approx(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}
    )
    assert isinstance(defaults.top_k, int)
    assert from_gguf_metadata({"general.name": "x"}) == GenerationDefaults()


def test_the_default_model_samples_as_its_model_card_says(loaded: LoadedModel) -> None:
    """The embedded GGUF ships no sampling keys; the loader gives it its model card's."""
    assert from_gguf_metadata(read_gguf(loaded.source).metadata) == GenerationDefaults()
    assert loaded.generation is DEFAULT_MODEL_GENERATION
    assert loaded.generation.as_dict() == {"temperature": 0.2, "top_p": 0.9}
