"""Linear layers straight from a GGUF tensor's quantized blocks.

:func:`linear_from_blocks` is where the loader hands a weight it has not dequantized: the
tensor's bytes as the file stores them, its GGML type and its shape. A native kernel that
multiplies that type takes the blocks as they are (repacked, never rounded again); any
other type returns ``None`` and the caller dequantizes the one tensor and quantizes it as
``FURNACE_QUANT`` asks.

The native types, with the activations each multiplies against (int8, per row):

============  ===========  ==========================================================
GGML type     counts as    activations
============  ===========  ==========================================================
Q4_0, Q5_0    q4_0, q5_0   per 32 inputs, scale ``max|x| / 127`` (llama.cpp's Q8_0)
Q4_1, Q8_0    q4, q8       the same (the kernels of :class:`~.quant.NativeQ4Linear`
                           and :class:`~.quant.NativeQ8Linear`)
Q4_K, Q5_K,   q4_k, q5_k,  per 256 inputs with the code sums per 16 and 32 (llama.cpp's
Q6_K          q6_k         Q8_K), so the weights' sub-block scales enter the integer sums
============  ===========  ==========================================================

The repacking (``furnace_kq_pack`` in ``cpu_repack.c``) reads the blocks once and writes
the packed panels directly: no tensor is ever expanded to one value per weight, in float32
or otherwise, so loading needs the packed weight's bytes plus one block's worth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from furnace_trio.runtime import native
from furnace_trio.runtime.quant import NativeLinear

__all__ = ["BLOCK_FORMATS", "BlockFormat", "BlockLinear", "linear_from_blocks"]


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """How a GGML type runs: its name in the runner's counts, its label, its kind in
    ``furnace_decode_layers``' table, and ``bits`` 4 or 8 where it runs on the Q4_1 / Q8_0
    kernel (``grouped_linear``), else 0 (``kq_linear``)."""

    counts_as: str
    label: str
    table_kind: int
    bits: int = 0


BLOCK_FORMATS: dict[int, BlockFormat] = {
    GGMLQuantizationType.Q4_0: BlockFormat("q4_0", "Q4_0 (native)", native.LINEAR_Q4_0),
    GGMLQuantizationType.Q4_1: BlockFormat("q4", "4-bit (native)", native.LINEAR_Q4, 4),
    GGMLQuantizationType.Q5_0: BlockFormat("q5_0", "Q5_0 (native)", native.LINEAR_Q5_0),
    GGMLQuantizationType.Q8_0: BlockFormat("q8", "Q8_0 (native)", native.LINEAR_Q8, 8),
    GGMLQuantizationType.Q4_K: BlockFormat("q4_k", "Q4_K (native)", native.LINEAR_Q4_K),
    GGMLQuantizationType.Q5_K: BlockFormat("q5_k", "Q5_K (native)", native.LINEAR_Q5_K),
    GGMLQuantizationType.Q6_K: BlockFormat("q6_k", "Q6_K (native)", native.LINEAR_Q6_K),
}


class BlockLinear(NativeLinear):
    """``y = x @ W.T (+ b)`` with ``W`` a GGUF tensor's blocks, packed into the kernels'
    panels (:meth:`~furnace_trio.runtime.native.Kernels.pack_blocks`); built by
    :func:`linear_from_blocks`."""

    def __init__(
        self,
        blocks: np.ndarray,
        ggml_type: int,
        shape: tuple[int, int],
        bias: torch.Tensor | None,
        kernels: native.Kernels,
    ) -> None:
        super().__init__(shape, bias, kernels)
        fmt = BLOCK_FORMATS[ggml_type]
        self.ggml_type = int(ggml_type)
        self.bits = fmt.bits
        self.label = fmt.label
        self.counts_as = fmt.counts_as
        self.table_kind = fmt.table_kind
        self.packed = kernels.pack_blocks(self.ggml_type, blocks, *shape)

    def _multiply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.bits:
            self._kernels.grouped_linear(self.bits, x, self.packed, self.bias, out)
        else:
            self._kernels.kq_linear(self.ggml_type, x, self.packed, self.bias, out)


def linear_from_blocks(
    blocks: np.ndarray,
    ggml_type: int,
    shape: tuple[int, int],
    bias: torch.Tensor | None,
    kernels: native.Kernels | None,
) -> nn.Module | None:
    """A module computing ``y = x @ W.T (+ bias)`` for ``W`` the dequantized ``blocks``.

    ``blocks``: uint8, the tensor's raw bytes in file order (``shape[0]`` rows of
    ``shape[1] // block_size`` blocks), possibly a read-only memory map: the module copies
    what it keeps and holds no reference to ``blocks``. ``ggml_type``: a
    ``gguf.GGMLQuantizationType`` value. ``shape``: ``(out_features, in_features)``.
    Returns ``None`` where no native kernel takes ``ggml_type`` (or without ``kernels``),
    and where ``in_features`` is not a whole number of the type's blocks (256 for the
    K-quants: such a tensor's rows cannot be blocks of that type in a well-formed file).
    Raises ``ValueError`` when ``blocks`` does not hold exactly ``shape``'s blocks.
    """
    if kernels is None or ggml_type not in BLOCK_FORMATS:
        return None
    out_features, in_features = shape
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if in_features <= 0 or in_features % block_size:
        return None
    expected = out_features * (in_features // block_size) * type_size
    if blocks.dtype != np.uint8 or blocks.size != expected:
        raise ValueError(
            f"{GGMLQuantizationType(ggml_type).name} {shape}: expected {expected} bytes, "
            f"got {blocks.size} of {blocks.dtype}"
        )
    return BlockLinear(np.ascontiguousarray(blocks).reshape(-1), ggml_type, shape, bias, kernels)


def takes_blocks(ggml_type: int, in_features: int, kernels: native.Kernels | None) -> bool:
    """Whether :func:`linear_from_blocks` builds a native layer for a tensor of
    ``ggml_type`` with rows of ``in_features`` weights."""
    if kernels is None or ggml_type not in BLOCK_FORMATS:
        return False
    block_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][0]
    return in_features > 0 and in_features % block_size == 0


class ConcatLinear(NativeLinear):
    """Native layers side by side, their outputs concatenated: a fused projection (q/k/v,
    gate/up) whose parts the file stores in different block types, as llama.cpp's mixes do
    (Q4_K_M keeps ``attn_v`` in Q6_K beside Q4_K queries and keys). Each part computes its
    outputs as it would alone, so the layer is as batch invariant as its parts; in
    ``furnace_decode_layers``' table it is one ``LINEAR_CONCAT`` entry pointing to theirs."""

    table_kind = native.LINEAR_CONCAT

    def __init__(self, parts: Sequence[NativeLinear], kernels: native.Kernels) -> None:
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("the parts of a concatenated layer must share their input size")
        out_features = sum(p.out_features for p in parts)
        super().__init__((out_features, parts[0].in_features), None, kernels)
        self.parts = nn.ModuleList(parts)
        self.label = " + ".join(p.label for p in parts)
        entries = [len(parts)]
        for part in parts:
            entries += [*part.table_row(), part.out_features]
        # The parts' table entries (addresses of their packed weights, which self.parts
        # keeps alive), read by the C code through table_row's weight address.
        self.packed = torch.tensor(entries, dtype=torch.int64)

    def _multiply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        at = 0
        for module in self.parts:
            part = cast(NativeLinear, module)
            y = torch.empty((x.shape[0], part.out_features), dtype=torch.float32)
            part._multiply(x, y)
            out[:, at : at + part.out_features] = y
            at += part.out_features
