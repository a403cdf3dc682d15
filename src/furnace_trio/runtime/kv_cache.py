"""The paged KV cache: every layer's keys and values, preallocated and written in place.

Layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``. A token at
position ``p`` of a sequence with block table ``bt`` lives in slot
``bt[p // block_size] * block_size + p % block_size`` of the flattened ``[slots, kv, dim]``
view, which is where :class:`~furnace_trio.runtime.step_inputs.StepInputs`'s
``slot_mapping`` points. Float (float32, float16, bfloat16) or int8 with a float32 scale
per (slot, KV head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from furnace_trio.loading.model_config import ModelConfig
from furnace_trio.runtime import native


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One layer's paged keys and values, ``[blocks, block_size, KV, D]``: float, or int8
    with ``scales``, one float32 per (slot, KV head) each for keys and values
    (``[blocks, block_size, KV]``; a value is ``q * scale``)."""

    k: torch.Tensor
    v: torch.Tensor
    scales: native.KVScales | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k`` and ``v`` ``[T, KV, D]`` at cache ``slots`` ``[T]``."""
        kv_heads, dim = self.k.shape[2:]
        if self.scales is None:
            self.k.view(-1, kv_heads, dim).index_copy_(0, slots, k.to(self.k.dtype))
            self.v.view(-1, kv_heads, dim).index_copy_(0, slots, v.to(self.v.dtype))
            return
        for cache, scale, x in ((self.k, self.scales[0], k), (self.v, self.scales[1], v)):
            q, s = native.quantize_kv_rows(x)
            cache.view(-1, kv_heads, dim).index_copy_(0, slots, q)
            scale.view(-1, kv_heads).index_copy_(0, slots, s)

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the block numbers ``blocks`` (any shape) as ``dtype``:
        ``[*blocks.shape, block_size, KV, D]`` each."""
        keys, values = self.k[blocks].to(dtype), self.v[blocks].to(dtype)
        if self.scales is not None:
            keys = keys * self.scales[0][blocks].to(dtype).unsqueeze(-1)
            values = values * self.scales[1][blocks].to(dtype).unsqueeze(-1)
        return keys, values


class KVCache:
    """Preallocated paged key/value storage for every layer, written in place.

    ``dtype`` float32, float16 or bfloat16; or int8, one scale per (slot, KV head) row
    beside it (see :class:`LayerKV`): about half a float16 cache's bytes per token.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.scales: native.KVScales | None = None
        if dtype == torch.int8:
            scale_shape = shape[:-1]
            self.scales = (
                torch.zeros(scale_shape, dtype=torch.float32, device=device),
                torch.zeros(scale_shape, dtype=torch.float32, device=device),
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers = [
            LayerKV(
                self.k[i],
                self.v[i],
                None if self.scales is None else (self.scales[0][i], self.scales[1][i]),
            )
            for i in range(config.num_layers)
        ]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        row = config.head_dim * element + (4 if dtype == torch.int8 else 0)  # + int8's scale
        return 2 * config.num_layers * block_size * config.num_kv_heads * row

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write after a fork)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.k.device)
        dst = torch.tensor([d for _, d in copies], device=self.k.device)
        for tensor in (self.k, self.v, *(self.scales or ())):
            tensor[:, dst] = tensor[:, src]
