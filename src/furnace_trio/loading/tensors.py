"""A model's weights as records read from a memory-mapped file one tensor at a time.

Both loaders return a :class:`LazyWeights`: a mapping from Hugging Face name to a
:class:`TensorRecord`, which knows the tensor's shape and stored type (a GGML type:
safetensors' ``F32``/``F16``/``BF16`` are GGML's byte for byte) and reads it on demand,
either as its bytes (:meth:`TensorRecord.blocks`, quantized blocks as the file stores them)
or as float32 (:meth:`TensorRecord.float`). Nothing is read at load time but the header.

Each read copies the tensor out of the mapping and then drops the mapping's pages of it
(``MADV_DONTNEED``): the file stays in the page cache, but the process keeps only what the
runtime makes of each tensor, so a load's peak resident memory is the runtime weights plus
one tensor in flight, not plus the whole file.

Rows::

    file:   | row 0 blocks | row 1 blocks | ... |     (a row never shares a block)
    blocks: uint8 [rows, row_bytes]                   (rows in Hugging Face order)

llama.cpp's converter permutes the rows of llama ``q_proj``/``k_proj`` (see
:func:`unpermute_rows`); since a quantized block never spans two rows, the permutation is
undone on whole rows of bytes, before any dequantization.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from furnace_trio.loading.model_config import UnsupportedModelError

__all__ = ["FLOAT_TYPES", "LazyWeights", "MappedFile", "TensorRecord", "to_float", "unpermute_rows"]

Q = gguf.GGMLQuantizationType
#: Stored types that are plain floats (everything else is quantized blocks).
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.F64})
_PAGE = mmap.PAGESIZE


class MappedFile:
    """A file mapped read-only; :meth:`read` copies a byte range out and drops its pages."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self.size = size

    def read(self, offset: int, n_bytes: int) -> np.ndarray:
        """A fresh, writable uint8 copy of ``n_bytes`` at ``offset``."""
        if offset < 0 or offset + n_bytes > self.size or self._map is None:
            raise UnsupportedModelError(f"{self.path}: tensor data beyond the end of the file")
        view = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=offset)
        out = np.array(view)
        del view
        start = offset - offset % _PAGE
        if hasattr(self._map, "madvise"):  # Linux and macOS; elsewhere the pages stay
            self._map.madvise(mmap.MADV_DONTNEED, start, offset + n_bytes - start)
        return out


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``permute``: per head, interleaved RoPE pairs -> two halves.

    The converter did ``w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2)``; this
    reads rows as ``(n_head, head_dim // 2, 2)`` and swaps back. ``rows`` is
    ``[out, ...]``: rows of stored bytes, whatever the type (a bias's rows are its elements).
    """
    half = rows.shape[0] // n_head // 2
    grouped = rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(grouped.reshape(rows.shape))


def to_float(raw: np.ndarray, qtype: Q, shape: tuple[int, ...], name: str = "") -> np.ndarray:
    """The float32 values ``[*shape]`` of a tensor's stored bytes ``raw`` (uint8)."""
    if qtype == Q.F32:
        return np.array(raw.view(np.float32).reshape(shape))
    if qtype == Q.F64:
        return raw.view(np.float64).astype(np.float32).reshape(shape)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(-1, shape[-1] // block_size * type_size)
    try:
        values = gguf.quants.dequantize(rows, qtype)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"tensor {name}: quantization {qtype.name} cannot be dequantized"
        ) from None
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor of a model file, under its Hugging Face name, read on demand.

    ``shape`` is in torch order (``[out, in]`` for a linear weight); ``ggml_type`` is how
    the file stores it; ``offset``/``n_bytes`` locate it in ``file``. ``n_head``: the head
    count whose llama.cpp Q/K row permutation every read undoes (``None``: stored as is).
    ``shift``: added to every value read as floats (Gemma's checkpoints store an RMSNorm's
    multiplier minus one).
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: Q
    file: MappedFile
    offset: int
    n_bytes: int
    n_head: int | None = None
    shift: float = 0.0

    @property
    def quantized(self) -> bool:
        return self.ggml_type not in FLOAT_TYPES

    def part(self, name: str, index: int, count: int) -> TensorRecord:
        """Part ``index`` of a tensor stacked from ``count`` equal ones along its first
        dimension (one expert of a ``[experts, out, in]`` tensor), under ``name``: the
        part's own contiguous bytes of the file, read alone."""
        if self.shape[0] != count:
            raise UnsupportedModelError(f"{self.name}: {self.shape[0]} parts, expected {count}")
        size = self.n_bytes // count
        return TensorRecord(
            name, self.shape[1:], self.ggml_type, self.file, self.offset + index * size, size
        )

    def rows_at(self, name: str, start: int, rows: int) -> TensorRecord:
        """Rows ``start .. start + rows`` of this (2-D) tensor, under ``name``."""
        if len(self.shape) != 2 or start < 0 or start + rows > self.shape[0]:
            raise UnsupportedModelError(f"{self.name}: no rows {start}..{start + rows}")
        if self.n_head is not None or self.shift:
            raise UnsupportedModelError(f"{self.name}: a permuted or shifted tensor split")
        row_bytes = self.n_bytes // self.shape[0]
        return TensorRecord(
            name,
            (rows, self.shape[1]),
            self.ggml_type,
            self.file,
            self.offset + start * row_bytes,
            rows * row_bytes,
        )

    def blocks(self) -> np.ndarray:
        """The stored bytes as rows, ``uint8 [shape[0], row_bytes]`` (a 1-D float tensor's
        rows are its elements, a 1-D quantized one is one row), in Hugging Face row order;
        a fresh copy."""
        if self.shift:
            raise UnsupportedModelError(f"{self.name}: a shifted tensor read as blocks")
        return self._rows()

    def _rows(self) -> np.ndarray:
        raw = self.file.read(self.offset, self.n_bytes)
        one_row = not self.shape or (len(self.shape) == 1 and self.quantized)
        rows = raw.reshape(1 if one_row else self.shape[0], -1)
        if self.n_head is not None:
            if one_row:
                raise UnsupportedModelError(f"{self.name}: a quantized 1-D Q/K tensor")
            rows = unpermute_rows(rows, self.n_head)
        return rows

    def float(self) -> torch.Tensor:
        """The values as a fresh float32 tensor of ``shape``."""
        values = to_float(self._rows(), self.ggml_type, self.shape, self.name)
        if self.shift:
            values += self.shift
        return torch.from_numpy(values)


class LazyWeights(Mapping[str, torch.Tensor]):
    """Hugging Face name -> weight, read from the file only when asked for.

    As a mapping, each lookup reads and converts the tensor to a fresh float32 tensor (what
    the loaders returned as a dict; handy for tests and references, and costly: a full
    float32 copy per lookup). The runtime reads :attr:`records` instead, one tensor at a
    time, and keeps quantized blocks as they are where it can.
    """

    def __init__(self, records: Mapping[str, TensorRecord]) -> None:
        self.records: dict[str, TensorRecord] = dict(records)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.records[name].float()

    def __contains__(self, name: object) -> bool:
        return name in self.records  # Mapping's own would read the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def n_bytes(self) -> int:
        """The stored bytes of every tensor."""
        return sum(record.n_bytes for record in self.records.values())
