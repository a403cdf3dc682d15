"""What Python and ``cpu_kernels.c`` agree on: the enums of the decode-layer table and of
the KV cache formats, the decode step's shapes, and the int8 KV cache's arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A linear layer's format in the decode_layers table (enum in cpu_kernels.c).
LINEAR_W8 = 0
LINEAR_Q4 = 1
LINEAR_Q8 = 2
LINEAR_Q4_0 = 3
LINEAR_Q5_0 = 4
LINEAR_Q4_K = 5
LINEAR_Q5_K = 6
LINEAR_Q6_K = 7
LINEAR_CONCAT = 8  # several of the above side by side (blocks.ConcatLinear)


@dataclass(frozen=True, slots=True)
class DecodeDims:
    """The shapes ``furnace_decode_layers`` needs."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float

    @property
    def scratch_per_token(self) -> int:
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        attention = 2 * self.heads * self.head_dim + self.kv_heads * self.head_dim
        quantized = max(self.hidden, self.heads * self.head_dim, self.intermediate)
        return 2 * self.hidden + qkv + attention + 3 * self.intermediate + quantized


#: A KV cache's format for the kernels (enum in cpu_kernels.c).
KV_F32, KV_F16, KV_I8 = 0, 1, 2
#: An int8 cache's key and value scales, ``[..., KV]`` float32 each.
KVScales = tuple[torch.Tensor, torch.Tensor]


def supports_kv(cache: torch.Tensor, scales: KVScales | None = None) -> bool:
    """Whether the kernels take this cache: float32 or float16, or int8 with its scales."""
    if scales is not None:
        return cache.dtype == torch.int8
    return cache.dtype in (torch.float32, torch.float16)


def kv_kind(cache: torch.Tensor, scales: KVScales | None = None) -> int:
    """The kernels' ``KV_*`` for a cache (int8 caches need their ``scales``)."""
    if supports_kv(cache, scales):
        return {torch.int8: KV_I8, torch.float16: KV_F16}.get(cache.dtype, KV_F32)
    raise TypeError(
        "native kernels take float32 or float16 KV caches, or int8 ones with their scales; "
        f"not {cache.dtype} {'with' if scales is not None else 'without'} scales"
    )


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` float -> int8 ``q`` and float32 ``scale`` ``[...]``, ``x ~ q * scale``.

    Per row: ``q = round(x * 127 / max|x|)``, ``scale = max|x| / 127`` (a row of zeros: 0 and
    0), the native kernels' arithmetic (``quantize_kv_row``), so both paths store the same
    bytes."""
    x = x.float()
    top = x.abs().amax(dim=-1)
    inv = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    q = torch.round(x * inv.unsqueeze(-1)).to(torch.int8)
    return q, top / 127.0
