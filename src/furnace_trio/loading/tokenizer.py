"""The model's tokenizer: Hugging Face ``tokenizers`` built from ``tokenizer.json`` or a GGUF.

One class, :class:`Tokenizer`, whatever the source, so the rest of the server never asks
where the model came from. Two constructors:

- :meth:`Tokenizer.from_hf_directory`: ``tokenizer.json`` as is, ``tokenizer_config.json``
  for BOS/EOS, ``add_bos_token``, added tokens and the chat template (a
  ``chat_template.jinja`` file overrides it), ``generation_config.json`` for extra EOS ids.
- :meth:`Tokenizer.from_gguf`: a byte-level BPE rebuilt from the GGUF metadata (tokens,
  merges, token types) with the pre-tokenizer named by ``tokenizer.ggml.pre``. The split
  rules per name follow llama.cpp's ``llama-vocab.cpp``, which reproduces each model's
  original ``tokenizer.json``. Note that ``transformers`` ignores ``smollm`` (it falls
  back to plain GPT-2 splitting): SmolLM2 was trained with single-digit splitting
  *before* the GPT-2 regex, which we keep, so the two differ on whitespace followed by a
  digit (``"a  1"``). A SentencePiece (``llama``) GGUF vocabulary, Gemma's for one, becomes
  a BPE ranked by the tokens' scores (:mod:`furnace_trio.loading.spm_vocab`).

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

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from furnace_trio.loading.gguf_file import read_gguf
from furnace_trio.loading.model_config import UnsupportedModelError
from furnace_trio.loading.spm_vocab import build_spm_tokenizer
from furnace_trio.text.chat_template import ChatTemplateError, compile_chat_template
from furnace_trio.text.special_text import ChatText, SpecialTexts, new_marker

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

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


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path} does not hold a JSON object")
    return data


def _pick_chat_template(value: Any) -> str | None:
    """``chat_template`` is a string, or a list of ``{"name", "template"}`` (use "default")."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {
            item["name"]: item["template"]
            for item in value
            if isinstance(item, Mapping) and isinstance(item.get("template"), str)
        }
        return named.get("default") or next(iter(named.values()), None)
    return None


def _int_ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model.

    Invariants: ``eos_token_ids`` holds every id that ends a generation (never empty when
    the model names an EOS); ``encode`` adds at most one BOS, and only when
    ``add_bos_token`` says so; ``decode`` never raises on ids the vocabulary lacks (they
    decode to nothing), so a model whose embedding table is padded past the vocabulary
    cannot crash detokenization. Thread-safe for concurrent encode/decode.
    """

    __slots__ = (
        "_added_bytes",
        "_byte_level",
        "_byte_level_only",
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
        self._added_bytes: dict[int, bytes] = {i: t.content.encode() for i, t in added.items()}
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
        decoder = json.loads(hf.to_str()).get("decoder") or {}
        self._byte_level = "ByteLevel" in json.dumps(decoder)
        self._byte_level_only = decoder.get("type") == "ByteLevel"
        probe = hf.encode("", add_special_tokens=True).ids
        self._post_adds_bos = bool(probe) and probe[0] == bos_token_id
        if self.chat_template is not None:
            try:
                compile_chat_template(self.chat_template)
            except ChatTemplateError as exc:
                logger.warning("the model's chat template does not compile: %s", exc)

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def from_hf_directory(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json`` when present) from a Hugging Face model directory."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise UnsupportedModelError(f"{root} has no tokenizer.json")
        try:
            hf = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception on bad files
            raise UnsupportedModelError(f"cannot load {tokenizer_file}: {exc}") from exc

        config_file = root / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        _add_config_tokens(hf, config.get("added_tokens_decoder"))

        def token_id(key: str) -> int | None:
            content = _token_content(config.get(key))
            return hf.token_to_id(content) if content is not None else None

        bos_token_id = token_id("bos_token")
        eos_token_id = token_id("eos_token")
        extra_eos: list[int] = []
        generation_file = root / "generation_config.json"
        if generation_file.is_file():
            generation = _read_json(generation_file)
            extra_eos = _int_ids(generation.get("eos_token_id"))
            if bos_token_id is None:
                bos_ids = _int_ids(generation.get("bos_token_id"))
                bos_token_id = bos_ids[0] if bos_ids else None
            if eos_token_id is None and extra_eos:
                eos_token_id = extra_eos[0]

        chat_template = _pick_chat_template(config.get("chat_template"))
        jinja_file = root / "chat_template.jinja"
        json_template_file = root / "chat_template.json"
        if jinja_file.is_file():
            chat_template = jinja_file.read_text(encoding="utf-8")
        elif json_template_file.is_file():
            chat_template = (
                _pick_chat_template(_read_json(json_template_file).get("chat_template"))
                or chat_template
            )

        add_bos = config.get("add_bos_token")
        probe = hf.encode("", add_special_tokens=True).ids
        post_adds_bos = bool(probe) and probe[0] == bos_token_id
        return cls(
            hf,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            extra_eos_token_ids=extra_eos,
            # Unset: trust tokenizer.json's post-processor, as transformers does.
            add_bos_token=post_adds_bos if add_bos is None else bool(add_bos),
            chat_template=chat_template,
        )

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
        return cls(
            hf,
            bos_token_id=opt_id("tokenizer.ggml.bos_token_id"),
            eos_token_id=opt_id("tokenizer.ggml.eos_token_id"),
            extra_eos_token_ids=extra_eos,
            add_bos_token=bool(add_bos),
            chat_template=template if isinstance(template, str) and template else None,
        )

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
        added = self._added_bytes.get(token_id)
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

    def decode_table(self) -> list[bytes] | None:
        """The bytes each id adds to :meth:`decode` (special tokens skipped, its default)
        where ``decode(ids)`` is those bytes concatenated and read as UTF-8, invalid bytes
        replaced: vocabularies whose decoder is byte-level BPE's alone (GPT-2's and
        SmolLM2's, for example). ``None`` for any other, or where an entry does not give
        what decoding its id alone gives. For
        :class:`~furnace_trio.text.detokenizer.ByteDetokenizer`; one pass over the vocabulary
        (about 50 ms for SmolLM2's 49,152 ids)."""
        if not self._byte_level_only:
            return None
        hf = self._hf
        texts = hf.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=True)
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


def _add_config_tokens(hf: HFTokenizer, added_tokens_decoder: Any) -> None:
    """Make sure tokens listed in tokenizer_config.json's ``added_tokens_decoder`` match
    whole (tokenizer.json normally lists them already; older exports sometimes do not)."""
    if not isinstance(added_tokens_decoder, Mapping):
        return
    known = {t.content for t in hf.get_added_tokens_decoder().values()}
    for raw_id, spec in added_tokens_decoder.items():
        content = _token_content(spec)
        if content is None or content in known:
            continue
        special = bool(spec.get("special", True)) if isinstance(spec, Mapping) else True
        token = AddedToken(content, special=special, normalized=False)
        if special:
            hf.add_special_tokens([token])
        else:
            hf.add_tokens([token])
        got = hf.token_to_id(content)
        if str(got) != str(raw_id):
            logger.warning("added token %r got id %s, config says %s", content, got, raw_id)


__all__ = [
    "EOS_LIKE_TOKENS",
    "SUPPORTED_GGUF_PRE_TOKENIZERS",
    "Tokenizer",
    "read_gguf_metadata",
]
