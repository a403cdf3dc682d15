"""Incremental detokenization: token ids in, text out, never half a character.

A byte-level BPE token can end in the middle of a UTF-8 character (an emoji is often
two or three tokens), and SentencePiece decoders treat the first token of a decode call
differently (they drop its leading space). Both are handled with the usual two offsets
over the generated ids::

    ids:   t0 t1 t2 | t3 t4 | t5 t6
                    ^       ^
           prefix_offset   read_offset

``decode(ids[prefix_offset:read_offset])`` is text already emitted (decoded with a little
left context), ``decode(ids[prefix_offset:])`` the same plus the new tokens; the new text
is the difference, emitted only when it does not end in U+FFFD (an incomplete
character). Each step decodes only the tokens since the emission before last, so the cost
per token does not grow with the length of the generation.

Where ``decode`` is the concatenation of each token's bytes read as UTF-8 (byte-level BPE
vocabularies, such as the default model's: see ``Tokenizer.decode_table``),
:class:`ByteDetokenizer` does the same from a table of those bytes and an incremental UTF-8
decoder, without calling ``decode``. That matters in the server: after each model step
the tokenizer's code and vocabulary are out of the caches, and two decode calls a token
reach into both, which costs the event loop more than twice the table's CPU per token
(docs/history.md).

I/O-free and independent of :class:`~furnace_trio.loading.tokenizer.Tokenizer`: they take any
``decode`` callable or byte table, so engine tests can use a toy one.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"

# The window normally spans a handful of tokens: it restarts at every token boundary that
# is also a character boundary. Text whose end stays incomplete for this many tokens is
# invalid UTF-8 from the model (or skipped special tokens): the window is then moved on
# regardless, so the cost per token stays bounded.
MAX_PENDING_TOKENS = 16


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text fragments.

    Invariants: a fragment never contains a partial character (a trailing U+FFFD that
    more bytes may complete is held back, while the complete text before it is emitted
    at once); after :meth:`flush`, the concatenation of all fragments equals
    ``decode(all ids)`` for any decoder whose output for a window of ids depends only on
    that window and that replaces invalid UTF-8 like ``bytes.decode(errors="replace")``
    (``tokenizers`` and Python do); :attr:`text` is that concatenation so far.
    """

    __slots__ = (
        "_decode",
        "_emitted",
        "_ids",
        "_pending_emitted",
        "_prefix_offset",
        "_prefix_text",
        "_read_offset",
    )

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._pending_emitted = 0  # chars past prefix_text already emitted
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far (by :meth:`feed` and :meth:`flush`)."""
        if len(self._emitted) > 1:
            self._emitted[:] = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def token_ids(self) -> Sequence[int]:
        """The ids fed so far (read-only view by convention)."""
        return self._ids

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while nothing new is complete)."""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(self._prefix_text) :]
        pending = len(self._ids) - self._read_offset
        if pending < MAX_PENDING_TOKENS:
            if new_text.endswith(REPLACEMENT_CHAR):
                # Emit the complete part now; the last character may still change.
                return self._emit(delta[self._pending_emitted : -1], len(delta) - 1)
            if not delta:
                # Nothing visible (a skipped special token): keep the left context.
                return ""
        elif new_text.endswith(REPLACEMENT_CHAR):
            logger.debug("emitting invalid UTF-8 after %d pending tokens", pending)
        return self._advance(delta)

    def flush(self) -> str:
        """Return whatever is still pending (at the end of the generation), even if it
        ends in an incomplete character (then as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        return self._advance(new_text[len(self._prefix_text) :])

    def _emit(self, text: str, pending_emitted: int) -> str:
        self._pending_emitted = max(self._pending_emitted, pending_emitted)
        if text:
            self._emitted.append(text)
        return text

    def _advance(self, delta: str) -> str:
        """Emit the rest of ``delta`` and restart the window at the current token."""
        out = delta[self._pending_emitted :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Decoded afresh, not sliced from new_text: decoders such as SentencePiece's
        # treat the first token of a call differently, and the next window starts here.
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._pending_emitted = 0
        if out:
            self._emitted.append(out)
        return out


class Detokenizer(Protocol):
    """What the engine needs of a detokenizer (both classes here)."""

    def feed(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class ByteDetokenizer:
    """:class:`IncrementalDetokenizer`'s contract for a decoder that reads the
    concatenated bytes of its tokens as UTF-8 (invalid bytes becoming U+FFFD, as
    ``bytes.decode(errors="replace")``): ``table[id]`` is the bytes of ``id`` (``b""``
    for skipped special tokens; ids past the table give nothing).

    An incomplete character is held back only while more bytes can still complete it (at
    most three bytes); bytes that cannot become one are emitted as U+FFFD at once. After
    :meth:`flush` the fragments are ``decode(all ids)``. It keeps nothing else (no ids, no
    text so far): the engine needs neither.
    """

    __slots__ = ("_decoder", "_table")

    def __init__(self, table: Sequence[bytes]) -> None:
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while nothing new is complete)."""
        table = self._table
        return self._decoder.decode(table[token_id] if 0 <= token_id < len(table) else b"")

    def flush(self) -> str:
        """Return whatever is still pending (at the end of the generation), even if it
        ends in an incomplete character (then as U+FFFD)."""
        out = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return out


def make_detokenizer(
    decode: Callable[[Sequence[int]], str], table: Sequence[bytes] | None
) -> Detokenizer:
    """A :class:`ByteDetokenizer` over ``table`` where there is one, else an
    :class:`IncrementalDetokenizer` over ``decode``."""
    if table is not None:
        return ByteDetokenizer(table)
    return IncrementalDetokenizer(decode)


__all__ = [
    "MAX_PENDING_TOKENS",
    "REPLACEMENT_CHAR",
    "ByteDetokenizer",
    "Detokenizer",
    "IncrementalDetokenizer",
    "make_detokenizer",
]
