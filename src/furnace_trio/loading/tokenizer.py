"""The model's tokenizer: one class, :class:`Tokenizer`, over Hugging Face ``tokenizers``,
whatever the source, so the rest of the server never asks where the model came from.

- :meth:`Tokenizer.from_hf_directory`: a Hugging Face directory's files
  (:mod:`furnace_trio.loading.hf_tokenizer`).
- :meth:`Tokenizer.from_gguf` / :meth:`Tokenizer.from_gguf_fields`: a GGUF's vocabulary
  (:mod:`furnace_trio.loading.gguf_vocab`).
- Each id's bytes and the decode table: :mod:`furnace_trio.loading.token_bytes`.

BOS handling: ``encode(text)`` adds BOS exactly when the model says so
(``add_bos_token``), never twice; chat prompts are rendered to text with
:meth:`Tokenizer.apply_chat_template` (which writes any BOS the template wants as text)
and encoded with ``add_special_tokens=False``.

Special tokens: ``encode`` turns special-token texts into their ids (a raw prompt may
write ``<|im_start|>`` on purpose). A conversation is rendered with its client strings
protected (:mod:`furnace_trio.text.special_text`) and encoded by :meth:`encode_chat`, so
only the template's own markers become special tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from furnace_trio.loading.gguf_vocab import gguf_tokenizer, read_gguf_metadata
from furnace_trio.loading.hf_tokenizer import read_hf_tokenizer
from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.loading.token_bytes import TokenBytes
from furnace_trio.loading.tokenizer_parts import TokenizerParts
from furnace_trio.text.chat_template import ChatTemplateError, compile_chat_template
from furnace_trio.text.special_text import ChatText, SpecialTexts, new_marker

logger = logging.getLogger(__name__)

# Texts of control tokens that end a generation, whatever the metadata names as EOS
# (llama.cpp applies the same list): a chat model ends its turn with one and may emit
# another (SmolLM2 names <|im_end|> as EOS but can still emit <|endoftext|>).
EOS_LIKE_TOKENS = frozenset(
    {
        "</s>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|return|>",
        "<|call|>",
        "<EOT>",
        "<|END_OF_TURN_TOKEN|>",
        "<|endofturn|>",
        "<|end▁of▁sentence|>",
    }
)


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model.

    Invariants: ``eos_token_ids`` holds every id that ends a generation (never empty when
    the model names an EOS); ``encode`` adds at most one BOS, and only when
    ``add_bos_token`` says so; ``decode`` never raises on ids the vocabulary lacks (they
    decode to nothing), so a model whose embedding table is padded past the vocabulary
    cannot crash detokenization. Thread-safe for concurrent encode/decode.
    """

    __slots__ = (
        "_bytes",
        "_eos_token",
        "_hf",
        "_post_adds_bos",
        "add_bos_token",
        "bos_token_id",
        "chat_marker",
        "chat_template",
        "eos_token_ids",
        "special_texts",
        "vocab_size",
    )

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool,
        chat_template: str | None,
    ) -> None:
        self._hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if value is not None and not 0 <= value < self.vocab_size:
                raise UnsupportedModelError(
                    f"{name} {value} is outside the vocabulary (size {self.vocab_size})"
                )
        self.bos_token_id: int | None = bos_token_id
        self.add_bos_token: bool = add_bos_token and bos_token_id is not None
        self.chat_template: str | None = chat_template

        added = hf.get_added_tokens_decoder()
        self._bytes = TokenBytes(hf)
        #: What client text in a conversation must not become (see :meth:`encode_chat`).
        self.special_texts = SpecialTexts.of(t.content for t in added.values() if t.special)
        #: The marker of every rendering by this tokenizer: random per process, so no
        #: client can predict it, and fixed, so a session's history renders the same.
        self.chat_marker = new_marker()
        eos: set[int] = set()
        if eos_token_id is not None:
            eos.add(eos_token_id)
        eos.update(i for i in extra_eos_token_ids if 0 <= i < self.vocab_size)
        eos.update(i for i, t in added.items() if t.special and t.content in EOS_LIKE_TOKENS)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._eos_token: str | None = (
            hf.id_to_token(eos_token_id) if eos_token_id is not None else None
        )
        probe = hf.encode("", add_special_tokens=True).ids
        self._post_adds_bos = bool(probe) and probe[0] == bos_token_id
        if self.chat_template is not None:
            try:
                compile_chat_template(self.chat_template)
            except ChatTemplateError as exc:
                logger.warning("the model's chat template does not compile: %s", exc)

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def of(cls, parts: TokenizerParts) -> Tokenizer:
        """The tokenizer of what a source's reader found."""
        return cls(
            parts.hf,
            bos_token_id=parts.bos_token_id,
            eos_token_id=parts.eos_token_id,
            extra_eos_token_ids=parts.extra_eos_token_ids,
            add_bos_token=parts.add_bos_token,
            chat_template=parts.chat_template,
        )

    @classmethod
    def from_hf_directory(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json`` when present) from a Hugging Face model directory."""
        return cls.of(read_hf_tokenizer(path))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer from a GGUF file's ``tokenizer.*`` metadata.

        Reads only the metadata section (no tensors), with a small parser of its own:
        ``gguf.GGUFReader`` takes seconds on a 49k-token vocabulary.
        """
        return cls.from_gguf_fields(read_gguf_metadata(path, prefix="tokenizer."))

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """Build from already-read GGUF metadata (``{"tokenizer.ggml.model": "gpt2", ...}``).

        Split out from :meth:`from_gguf` so a loader that has the reader open does not
        parse the file twice.
        """
        return cls.of(gguf_tokenizer(fields))

    # -- encoding and decoding ----------------------------------------------------------

    @property
    def eos_token(self) -> str | None:
        """The EOS token's text (as the chat template gets it)."""
        return self._eos_token

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text, if the model has one."""
        return None if self.bos_token_id is None else self._hf.id_to_token(self.bos_token_id)

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for saving or inspection; do not mutate)."""
        return self._hf

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token texts (``<|im_start|>``) become their ids.

        With ``add_special_tokens`` a BOS is prepended iff the model asks for one.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, not {type(text).__name__}")
        ids: list[int] = self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens or self.bos_token_id is None:
            return ids
        if self._post_adds_bos and not self.add_bos_token and ids and ids[0] == self.bos_token_id:
            return ids[1:]
        if self.add_bos_token and not self._post_adds_bos:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 (a character cut between tokens) becomes U+FFFD."""
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI logprobs' ``bytes``); may be a
        fragment of a UTF-8 character. Unknown ids give ``b""``."""
        return self._bytes.of(token_id)

    def decode_table(self) -> list[bytes] | None:
        """The bytes each id adds to :meth:`decode` (special tokens skipped, its default)
        where ``decode(ids)`` is those bytes concatenated and read as UTF-8, invalid bytes
        replaced: vocabularies whose decoder is byte-level BPE's alone (GPT-2's and
        SmolLM2's, for example). ``None`` for any other, or where an entry does not give
        what decoding its id alone gives. For
        :class:`~furnace_trio.text.detokenizer.ByteDetokenizer`; one pass over the vocabulary
        (about 50 ms for SmolLM2's 49,152 ids)."""
        return self._bytes.decode_table(self.vocab_size)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry given its text (e.g. ``"<|im_end|>"``), or ``None``."""
        return self._hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary entry of ``token_id`` as stored (byte-level alphabet), or ``None``."""
        return self._hf.id_to_token(token_id)

    # -- chat -------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text with the model's chat template.

        Encode the result with ``encode(text, add_special_tokens=False)``: the template
        writes BOS itself when the model wants one. Raises ``ValueError`` when the model
        has no template or the template fails (``ChatTemplateError``).
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use the completions endpoint")
        return compile_chat_template(self.chat_template).render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token,
            eos_token=self._eos_token,
            **kwargs,
        )

    def encode_chat(self, chat: ChatText, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of a rendered conversation, one marker-separated segment at a time
        (see :mod:`furnace_trio.text.special_text`): special-token texts the client wrote
        stay text. ``add_special_tokens`` applies to the first segment (a BOS)."""
        ids: list[int] = []
        for index, segment in enumerate(chat.segments):
            ids += self.encode(segment, add_special_tokens=add_special_tokens and index == 0)
        return ids

    def render_and_encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """The prompt ids of a conversation: its strings protected, rendered with
        :meth:`apply_chat_template`, then :meth:`encode_chat`."""
        marker = self.chat_marker
        text = self.apply_chat_template(
            self.special_texts.protect(messages, marker),
            add_generation_prompt=add_generation_prompt,
            tools=self.special_texts.protect(tools, marker),
            **kwargs,
        )
        return self.encode_chat(ChatText(text, marker))

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={sorted(self.eos_token_ids)}, add_bos_token={self.add_bos_token})"
        )


__all__ = ["EOS_LIKE_TOKENS", "Tokenizer"]
