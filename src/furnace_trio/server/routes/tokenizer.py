"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` with vLLM's bodies.

What clients such as lm-evaluation-harness use to tokenize with the served model's own
tokenizer instead of downloading one. The paths are outside ``/v1`` (where vLLM has them)
and behind the API key like it.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import trio
from quart_trio import QuartTrio

from furnace_trio.server.chat_prompt import render_messages
from furnace_trio.server.protocol import max_prompt_chars
from furnace_trio.server.routes.common import check_model, read_body
from furnace_trio.server.state import ServerState
from furnace_trio.server.tokenizer_request import (
    TokenizeRequest,
    parse_detokenize_request,
    parse_tokenize_request,
)

if TYPE_CHECKING:
    from furnace_trio.server.backend import Backend

#: Outside ``/v1`` (where vLLM has them) and behind the API key like it.
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})


def register(app: QuartTrio, state: ServerState) -> None:
    """``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` with vLLM's bodies: what
    clients such as lm-evaluation-harness use to tokenize with the served model's own
    tokenizer instead of downloading one."""

    @app.post("/tokenize")
    async def tokenize() -> dict[str, Any]:
        body = await read_body()
        backend = state.serving_backend()
        parsed = await state.off_loop.parse(
            partial(
                parse_tokenize_request, body, max_prompt_chars=max_prompt_chars(backend.max_context)
            )
        )
        check_model(backend, parsed.model)
        tokens = await trio.to_thread.run_sync(_tokenize, backend, parsed)
        out: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": backend.max_context,
            "tokens": tokens,
        }
        if parsed.return_token_strs:
            out["token_strs"] = [backend.tokenizer.id_to_token(t) for t in tokens]
        return out

    @app.post("/detokenize")
    async def detokenize() -> dict[str, Any]:
        body = await read_body()
        backend = state.serving_backend()
        model, ids = await state.off_loop.parse(
            partial(parse_detokenize_request, body, vocab_size=backend.tokenizer.vocab_size)
        )
        check_model(backend, model)
        text = await trio.to_thread.run_sync(_detokenize, backend, ids)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        backend = state.serving_backend()
        tokenizer = backend.tokenizer
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": None,
            "add_bos_token": tokenizer.add_bos_token,
            "chat_template": tokenizer.chat_template,
            "model_max_length": backend.max_context,
        }


def _tokenize(backend: Backend, parsed: TokenizeRequest) -> list[int]:
    """A prompt's token ids, or a conversation's as the chat template renders it.

    A raw ``prompt`` parses special-token texts (``<|im_start|>``) into their ids, as
    completions' ``prompt`` does; in ``messages`` they stay text, as in chat."""
    if parsed.messages is not None:
        chat = render_messages(
            backend, parsed.messages, add_generation_prompt=parsed.add_generation_prompt
        )
        return backend.tokenizer.encode_chat(chat, add_special_tokens=parsed.add_special_tokens)
    assert parsed.prompt is not None  # the parser gives exactly one of the two
    return backend.tokenizer.encode(parsed.prompt, add_special_tokens=parsed.add_special_tokens)


def _detokenize(backend: Backend, ids: tuple[int, ...]) -> str:
    """The text of ``ids``, special tokens included (it round-trips ``/tokenize``)."""
    return backend.tokenizer.decode(ids, skip_special_tokens=False)
