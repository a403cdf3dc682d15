"""loading.tensors: records read on demand, rows un-permuted as bytes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from furnace_trio.loading.gguf_loader import load_gguf
from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.loading.tensors import MappedFile, unpermute_rows

from .._model_fixtures import llama_cpp_permute, write_tiny_gguf


def test_a_lookup_of_names_reads_no_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path, "llama", tied=False)
    _, weights = load_gguf(path)
    reads: list[int] = []
    original = MappedFile.read
    monkeypatch.setattr(
        MappedFile, "read", lambda self, o, n: reads.append(n) or original(self, o, n)
    )
    assert "lm_head.weight" in weights
    assert "nope" not in weights
    assert len(weights) == len(list(weights)) == len(weights.keys())
    assert reads == []
    assert weights["model.norm.weight"].dtype == torch.float32
    assert reads == [weights.records["model.norm.weight"].n_bytes]


@pytest.mark.parametrize("n_head", [1, 2, 4])
def test_unpermuting_rows_of_bytes_undoes_llama_cpps_permute(n_head: int) -> None:
    weight = torch.randn(n_head * 8, 64)
    stored = llama_cpp_permute(weight, n_head).numpy()
    blocks = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
    rows = unpermute_rows(blocks, n_head)
    expected = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(rows, expected)
    bias = torch.randn(n_head * 8)
    assert torch.equal(
        torch.from_numpy(unpermute_rows(llama_cpp_permute(bias, n_head).numpy(), n_head)), bias
    )


def test_a_read_past_the_end_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(10)))
    file = MappedFile(path)
    assert file.read(2, 3).tolist() == [2, 3, 4]
    with pytest.raises(UnsupportedModelError, match="beyond the end"):
        file.read(8, 4)
