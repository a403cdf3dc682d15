"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model`` ``llama``): merges by
score, spaces as ``▁``, byte fallback, BOS; and Gemma 3's real vocabulary against the ids
llama.cpp gives."""

from __future__ import annotations

from typing import Any

import pytest

from furnace_trio.loading.gguf_vocab import read_gguf_metadata
from furnace_trio.loading.tokenizer import Tokenizer

from ..real_model import gemma3_gguf

NORMAL, CONTROL, USER, BYTE = 1, 3, 4, 6


def _fields(add_space_prefix: bool) -> dict[str, Any]:
    """A small SentencePiece vocabulary: control tokens, the 256 byte tokens, pieces."""
    entries: list[tuple[str, float, int]] = [
        ("<pad>", 0.0, CONTROL),
        ("<eos>", 0.0, CONTROL),
        ("<bos>", 0.0, CONTROL),
        ("<unk>", 0.0, CONTROL),
        ("<end_of_turn>", 0.0, CONTROL),
        ("\n\n", 0.0, USER),
        *((f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)),
        # "b"+"c" outscores "a"+"b": "abc" is a + bc, then abc
        ("a", -1.0, NORMAL),
        ("b", -1.0, NORMAL),
        ("c", -1.0, NORMAL),
        ("ab", -5.0, NORMAL),
        ("bc", -2.0, NORMAL),
        ("abc", -3.0, NORMAL),
        ("\u2581", -1.0, NORMAL),
        ("\u2581a", -4.0, NORMAL),
    ]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [t for t, _, _ in entries],
        "tokenizer.ggml.scores": [s for _, s, _ in entries],
        "tokenizer.ggml.token_type": [k for _, _, k in entries],
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def test_merges_follow_the_scores_and_unknown_characters_fall_back_to_bytes() -> None:
    tok = Tokenizer.from_gguf_fields(_fields(add_space_prefix=False))
    ids = tok.encode("abc a\n\né<end_of_turn>")
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces == [
        "<bos>",
        "abc",
        "\u2581a",
        "\n\n",
        "<0xC3>",  # "é" is no piece: its UTF-8 bytes
        "<0xA9>",
        "<end_of_turn>",
    ]
    assert tok.decode(ids) == "abc a\n\né"
    assert tok.token_to_bytes(ids[4]) == b"\xc3"
    assert tok.eos_token_ids == {1, 4}  # <eos>, and <end_of_turn> ends a turn too
    # "ab" + "c" would be the merge by position; "bc" has the better score
    assert [tok.id_to_token(i) for i in tok.encode("bca", add_special_tokens=False)] == [
        "bc",
        "a",
    ]


def test_a_space_prefix_is_added_and_stripped_again() -> None:
    tok = Tokenizer.from_gguf_fields(_fields(add_space_prefix=True))
    ids = tok.encode("a abc", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["\u2581a", "\u2581", "abc"]
    assert tok.decode(ids) == "a abc"


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.from_gguf_fields(read_gguf_metadata(gemma3_gguf(), prefix="tokenizer."))


@pytest.mark.parametrize(
    ("text", "llama_cpp"),
    [
        # ids from llama.cpp's llama-server /tokenize (add_special) on the same file
        ("The capital of France is", [2, 818, 5279, 529, 7001, 563]),
        (
            "Hello  world\n\nnew line 123 café 😀 \x01",
            [
                2,
                9259,
                138,
                12392,
                108,
                1951,
                1757,
                236743,
                236770,
                236778,
                236800,
                33443,
                163543,
                236743,
                249732,
            ],
        ),
    ],
)
def test_gemma3_vocabulary_tokenizes_as_llama_cpp(
    gemma: Tokenizer, text: str, llama_cpp: list[int]
) -> None:
    ids = gemma.encode(text)
    assert ids == llama_cpp
    assert gemma.decode(ids) == text
