"""Truncated and corrupt GGUF files: every error names the file, the byte offset, the
field being read and what was expected, and none allocates what a garbage count asks."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import gguf
import pytest

from furnace_trio.loading.default_model import default_model_path
from furnace_trio.loading.gguf_file import read_gguf
from furnace_trio.loading.loader import load_model
from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.loading.tokenizer import Tokenizer

pytestmark = pytest.mark.model


def _prefix(n: int) -> bytes:
    with default_model_path().open("rb") as file:
        return file.read(n)


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _error(path: Path, *pieces: str) -> str:
    with pytest.raises(UnsupportedModelError) as caught:
        load_model(path)
    message = str(caught.value)
    assert str(path) in message
    for piece in pieces:
        assert piece in message, message
    return message


def test_a_file_cut_in_the_header_or_the_metadata(tmp_path: Path) -> None:
    _error(_write(tmp_path, "a.gguf", _prefix(20)), "at byte 16", "metadata counts", "8 more")
    message = _error(
        _write(tmp_path, "b.gguf", _prefix(100_000)),
        "(100000 bytes)",
        "'tokenizer.ggml.tokens'",
        "cannot fit",
    )
    assert "at byte " in message
    # Cut inside a string of the vocabulary: the string length is what no longer fits.
    with pytest.raises(UnsupportedModelError, match=r"tokenizer\.ggml\.tokens.*bytes"):
        Tokenizer.from_gguf(_write(tmp_path, "c.gguf", _prefix(300_000)))


def test_a_file_cut_in_the_tensor_data_fails_at_load_not_later(tmp_path: Path) -> None:
    """An incomplete download: the metadata is whole, the weights are not. Found when the
    header is read (before, the load went ahead over a memory map of too few bytes)."""
    first = min(read_gguf(default_model_path()).tensors, key=lambda t: t.offset)
    path = _write(tmp_path, "cut.gguf", _prefix(first.offset + 1000))
    _error(path, f"tensor {first.name!r}", "outside the file", "incomplete download")


def _header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _key(name: str, vtype: int) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", vtype)


def test_garbage_counts_and_types_are_named(tmp_path: Path) -> None:
    cases = [
        (_header(0, 1 << 62) + bytes(64), "metadata count 4611686018427387904 cannot fit"),
        (_header(1 << 62, 0) + bytes(64), "tensor count 4611686018427387904 cannot fit"),
        (_header(0, 1) + struct.pack("<Q", 1 << 60) + bytes(64), "string length"),
        (_header(0, 1) + _key("x", 99) + bytes(16), "unknown value type 99"),
        (
            _header(0, 1) + _key("arr", 9) + struct.pack("<IQ", 4, 1 << 40) + bytes(16),
            "array count 1099511627776 cannot fit",
        ),
        (_header(0, 2) + _key("k", 4) + bytes(4) + _key("k", 4) + bytes(4), "appears twice"),
        (
            _header(1, 0) + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 9) + bytes(64),
            "9 dimensions",
        ),
        (
            _header(1, 0)
            + struct.pack("<Q", 1)
            + b"t"
            + struct.pack("<IQIQ", 1, 33, gguf.GGMLQuantizationType.Q8_0, 0)
            + bytes(64),
            "whole Q8_0 blocks of 32",
        ),
        (
            _header(1, 0)
            + struct.pack("<Q", 1)
            + b"t"
            + struct.pack("<IQIQ", 1, 4, 77, 0)
            + bytes(64),
            "unknown tensor type 77",
        ),
    ]
    for index, (data, expected) in enumerate(cases):
        path = _write(tmp_path, f"g{index}.gguf", data)
        with pytest.raises(UnsupportedModelError) as caught:
            read_gguf(path)
        assert str(path) in str(caught.value) and expected in str(caught.value), caught.value


def test_random_bytes_after_a_valid_start_never_crash_or_say_nothing(tmp_path: Path) -> None:
    rng = random.Random(34)
    start = _prefix(1200)
    for index in range(40):
        cut = rng.randrange(4, len(start))
        garbage = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 400)))
        path = _write(tmp_path, f"r{index}.gguf", start[:cut] + garbage)
        try:
            read_gguf(path)
        except UnsupportedModelError as exc:
            assert str(path) in str(exc) and len(str(exc)) > len(str(path)) + 20
