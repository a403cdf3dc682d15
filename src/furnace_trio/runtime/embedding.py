"""The token embedding: a float table, or a GGUF's quantized rows dequantized at lookup.

A quantized ``token_embd`` (Q8_0, Q4_K, Q6_K in real files) kept as float32 is the largest
tensor of a small model (49,152 x 2,048 x 4 bytes = 384 MiB for a Llama-3.2-1B shape); a
step only needs the rows of its own tokens. :class:`BlockEmbedding` keeps the file's
blocks (uint8 rows, a quarter to a half of float32's bytes) and dequantizes the gathered
rows with ``gguf.quants.dequantize``, the same function that would have built the float
table, so every row is bitwise what the table would hold.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BlockEmbedding", "Embedding", "TableEmbedding"]


class Embedding(nn.Module):
    """Token ids ``[T]`` (int64) -> a fresh ``[T, hidden]`` tensor of their rows."""

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        raise NotImplementedError


class TableEmbedding(Embedding):
    """A float table ``[vocab, hidden]`` (``weight``), looked up by ``F.embedding``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class BlockEmbedding(Embedding):
    """A GGUF table's quantized rows (``blocks``: uint8 ``[vocab, row_bytes]``, CPU),
    dequantized to float32 for the ids of each lookup."""

    def __init__(self, blocks: np.ndarray, ggml_type: gguf.GGMLQuantizationType, hidden: int):
        super().__init__()
        self.blocks = torch.from_numpy(np.ascontiguousarray(blocks))
        self.ggml_type = ggml_type
        self.hidden = hidden

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids).numpy()
        values = gguf.quants.dequantize(rows, self.ggml_type)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(
            -1, self.hidden
        )

    def extra_repr(self) -> str:
        vocab = self.blocks.shape[0]
        return f"{vocab}, {self.hidden}, {self.ggml_type.name} blocks"
