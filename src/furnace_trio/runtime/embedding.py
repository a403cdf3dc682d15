"""The token embedding: a float table, or a GGUF's quantized rows dequantized at lookup.

A quantized ``token_embd`` (Q8_0, Q4_K, Q6_K in real files) kept as float32 is the largest
tensor of a small model (49,152 x 2,048 x 4 bytes = 384 MiB for a Llama-3.2-1B shape); a
step only needs the rows of its own tokens. :class:`BlockEmbedding` keeps the file's
blocks (uint8 rows, a quarter to a half of float32's bytes) and dequantizes the gathered
rows, so every row is bitwise what the float table would hold: Q8_0 and Q4_1 (the
default model's and the common 8-bit case) in torch, with ``gguf.quants.dequantize``'s
float32 operations in its order (a few times a float32 table's lookup, several times
cheaper than ``gguf.quants.dequantize``); every other type through
``gguf.quants.dequantize`` (small beside a step of a model whose table is that large).
docs/history.md has the figures.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BlockEmbedding", "Embedding", "TableEmbedding"]

Q = gguf.GGMLQuantizationType


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
    """A GGUF table's quantized rows (``blocks``: uint8 ``[vocab, row_bytes]``), dequantized
    to float32 for the ids of each lookup (CPU).

    Q8_0 and Q4_1 rows are split once into their codes and float16 scales (and minimums),
    the same bytes as the blocks, so that a lookup is a handful of torch ops; other types
    keep their blocks for ``gguf.quants.dequantize``.
    """

    def __init__(self, blocks: np.ndarray, ggml_type: gguf.GGMLQuantizationType, hidden: int):
        super().__init__()
        self.ggml_type = ggml_type
        self.hidden = hidden
        rows = torch.from_numpy(np.ascontiguousarray(blocks))
        vocab = rows.shape[0]
        self.blocks: torch.Tensor | None = None
        self.codes = self.scales = self.mins = torch.empty(0)
        if ggml_type == Q.Q8_0:  # per block: f16 d, 32 int8 q; w = q * d
            split = rows.view(vocab, -1, 34)
            self.scales = split[..., :2].contiguous().view(torch.float16)
            self.codes = split[..., 2:].contiguous().view(torch.int8)
        elif ggml_type == Q.Q4_1:  # per block: f16 d, f16 m, 16 bytes of two 4-bit q
            split = rows.view(vocab, -1, 20)
            self.scales = split[..., :2].contiguous().view(torch.float16)
            self.mins = split[..., 2:4].contiguous().view(torch.float16)
            self.codes = split[..., 4:].contiguous()
        else:
            self.blocks = rows

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def raw_blocks(self) -> np.ndarray:
        """The table's blocks as the file stores them, ``uint8 [vocab, row_bytes]``."""
        if self.blocks is not None:
            return self.blocks.numpy()
        vocab = self.codes.shape[0]
        parts = [self.scales.view(torch.uint8)]
        if self.ggml_type == Q.Q4_1:
            parts.append(self.mins.view(torch.uint8))
        parts.append(self.codes.view(torch.uint8))
        return torch.cat(parts, dim=-1).view(vocab, -1).numpy()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            rows = self.blocks.index_select(0, ids).numpy()
            values = gguf.quants.dequantize(rows, self.ggml_type)
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        # gguf.quants.dequantize's float32 operations, in its order.
        d = self.scales.index_select(0, ids).float()
        codes = self.codes.index_select(0, ids)
        if self.ggml_type == Q.Q8_0:
            w = codes.float() * d
        else:
            q = torch.cat((codes & 15, codes >> 4), dim=-1).float()
            w = q * d + self.mins.index_select(0, ids).float()
        return w.view(-1, self.hidden)

    def extra_repr(self) -> str:
        vocab = self.codes.shape[0] if self.blocks is None else self.blocks.shape[0]
        return f"{vocab}, {self.hidden}, {self.ggml_type.name} blocks"
