"""Tokenizer: the GGUF-built SmolLM2 tokenizer against transformers, and from_hf_directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, decoders
from tokenizers import Tokenizer as HFTokenizer

from furnace_trio.loading.gguf_vocab import read_gguf_metadata
from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.loading.tokenizer import Tokenizer

pytestmark = pytest.mark.model

CORPUS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "it's they're we've I'd you'll she'm",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C loop",
    "3.14159 and 1,000,000 and 2024-01-01T12:00:00Z and x=42",
    "multiple   spaces\tand\t\ttabs   ",
    "\n\nleading newlines\n\n\n trailing\n",
    "\r\nwindows\r\nline endings",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "中文字符，日本語のテキスト、한국어 텍스트",
    "café naïve Ærøskøbing Straße señor Ωμέγα Привет",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end",
    "mixed <jupyter_code>print(1)<jupyter_output>",
    "",
    " ",
    "a",
]

# Whitespace followed by a digit: transformers' GGUF loader ignores tokenizer.ggml.pre and
# splits with plain GPT-2 rules; SmolLM2's own tokenizer.json (and llama.cpp's "smollm")
# splits each digit off first. We follow the model's tokenizer.
DIGIT_AFTER_WHITESPACE = ["a  123", "   \n 42", "x\t\t7 and  8"]


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(tokenizer: Tokenizer, hf_reference: Any, text: str) -> None:
    assert tokenizer.encode(text) == hf_reference(text).input_ids
    assert (
        tokenizer.encode(text, add_special_tokens=False)
        == hf_reference(text, add_special_tokens=False).input_ids
    )


@pytest.mark.parametrize("text", DIGIT_AFTER_WHITESPACE)
def test_digits_are_split_off_before_gpt2_rules(
    tokenizer: Tokenizer, hf_reference: Any, text: str
) -> None:
    from tokenizers import pre_tokenizers

    backend = hf_reference.backend_tokenizer
    original = backend.pre_tokenizer
    try:
        # SmolLM2-135M-Instruct's tokenizer.json pre-tokenizer.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        assert tokenizer.encode(text) == hf_reference(text).input_ids
    finally:
        backend.pre_tokenizer = original
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", CORPUS + DIGIT_AFTER_WHITESPACE)
def test_round_trip(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_decode_skips_special_tokens_by_default(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert tokenizer.decode(ids) == "user\nhi"


@pytest.mark.parametrize(
    "special", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<empty_output>"]
)
def test_special_tokens_encode_as_single_ids(tokenizer: Tokenizer, special: str) -> None:
    ids = tokenizer.encode(special)
    assert len(ids) == 1
    assert ids[0] == tokenizer.token_to_id(special)
    assert tokenizer.token_to_bytes(ids[0]) == special.encode()


def test_special_ids_and_metadata(tokenizer: Tokenizer, hf_reference: Any) -> None:
    im_end = tokenizer.token_to_id("<|im_end|>")
    endoftext = tokenizer.token_to_id("<|endoftext|>")
    assert im_end is not None and endoftext is not None
    assert {im_end, endoftext} <= tokenizer.eos_token_ids
    assert tokenizer.token_to_id("<|im_start|>") not in tokenizer.eos_token_ids
    assert tokenizer.vocab_size == 49152 == len(hf_reference)
    assert tokenizer.bos_token_id == hf_reference.bos_token_id
    assert tokenizer.add_bos_token is False  # tokenizer.ggml.add_bos_token
    assert tokenizer.chat_template == hf_reference.chat_template


def test_token_to_bytes_reassembles_multibyte_text(tokenizer: Tokenizer) -> None:
    for text in CORPUS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if "<" in text:
            continue  # special tokens are not part of the byte stream
        assert b"".join(tokenizer.token_to_bytes(i) for i in ids) == text.encode()
    emoji_ids = tokenizer.encode("😀")
    assert len(emoji_ids) > 1  # split mid-character: fragments, not text
    assert (
        tokenizer.token_to_bytes(emoji_ids[0])
        == "😀".encode()[: len(tokenizer.token_to_bytes(emoji_ids[0]))]
    )
    assert tokenizer.token_to_bytes(10**9) == b""


def test_decode_ignores_ids_beyond_the_vocabulary(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok")
    assert tokenizer.decode([*ids, tokenizer.vocab_size + 5]) == "ok"


def test_the_decode_table_follows_decode_for_added_tokens(tokenizer: Tokenizer) -> None:
    """Added tokens that are not special decode through the byte-level decoder too, with
    its quirks ("café" as a token decodes to "caf\ufffd", its "é" read as the byte 0xE9):
    the table gives what decode gives, not what the token's text says."""
    hf = HFTokenizer.from_str(tokenizer.hf_tokenizer.to_str())
    added = ["naïve fish", "café", "<tool>"]
    hf.add_tokens([AddedToken(text, special=False) for text in added])
    extended = Tokenizer(
        hf, bos_token_id=None, eos_token_id=2, add_bos_token=False, chat_template=None
    )
    table = extended.decode_table()
    assert table is not None and len(table) == tokenizer.vocab_size + len(added)
    assert table[tokenizer.vocab_size :] == [b"na\xc3\xafve fish", b"caf\xe9", b"<tool>"]
    assert table[tokenizer.token_to_id("<|im_end|>")] == b""  # special: skipped
    ids = extended.encode("a naïve fish in a café <tool> <|im_end|>😀")
    expected = extended.decode(ids)
    assert expected == "a naïve fish in a caf\ufffd <tool> 😀"
    assert b"".join(table[i] for i in ids).decode("utf-8", errors="replace") == expected


