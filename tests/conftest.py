"""Suite-wide pytest hooks."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA; without a GPU they are skipped with that reason."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="gpu: no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)
