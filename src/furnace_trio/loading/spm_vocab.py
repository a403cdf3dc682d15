"""A SentencePiece-style GGUF vocabulary (``tokenizer.ggml.model`` ``llama``) as a
Hugging Face ``tokenizers`` BPE.

llama.cpp's ``llm_tokenizer_spm`` tokenizes such a vocabulary (Gemma's, Llama 2's) without
merges: spaces become ``▁``, the text is split into characters, and the adjacent pair whose
concatenation is a token of the highest score is merged, again and again; a character no
token holds becomes its UTF-8 bytes (``<0x41>`` tokens). A BPE whose merges are every pair
of tokens that concatenate to a token, ranked by that token's score, merges in the same
order (the construction of transformers' ``SentencePieceExtractor``), so the Rust BPE runs
it, with byte fallback for the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from furnace_trio.loading.model_config import UnsupportedModelError

__all__ = ["SPACE", "build_spm_tokenizer"]

#: SentencePiece's visible space.
SPACE = "\u2581"
# GGUF token types (llama.cpp's llama_token_type) that take part in merges.
_TOKEN_NORMAL = 1
_UNKNOWN = "<unk>"


def build_spm_tokenizer(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    add_space_prefix: bool,
) -> HFTokenizer:
    """The BPE of a SentencePiece vocabulary (see the module docstring), without its
    control and user-defined tokens, which the caller adds as added tokens.

    ``add_space_prefix``: a ``▁`` before the text (Llama 2's; Gemma's GGUFs say no), which
    decoding strips again.
    """
    if len(scores) != len(tokens):
        raise UnsupportedModelError("GGUF scores and tokens differ in length")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # first wins, as in llama.cpp
    ranked: list[tuple[float, int, int, str, str]] = []
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != _TOKEN_NORMAL or len(token) < 2 or vocab[token] != index:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id, right_id = vocab.get(left), vocab.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-scores[index], left_id, right_id, left, right))
    ranked.sort()
    merges = [(left, right) for _, _, _, left, right in ranked]
    unknown = _UNKNOWN if _UNKNOWN in vocab else None
    hf = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unknown, fuse_unk=True, byte_fallback=True)
    )
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    hf.normalizer = normalizers.Sequence(steps)
    pieces: list[decoders.Decoder] = [
        decoders.Replace(SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_space_prefix:
        pieces.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(pieces)
    return hf
