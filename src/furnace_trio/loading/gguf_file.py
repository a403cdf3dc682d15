"""The GGUF container: metadata and tensor directory, parsed without reading tensor data.

Parsed with :mod:`struct` rather than ``gguf.GGUFReader``: the reader builds a numpy view per
string of the vocabulary and takes several seconds on a 49k-token vocabulary, where a plain
parse takes a fraction of a second. No torch here, so the tokenizer can use it too.
"""

from __future__ import annotations

import math
import os
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
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 8
# The fewest bytes a metadata entry (key length, type, a one-byte value) and a tensor
# directory entry (name length, n_dims, one dimension, type, offset) take.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8

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
    """Sequential little-endian reads from a buffered file (the header is read once).

    Every read is checked against the file's size first, so a garbage length or count
    never allocates (a count of 2**62 strings is refused, not attempted), and every
    error names the file, the byte offset and the field being read (:attr:`field`).
    """

    def __init__(self, file: BinaryIO, path: Path) -> None:
        self._file = file
        self.path = path
        self.size = os.fstat(file.fileno()).st_size
        self.field = "the header"

    @property
    def offset(self) -> int:
        return self._file.tell()

    def error(self, message: str, offset: int | None = None) -> UnsupportedModelError:
        at = self.offset if offset is None else offset
        return UnsupportedModelError(
            f"{self.path}: truncated or corrupt GGUF file ({self.size} bytes): at byte {at}, "
            f"reading {self.field}: {message}"
        )

    def take(self, n: int) -> bytes:
        left = self.size - self.offset
        if n > left:
            raise self.error(f"expected {n} more bytes, the file ends after {left}")
        return self._file.read(n)

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 count of items that each take at least ``min_item_bytes``; refused when
        they cannot fit in the rest of the file."""
        offset = self.offset
        n = self.u64()
        left = self.size - self.offset
        if n * min_item_bytes > left:
            raise self.error(
                f"{what} count {n} cannot fit in the {left} bytes left "
                f"(at least {min_item_bytes} bytes each)",
                offset,
            )
        return n

    def string(self) -> str:
        return self.take(self.count("string length", 1)).decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return self.string()
        if vtype == gguf.GGUFValueType.ARRAY:
            if depth >= _MAX_ARRAY_DEPTH:
                raise self.error(f"arrays nested deeper than {_MAX_ARRAY_DEPTH}")
            offset = self.offset
            item_type = self.u32()
            scalar = _SCALARS.get(item_type)
            if scalar is not None:  # numeric arrays in one unpack, not item by item
                count = self.count("array", scalar.size)
                return list(
                    struct.unpack(f"<{count}{scalar.format[1]}", self.take(count * scalar.size))
                )
            if item_type not in (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY):
                raise self.error(f"unknown array item type {item_type}", offset)
            count = self.count("array", 8 if item_type == gguf.GGUFValueType.STRING else 12)
            return [self.value(item_type, depth + 1) for _ in range(count)]
        scalar = _SCALARS.get(vtype)
        if scalar is None:
            raise self.error(f"unknown value type {vtype}", self.offset - 4)
        return scalar.unpack(self.take(scalar.size))[0]


def read_gguf(path: str | Path) -> GGUFContents:
    """Parse a GGUF file's metadata and tensor directory (no tensor data is read).

    Useful beyond this module: the tokenizer needs ``tokenizer.ggml.*`` from the metadata,
    and this is much faster than ``gguf.GGUFReader`` on large vocabularies. A truncated
    or corrupt file raises :class:`UnsupportedModelError` naming the file, the byte offset,
    the field and what was expected; so does a tensor whose data lies past the end of
    the file (an incomplete download), which is found here rather than when it is read.
    """
    path = Path(path)
    with path.open("rb") as file:
        reader = _Reader(file, path)
        magic = reader.take(4) if reader.size >= 4 else b""
        if magic != _GGUF_MAGIC:
            raise UnsupportedModelError(
                f"{path} is not a GGUF file (bad magic: starts with {magic!r}, not b'GGUF')"
            )
        reader.field = "the version"
        version = reader.u32()
        if version not in (2, 3):
            raise UnsupportedModelError(
                f"{path}: GGUF version {version} is not supported (need 2 or 3, little-endian)"
            )
        reader.field = "the tensor and metadata counts"
        n_tensors = reader.u64()
        n_kv = reader.count("metadata", _MIN_KV_BYTES)
        if n_tensors * _MIN_TENSOR_INFO_BYTES > reader.size:
            raise reader.error(f"tensor count {n_tensors} cannot fit in the file", 8)
        metadata: dict[str, Any] = {}
        for index in range(n_kv):
            reader.field = f"the key of metadata entry {index} of {n_kv}"
            offset = reader.offset
            key = reader.string()
            if key in metadata:
                raise reader.error(f"metadata key {key!r} appears twice", offset)
            reader.field = f"the type of metadata {key!r}"
            vtype = reader.u32()
            reader.field = f"the value of metadata {key!r}"
            metadata[key] = reader.value(vtype)
        raw: list[tuple[str, tuple[int, ...], int, int, int]] = []
        for index in range(n_tensors):
            reader.field = f"the name of tensor {index} of {n_tensors}"
            name = reader.string()
            reader.field = f"the shape of tensor {name!r}"
            offset = reader.offset
            n_dims = reader.u32()
            if not 1 <= n_dims <= _MAX_DIMS:
                raise reader.error(f"{n_dims} dimensions (expected 1 to {_MAX_DIMS})", offset)
            dims = tuple(reader.u64() for _ in range(n_dims))
            reader.field = f"the type and offset of tensor {name!r}"
            raw.append((name, dims[::-1], reader.u32(), reader.u64(), offset))
        reader.field = "general.alignment"
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise reader.error(f"alignment {alignment!r} is not a power of two", 0)
        data_start = -(-file.tell() // alignment) * alignment
    return GGUFContents(path, metadata, _tensors(reader, raw, data_start, alignment))


def _tensors(
    reader: _Reader,
    raw: list[tuple[str, tuple[int, ...], int, int, int]],
    data_start: int,
    alignment: int,
) -> tuple[GGUFTensorInfo, ...]:
    """The tensor directory checked: known types, whole blocks, aligned data that lies
    inside the file, no name twice."""
    tensors = []
    seen: set[str] = set()
    for name, shape, qtype_id, offset, info_offset in raw:
        reader.field = f"the directory entry of tensor {name!r}"
        if name in seen:
            raise reader.error(f"tensor {name!r} appears twice", info_offset)
        seen.add(name)
        try:
            qtype = gguf.GGMLQuantizationType(qtype_id)
        except ValueError:
            raise reader.error(f"unknown tensor type {qtype_id}", info_offset) from None
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        elements = math.prod(shape)
        if elements >= 1 << 62 or shape[-1] % block_size:
            raise reader.error(
                f"shape {list(shape)} does not hold whole {qtype.name} blocks of {block_size}",
                info_offset,
            )
        n_bytes = elements // block_size * type_size
        start = data_start + offset
        if offset % alignment or start + n_bytes > reader.size:
            raise reader.error(
                f"its data at bytes {start} to {start + n_bytes} lies outside the file "
                f"or off the {alignment}-byte alignment (an incomplete download?)",
                info_offset,
            )
        tensors.append(GGUFTensorInfo(name, shape, qtype, start, n_bytes))
    return tuple(tensors)
