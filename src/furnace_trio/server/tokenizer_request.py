"""``/tokenize`` and ``/detokenize`` bodies, as vLLM accepts them: a prompt or chat
messages to tokenize, token ids to turn back into text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from furnace_trio.server.chat_messages import parse_messages
from furnace_trio.server.errors import invalid_request
from furnace_trio.server.protocol import FieldBody, parse_json_body, parse_token_ids, too_long
from furnace_trio.server.schemas import DETOKENIZE_FIELDS, TOKENIZE_FIELDS


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """A validated ``/tokenize`` body: exactly one of ``prompt`` and ``messages``."""

    model: str | None
    prompt: str | None
    messages: tuple[Mapping[str, Any], ...] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


def parse_tokenize_request(body: bytes, *, max_prompt_chars: int | None = None) -> TokenizeRequest:
    """Validate a ``/tokenize`` body (vLLM's: a prompt, or chat messages)."""
    data = FieldBody(parse_json_body(body), TOKENIZE_FIELDS)
    prompt = data.get("prompt")
    raw_messages = data.raw("messages")
    if (prompt is None) == (raw_messages is None):
        raise invalid_request("give exactly one of prompt and messages", "prompt")
    messages = None
    if raw_messages is not None:
        messages = parse_messages(raw_messages, max_prompt_chars)
    elif max_prompt_chars is not None and len(prompt) > max_prompt_chars:
        raise too_long("prompt", len(prompt), max_prompt_chars)
    add_special_tokens = data.get("add_special_tokens")
    return TokenizeRequest(
        model=data.get("model") or None,
        prompt=prompt,
        messages=messages,
        add_special_tokens=messages is None if add_special_tokens is None else add_special_tokens,
        add_generation_prompt=data.get("add_generation_prompt"),
        return_token_strs=data.get("return_token_strs"),
    )


def parse_detokenize_request(body: bytes, *, vocab_size: int) -> tuple[str | None, tuple[int, ...]]:
    """Validate a ``/detokenize`` body: (model, token ids)."""
    data = FieldBody(parse_json_body(body), DETOKENIZE_FIELDS)
    tokens = data.raw("tokens")
    if tokens is None:
        raise invalid_request("tokens is required", "tokens")
    if not isinstance(tokens, list):
        raise invalid_request("tokens must be a list of token ids", "tokens")
    ids = parse_token_ids(tokens, vocab_size, "tokens", "tokens") if tokens else ()
    return data.get("model") or None, ids
