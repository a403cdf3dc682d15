"""The bytes each token of a vocabulary stands for: one token's (OpenAI logprobs'
``bytes``), and the whole vocabulary's decode table for byte-level BPE vocabularies
(:class:`~furnace_trio.text.detokenizer.ByteDetokenizer`)."""

from __future__ import annotations

import json
import logging
from functools import cache

from tokenizers import Tokenizer as HFTokenizer

logger = logging.getLogger(__name__)


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet for bytes, inverted (char -> byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenBytes:
    """The bytes of the tokens of ``hf`` (read once: its added tokens and its decoder)."""

    __slots__ = ("_added", "_byte_level", "_byte_level_only", "_hf")

    def __init__(self, hf: HFTokenizer) -> None:
        self._hf = hf
        added = hf.get_added_tokens_decoder()
        self._added: dict[int, bytes] = {i: t.content.encode() for i, t in added.items()}
        decoder = json.loads(hf.to_str()).get("decoder") or {}
        self._byte_level = "ByteLevel" in json.dumps(decoder)
        self._byte_level_only = decoder.get("type") == "ByteLevel"

    def of(self, token_id: int) -> bytes:
        """The raw bytes one token stands for; may be a fragment of a UTF-8 character.
        Unknown ids give ``b""``."""
        added = self._added.get(token_id)
        if added is not None:
            return added
        piece = self._hf.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_decoder()
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
        # SentencePiece-style vocabularies: "▁" is a space, "<0x0A>" a raw byte.
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("▁", " ").encode()

    def decode_table(self, vocab_size: int) -> list[bytes] | None:
        """The bytes each id below ``vocab_size`` adds to decoding (special tokens skipped)
        where decoding ids is those bytes concatenated and read as UTF-8, invalid bytes
        replaced: vocabularies whose decoder is byte-level BPE's alone (GPT-2's and
        SmolLM2's, for example). ``None`` for any other, or where an entry does not give
        what decoding its id alone gives. One pass over the vocabulary (about 50 ms for
        SmolLM2's 49,152 ids)."""
        if not self._byte_level_only:
            return None
        hf = self._hf
        texts = hf.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=True)
        special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        table = _byte_decoder()
        entries: list[bytes] = []
        for token_id, text in enumerate(texts):
            if token_id in special:
                entry = b""
            elif "\ufffd" not in text:
                entry = text.encode()  # valid UTF-8: these are its bytes
            else:  # part of a character: the byte-level decoder's own rule
                piece = hf.id_to_token(token_id) or ""
                if all(c in table for c in piece):
                    entry = bytes(table[c] for c in piece)
                else:
                    entry = piece.encode()
            if entry.decode("utf-8", errors="replace") != text:
                logger.warning("token %d does not decode as its bytes; no decode table", token_id)
                return None
            entries.append(entry)
        return entries
