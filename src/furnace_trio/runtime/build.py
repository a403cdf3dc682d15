"""Building the model's runtime weights one tensor at a time.

:class:`Transformer` asks a :class:`WeightBuilder` for each weight by Hugging Face name, in
model order; the builder reads that tensor (and only it) from the loader's records and
returns it in its runtime form:

- norms and biases: float tensors on the runtime's device and dtype;
- linear layers (q/k/v and gate/up fused by row): on a quantized CPU runtime, a GGUF's
  quantized blocks go to :func:`~furnace_trio.runtime.blocks.linear_from_blocks` as the
  file stores them (``auto``); where that returns ``None``, or for float sources, or when
  ``int8``/``q4`` ask for a format, the one weight is dequantized and quantized by
  :mod:`furnace_trio.runtime.quant` (``auto``: the file's own grid where it is Q4_1 or
  Q8_0, as :func:`~furnace_trio.runtime.quant.quantize_linears` decides); on a float
  runtime, a float :class:`~furnace_trio.runtime.layers.Linear`;
- the token embedding: a quantized GGUF table stays in blocks on a quantized CPU runtime
  (:class:`~furnace_trio.runtime.embedding.BlockEmbedding`), and a tied LM head is made
  from those same blocks; otherwise a float table (which a float tied head shares).

The LM head is built right after the embedding, while little else is held: a head that
must be dequantized to be quantized again is the largest transient of a load.

So the float32 copies of the weights are never all alive at once: at any moment the
process holds the runtime weights built so far plus the one weight being converted.
Progress (tensors, bytes, seconds) is logged at INFO about every tenth of the bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Literal

import gguf
import numpy as np
import torch
from torch import nn

from furnace_trio.loading.tensors import LazyWeights, TensorRecord
from furnace_trio.runtime import native
from furnace_trio.runtime.blocks import ConcatLinear, linear_from_blocks, takes_blocks
from furnace_trio.runtime.embedding import BlockEmbedding, Embedding, TableEmbedding
from furnace_trio.runtime.layers import Linear
from furnace_trio.runtime.quant import FourBit, NativeLinear, _quantized

__all__ = ["WeightBuilder", "runtime_weight_bytes"]

logger = logging.getLogger(__name__)

Mode = Literal["none", "auto", "int8", "q4"]
_FOUR_BIT: dict[str, FourBit] = {"auto": "lossless", "q4": "always", "int8": "never"}
_EMBEDDING = "model.embed_tokens.weight"
_HEAD = "lm_head.weight"


class WeightBuilder:
    """Hands :class:`~furnace_trio.runtime.model.Transformer` its weights in runtime form.

    ``weights``: the loader's :class:`~furnace_trio.loading.tensors.LazyWeights`, or any
    mapping of float tensors (tests build models from dicts). ``mode``: ``none`` (float
    weights in ``dtype`` on ``device``) or a CPU float32 quantization (``auto``, ``int8``,
    ``q4``; see :class:`~furnace_trio.runtime.runner.RunnerConfig`). ``counts``: how many
    linear layers were made of each kind (``q4``, ``q8``, ``int8``, and what
    ``linear_from_blocks`` modules count as).
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        device: torch.device,
        dtype: torch.dtype,
        mode: Mode,
        kernels: native.Kernels | None,
    ) -> None:
        self._weights = weights
        self._records = weights.records if isinstance(weights, LazyWeights) else None
        self._unused = set(weights)
        self._device, self._dtype, self._mode, self._kernels = device, dtype, mode, kernels
        self.counts: dict[str, int] = {"q4": 0, "q8": 0, "int8": 0}
        self._embedding: Embedding | None = None
        self._started = time.perf_counter()
        self._total = (
            sum(r.n_bytes for r in self._records.values())
            if self._records is not None
            else sum(t.numel() * t.element_size() for t in weights.values())
        )
        self._read_tensors = self._read_bytes = self._logged = 0

    # --- what the model asks for -----------------------------------------------------

    def tensor(self, name: str) -> torch.Tensor:
        """A float weight (norm, bias) on the runtime's device and dtype."""
        return self._float(name).to(device=self._device, dtype=self._dtype)

    def linear(self, kind: str, names: Sequence[str], biases: Sequence[str] = ()) -> nn.Module:
        """The linear layer whose weight is the named weights stacked by row (and whose
        bias is the named biases, likewise). ``kind``: the module's attribute name, which
        the quantizer is told (``lm_head`` keeps 8 bits under ``q4``)."""
        bias = torch.cat([self.tensor(b) for b in biases]) if biases else None
        if self._mode == "none":
            return Linear(self._stacked_float(names).to(self._device, self._dtype), bias)
        records = [self._record(name) for name in names]
        if all(r is not None and r.quantized for r in records):
            qtypes = {r.ggml_type for r in records if r is not None}
            if len(qtypes) == 1:
                blocks = np.concatenate([self._blocks(n) for n in names])
                return self._from_blocks(kind, blocks, qtypes.pop(), bias)
            if self._mode == "auto" and self._kernels is not None:
                mixed = [r for r in records if r is not None]
                if all(takes_blocks(r.ggml_type, r.shape[-1], self._kernels) for r in mixed):
                    return self._concat(names, mixed, bias, self._kernels)
        return self._quantize(kind, self._stacked_float(names), bias)

    def embedding(self, name: str = _EMBEDDING) -> Embedding:
        """The token embedding (blocks or a float table, see the module docstring)."""
        record = self._record(name)
        if self._mode != "none" and record is not None and record.quantized:
            self._embedding = BlockEmbedding(self._blocks(name), record.ggml_type, record.shape[-1])
        else:
            self._embedding = TableEmbedding(self.tensor(name))
        return self._embedding

    def head(self, tied: bool) -> nn.Module:
        """The LM head: ``lm_head.weight``, or the embedding's weights when ``tied`` or the
        file has no head (call after :meth:`embedding`)."""
        if not tied and _HEAD in self._unused:
            return self.linear("lm_head", [_HEAD])
        self._unused.discard(_HEAD)
        embedding = self._embedding
        if isinstance(embedding, BlockEmbedding):
            return self._from_blocks("lm_head", embedding.raw_blocks(), embedding.ggml_type, None)
        if not isinstance(embedding, TableEmbedding):
            raise RuntimeError("WeightBuilder.head needs the embedding first")
        if self._mode == "none":
            return Linear(embedding.weight.data)
        return self._quantize("lm_head", embedding.weight.data, None)

    def unused(self) -> list[str]:
        """Names no module asked for (a rotary table some checkpoints store aside)."""
        return sorted(name for name in self._unused if "rotary_emb" not in name)

    def drop(self, prefix: str) -> None:
        """Leave every weight whose name starts with ``prefix`` unread (layers the runtime
        does not build, such as multi-token-prediction layers without speculation)."""
        self._unused = {name for name in self._unused if not name.startswith(prefix)}

    def finish(self) -> None:
        """Log the load's last progress line."""
        self._progress(final=True)

    # --- reading ---------------------------------------------------------------------

    def _record(self, name: str) -> TensorRecord | None:
        if self._records is None:
            return None
        if name not in self._records:
            raise KeyError(name)
        return self._records[name]

    def _float(self, name: str) -> torch.Tensor:
        """``name`` as float32 (a fresh tensor from a record, else the dict's own)."""
        if name not in self._unused:
            raise KeyError(f"{name} is missing or was asked for twice")
        record = self._record(name)
        tensor = self._weights[name].float() if record is None else record.float()
        self._consumed(name, record.n_bytes if record else tensor.numel() * 4)
        return tensor

    def _blocks(self, name: str) -> np.ndarray:
        record = self._record(name)
        if record is None or name not in self._unused:
            raise KeyError(f"{name} has no blocks, or was asked for twice")
        blocks = record.blocks()
        self._consumed(name, record.n_bytes)
        return blocks

    def _stacked_float(self, names: Sequence[str]) -> torch.Tensor:
        """The named float32 weights stacked by row, read one at a time into one tensor."""
        if len(names) == 1:
            return self._float(names[0])
        parts = []
        for name in names:
            record = self._record(name)
            parts.append(record.shape if record is not None else self._weights[name].shape)
        out = torch.empty((sum(p[0] for p in parts), *parts[0][1:]), dtype=torch.float32)
        row = 0
        for name, shape in zip(names, parts, strict=True):
            out[row : row + shape[0]] = self._float(name)
            row += shape[0]
        return out

    # --- converting ------------------------------------------------------------------

    def _from_blocks(
        self,
        kind: str,
        blocks: np.ndarray,
        qtype: gguf.GGMLQuantizationType,
        bias: torch.Tensor | None,
    ) -> nn.Module:
        """``linear_from_blocks`` under ``auto``; else (or where it returns ``None``) the
        blocks dequantized and quantized as the mode asks."""
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        shape = (blocks.shape[0], blocks.shape[1] // type_size * block_size)
        if self._mode == "auto":
            layer = linear_from_blocks(blocks, qtype, shape, bias, self._kernels)
            if layer is not None:
                counts_as = getattr(layer, "counts_as", "") or qtype.name.lower()
                self.counts[counts_as] = self.counts.get(counts_as, 0) + 1
                return layer
        weight = gguf.quants.dequantize(blocks, qtype)
        del blocks
        return self._quantize(
            kind, torch.from_numpy(np.ascontiguousarray(weight, np.float32)), bias
        )

    def _concat(
        self,
        names: Sequence[str],
        records: Sequence[TensorRecord],
        bias: torch.Tensor | None,
        kernels: native.Kernels,
    ) -> nn.Module:
        """A fused layer of parts in different block types, each native from its blocks."""
        sizes = [r.shape[0] for r in records]
        biases = [None] * len(sizes) if bias is None else list(bias.split(sizes))
        parts: list[NativeLinear] = []
        for name, record, part_bias in zip(names, records, biases, strict=True):
            shape = (record.shape[0], record.shape[-1])
            layer = linear_from_blocks(
                self._blocks(name), record.ggml_type, shape, part_bias, kernels
            )
            if not isinstance(layer, NativeLinear):
                raise RuntimeError(f"{name}: no native layer for {record.ggml_type.name}")
            self.counts[layer.counts_as] = self.counts.get(layer.counts_as, 0) + 1
            parts.append(layer)
        return ConcatLinear(parts, kernels)

    def _quantize(self, kind: str, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        layer = _quantized(kind, weight, bias, self._kernels, _FOUR_BIT[self._mode])
        self.counts[layer.counts_as if isinstance(layer, NativeLinear) else "int8"] += 1
        return layer

    def _consumed(self, name: str, n_bytes: int) -> None:
        self._unused.discard(name)
        self._read_tensors += 1
        self._read_bytes += n_bytes
        self._progress(final=False)

    def _progress(self, *, final: bool) -> None:
        step = max(1, self._total // 10)
        if not final and self._read_bytes < self._logged + step:
            return
        self._logged = self._read_bytes
        logger.info(
            "building the model: %d/%d tensors, %.0f/%.0f MiB read, %.1f s",
            self._read_tensors,
            len(self._weights),
            self._read_bytes / 2**20,
            self._total / 2**20,
            time.perf_counter() - self._started,
        )


def runtime_weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor ``model``'s modules hold (parameters, buffers and plain tensor
    attributes such as packed weights), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total
