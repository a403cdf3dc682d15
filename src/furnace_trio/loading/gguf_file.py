"""The GGUF container: metadata and tensor directory, parsed without reading tensor data.

Parsed with :mod:`struct` rather than ``gguf.GGUFReader``: the reader builds a numpy view per
string of the vocabulary and takes several seconds on a 49k-token vocabulary, where a plain
parse takes a fraction of a second. No torch here, so the tokenizer can use it too.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import gguf

from furnace_trio.loading.model_config import UnsupportedModelError

__all__ = ["GGUFContents", "GGUFTensorInfo", "read_gguf"]

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

_SCALARS: dict[int, struct.Struct] = {
    gguf.GGUFValueType.UINT8: struct.Struct("<B"),
    gguf.GGUFValueType.INT8: struct.Struct("<b"),
    gguf.GGUFValueType.UINT16: struct.Struct("<H"),
    gguf.GGUFValueType.INT16: struct.Struct("<h"),
    gguf.GGUFValueType.UINT32: struct.Struct("<I"),
    gguf.GGUFValueType.INT32: struct.Struct("<i"),
    gguf.GGUFValueType.FLOAT32: struct.Struct("<f"),
    gguf.GGUFValueType.BOOL: struct.Struct("<?"),
    gguf.GGUFValueType.UINT64: struct.Struct("<Q"),
    gguf.GGUFValueType.INT64: struct.Struct("<q"),
    gguf.GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One entry of the tensor directory.

    ``shape`` is in numpy/torch order (outermost first): GGUF stores dimensions innermost
    first, and this record has already reversed them. ``offset`` is absolute in the file.
    """

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    offset: int
    n_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFContents:
    """A parsed GGUF header: metadata values as plain Python objects, and the tensors."""

    path: Path
    metadata: Mapping[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]


class _Reader:
    """Sequential little-endian reads from a buffered file (the header is read once)."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file

    def take(self, n: int) -> bytes:
        data = self._file.read(n)
        if len(data) != n:
            raise ValueError("truncated GGUF file")
        return data

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def string(self) -> str:
        return self.take(self.u64()).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return self.string()
        if vtype == gguf.GGUFValueType.ARRAY:
            item_type, count = self.u32(), self.u64()
            scalar = _SCALARS.get(item_type)
            if scalar is not None:  # numeric arrays in one unpack, not item by item
                return list(
                    struct.unpack(f"<{count}{scalar.format[1]}", self.take(count * scalar.size))
                )
            return [self.value(item_type) for _ in range(count)]
        scalar = _SCALARS.get(vtype)
        if scalar is None:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return scalar.unpack(self.take(scalar.size))[0]


def read_gguf(path: str | Path) -> GGUFContents:
    """Parse a GGUF file's metadata and tensor directory (no tensor data is read).

    Useful beyond this module: the tokenizer needs ``tokenizer.ggml.*`` from the metadata,
    and this is much faster than ``gguf.GGUFReader`` on large vocabularies.
    """
    path = Path(path)
    with path.open("rb") as file:
        reader = _Reader(file)
        if reader.take(4) != _GGUF_MAGIC:
            raise UnsupportedModelError(f"{path} is not a GGUF file (bad magic)")
        version = reader.u32()
        if version not in (2, 3):
            raise UnsupportedModelError(
                f"{path}: GGUF version {version} is not supported (need 2 or 3, little-endian)"
            )
        n_tensors, n_kv = reader.u64(), reader.u64()
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = reader.string()
            metadata[key] = reader.value(reader.u32())
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = reader.string()
            dims = tuple(reader.u64() for _ in range(reader.u32()))
            raw.append((name, dims[::-1], reader.u32(), reader.u64()))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-file.tell() // alignment) * alignment
    tensors = []
    for name, shape, qtype_id, offset in raw:
        try:
            qtype = gguf.GGMLQuantizationType(qtype_id)
        except ValueError:
            raise UnsupportedModelError(
                f"{path}: tensor {name} has unknown type {qtype_id}"
            ) from None
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = math.prod(shape) // block_size * type_size
        tensors.append(GGUFTensorInfo(name, shape, qtype, data_start + offset, n_bytes))
    return GGUFContents(path, metadata, tuple(tensors))
