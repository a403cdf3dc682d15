"""A GGUF file's vocabulary (its ``tokenizer.*`` metadata) read into
:class:`TokenizerParts`.

A byte-level BPE (``tokenizer.ggml.model`` ``gpt2``) is rebuilt from the tokens, merges and
token types, with the pre-tokenizer named by ``tokenizer.ggml.pre``. The split rules per
name follow llama.cpp's ``llama-vocab.cpp``, which reproduces each model's original
``tokenizer.json``. Note that ``transformers`` ignores ``smollm`` (it falls back to plain
GPT-2 splitting): SmolLM2 was trained with single-digit splitting *before* the GPT-2
regex, which we keep, so the two differ on whitespace followed by a digit (``"a  1"``). A
SentencePiece (``llama``) vocabulary, Gemma's for one, becomes a BPE ranked by the tokens'
scores (:mod:`furnace_trio.loading.spm_vocab`). Control tokens become special tokens,
user-defined ones plain added tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from furnace_trio.loading.gguf_file import read_gguf
from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.loading.spm_vocab import build_spm_tokenizer
from furnace_trio.loading.tokenizer_parts import TokenizerParts

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


# Pre-tokenizer split patterns, as in each model's tokenizer.json / llama-vocab.cpp.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# name -> (kind, ignore_merges). kind: "gpt2" = the GPT-2 regex inside ByteLevel;
# "digits+gpt2" = each digit split off first (StarCoder, SmolLM); otherwise a Split regex.
_PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "default": ("gpt2", False),
    "gpt2": ("gpt2", False),
    "gpt-2": ("gpt2", False),
    "mpt": ("gpt2", False),
    "olmo": ("gpt2", False),
    "jais": ("gpt2", False),
    "smollm": ("digits+gpt2", False),
    "starcoder": ("digits+gpt2", False),
    "refact": ("digits+gpt2", False),
    "codeshell": ("digits+gpt2", False),
    "command-r": ("digits+gpt2", False),
    "llama-bpe": (_LLAMA3_SPLIT, True),
    "llama3": (_LLAMA3_SPLIT, True),
    "llama-v3": (_LLAMA3_SPLIT, True),
    "dbrx": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
    "stablelm2": (_QWEN2_SPLIT, False),
}
SUPPORTED_GGUF_PRE_TOKENIZERS = tuple(sorted(_PRE_TOKENIZERS))


def _build_pre_tokenizer(name: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    try:
        kind, ignore_merges = _PRE_TOKENIZERS[name]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported GGUF pre-tokenizer {name!r}; supported: "
            f"{', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}"
        ) from None
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), ignore_merges
    if kind == "digits+gpt2":
        return (
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            ),
            ignore_merges,
        )
    return (
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(kind), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        ignore_merges,
    )


def _byte_level_bpe(tokens: list[str], merges_raw: list[str], pre_name: str) -> HFTokenizer:
    """A byte-level BPE (``tokenizer.ggml.model`` ``gpt2``) of a GGUF's tokens and merges."""
    if not merges_raw:
        raise UnsupportedModelError("GGUF tokenizer lacks merges")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # first wins, as in llama.cpp
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise UnsupportedModelError(f"malformed GGUF merge {merge!r}")
        merges.append((left, right))
    pre_tokenizer, ignore_merges = _build_pre_tokenizer(pre_name)
    hf = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges)
    )
    hf.pre_tokenizer = pre_tokenizer
    hf.decoder = decoders.ByteLevel()
    return hf


def gguf_tokenizer(fields: Mapping[str, Any]) -> TokenizerParts:
    """The tokenizer of a GGUF's already-read metadata (``{"tokenizer.ggml.model": "gpt2",
    ...}``): a loader that has the file's metadata open does not parse it twice."""
    model = fields.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise UnsupportedModelError(
            f"GGUF tokenizer model {model!r} is not supported "
            "(byte-level BPE 'gpt2' and SentencePiece 'llama' are)"
        )
    tokens = list(fields.get("tokenizer.ggml.tokens") or ())
    if not tokens:
        raise UnsupportedModelError("GGUF tokenizer lacks tokens")
    types = list(fields.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise UnsupportedModelError("GGUF token_type and tokens differ in length")
    if model == "llama":
        pre_name = "spm"
        hf = build_spm_tokenizer(
            tokens,
            list(fields.get("tokenizer.ggml.scores") or ()),
            types,
            add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", True)),
        )
    else:
        pre_name = fields.get("tokenizer.ggml.pre") or "default"
        hf = _byte_level_bpe(tokens, list(fields.get("tokenizer.ggml.merges") or ()), pre_name)
    vocab_size = len(set(tokens))

    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, types, strict=True)
        if kind == _TOKEN_CONTROL
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, types, strict=True)
        if kind == _TOKEN_USER_DEFINED
    ]
    hf.add_special_tokens(control)
    hf.add_tokens(user)
    if vocab_size != len(tokens):
        logger.warning(
            "GGUF vocabulary repeats %d token texts; the later ids are unreachable",
            len(tokens) - vocab_size,
        )

    def opt_id(key: str) -> int | None:
        value = fields.get(key)
        return int(value) if value is not None else None

    extra_eos = [
        i
        for i in (opt_id("tokenizer.ggml.eot_token_id"), opt_id("tokenizer.ggml.eom_token_id"))
        if i is not None
    ]
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = False
    template = fields.get("tokenizer.chat_template")
    logger.debug("GGUF tokenizer: %d tokens, pre-tokenizer %r", len(tokens), pre_name)
    return TokenizerParts(
        hf,
        bos_token_id=opt_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=opt_id("tokenizer.ggml.eos_token_id"),
        extra_eos_token_ids=tuple(extra_eos),
        add_bos_token=bool(add_bos),
        chat_template=template if isinstance(template, str) and template else None,
    )


def read_gguf_metadata(path: str | Path, *, prefix: str = "") -> dict[str, Any]:
    """The key/value metadata of a GGUF file whose keys start with ``prefix`` (no tensor
    data is read); unreadable files raise :class:`UnsupportedModelError`."""
    try:
        metadata = read_gguf(path).metadata
    except OSError as exc:
        raise UnsupportedModelError(f"cannot read GGUF metadata from {path}: {exc}") from exc
    except ValueError as exc:
        if isinstance(exc, UnsupportedModelError):
            raise
        raise UnsupportedModelError(f"{path}: truncated or corrupt GGUF metadata: {exc}") from exc
    return {k: v for k, v in metadata.items() if k.startswith(prefix)}