def test_no_decode_table_where_decode_is_not_byte_level_alone(tokenizer: Tokenizer) -> None:
    for decoder in (
        decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)]),
        decoders.Metaspace(),
    ):
        hf = HFTokenizer.from_str(tokenizer.hf_tokenizer.to_str())
        hf.decoder = decoder
        other = Tokenizer(
            hf, bos_token_id=None, eos_token_id=2, add_bos_token=False, chat_template=None
        )
        assert other.decode_table() is None


def test_encode_rejects_non_text(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError):
        tokenizer.encode(b"bytes")  # type: ignore[arg-type]


def test_gguf_metadata_reader(gguf_path: Path) -> None:
    meta = read_gguf_metadata(gguf_path, prefix="tokenizer.ggml.")
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert all(key.startswith("tokenizer.ggml.") for key in meta)


def test_unsupported_gguf_vocabularies_fail_clearly(gguf_path: Path) -> None:
    fields = read_gguf_metadata(gguf_path, prefix="tokenizer.")
    with pytest.raises(UnsupportedModelError, match="SentencePiece"):
        Tokenizer.from_gguf_fields({**fields, "tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer"):
        Tokenizer.from_gguf_fields({**fields, "tokenizer.ggml.pre": "no-such-model"})


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all, just text" * 4)
    with pytest.raises(UnsupportedModelError):
        Tokenizer.from_gguf(bogus)


# -- from_hf_directory -------------------------------------------------------------------


def write_hf_directory(
    root: Path, tokenizer: Tokenizer, config: dict[str, Any], **files: str
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tokenizer.hf_tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (root / name.replace("__", ".")).write_text(text)
    return root


def test_from_hf_directory(tmp_path: Path, tokenizer: Tokenizer) -> None:
    root = write_hf_directory(
        tmp_path / "model",
        tokenizer,
        {
            "bos_token": "<|im_start|>",
            "eos_token": {"content": "<|im_end|>", "special": True},
            "add_bos_token": False,
            "chat_template": tokenizer.chat_template,
        },
    )
    loaded = Tokenizer.from_hf_directory(root)
    for text in CORPUS + DIGIT_AFTER_WHITESPACE:
        assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.eos_token_ids == tokenizer.eos_token_ids
    assert loaded.bos_token_id == tokenizer.bos_token_id
    messages = [{"role": "user", "content": "Hi"}]
    assert loaded.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    assert loaded.token_to_bytes(loaded.encode("é")[0]) == tokenizer.token_to_bytes(
        tokenizer.encode("é")[0]
    )


def test_from_hf_directory_bos_template_file_and_generation_config(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    root = write_hf_directory(
        tmp_path / "model",
        tokenizer,
        {
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "add_bos_token": True,
            "chat_template": "ignored: the .jinja file wins",
        },
        chat_template__jinja="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        generation_config__json=json.dumps({"eos_token_id": [2, 5]}),
    )
    loaded = Tokenizer.from_hf_directory(root)
    bos = tokenizer.token_to_id("<|endoftext|>")
    assert loaded.encode("hi") == [bos, *tokenizer.encode("hi")]
    assert loaded.encode("hi", add_special_tokens=False) == tokenizer.encode("hi")
    assert 5 in loaded.eos_token_ids and 2 in loaded.eos_token_ids
    text = loaded.apply_chat_template([{"role": "user", "content": "x"}])
    assert text == "<|endoftext|>x"
    assert loaded.render_and_encode_chat([{"role": "user", "content": "x"}]) == [
        bos,
        *tokenizer.encode("x"),
    ]


def test_from_hf_directory_without_template_or_tokenizer(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    root = write_hf_directory(tmp_path / "model", tokenizer, {"eos_token": "<|im_end|>"})
    loaded = Tokenizer.from_hf_directory(root)
    assert loaded.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        loaded.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(UnsupportedModelError, match=r"tokenizer\.json"):
        Tokenizer.from_hf_directory(tmp_path / "empty")
