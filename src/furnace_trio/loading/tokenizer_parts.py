"""What a :class:`~furnace_trio.loading.tokenizer.Tokenizer` is made of, whatever its
source: each source's reader (:mod:`.hf_tokenizer`, :mod:`.gguf_vocab`) returns one."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer


@dataclass(frozen=True, slots=True)
class TokenizerParts:
    """A Hugging Face ``tokenizers`` tokenizer and what the model says around it: its BOS
    and EOS ids (``extra_eos_token_ids``: more ids that end a generation), whether a
    prompt starts with BOS, and its chat template."""

    hf: HFTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    extra_eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    chat_template: str | None
