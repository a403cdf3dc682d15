"""The runtime tests' shared fixture: every tiny architecture, native and torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furnace_trio.runtime.runner import ModelRunner

from .._model_fixtures import write_tiny_model
from .model_helpers import ARCHS, make_runner, reference_model


@pytest.fixture(
    params=[(*a, n) for a in ARCHS for n in (True, False)],
    ids=lambda a: (
        f"{a[0]}-{'tied' if a[1] else 'untied'}"
        f"{('-llama3rope' if a[0] == 'llama' else '-linearrope') if a[2] else ''}"
        f"-{'native' if a[3] else 'torch'}"
    ),
)
def tiny(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[ModelRunner, torch.nn.Module, int]:
    arch, tied, rope3, native = request.param
    path = write_tiny_model(tmp_path, arch, tied=tied, rope_llama3=rope3)
    runner = make_runner(path, native=native)
    assert (runner.model.layers[0].self_attn.kernels is not None) == native
    return runner, reference_model(path), runner.config.vocab_size
