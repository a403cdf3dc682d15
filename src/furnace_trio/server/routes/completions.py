"""``POST /v1/completions``: one prompt or a batch (text or token ids), with ``echo``.

Text prompts are tokenized, and token prompts decoded for ``echo``, in a worker thread.
The prompts of a batch are read together in the app's nursery (a response body cannot
hold a nursery of its own across a ``yield``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import trio
from quart import Response
from quart_trio import QuartTrio

from furnace_trio.server.completion_request import parse_completion_request
from furnace_trio.server.generation import generate
from furnace_trio.server.routes.common import config_of, read_generation
from furnace_trio.server.state import ServerState

if TYPE_CHECKING:
    from furnace_trio.server.backend import Backend


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions() -> Response:
        parse = partial(
            parse_completion_request,
            max_sequences=config_of(state).sequences_per_request,
        )
        backend, parsed = await read_generation(state, parse)
        prompts = parsed.prompts
        if any(isinstance(prompt, str) for prompt in prompts):
            prompt_ids = await trio.to_thread.run_sync(_encode_prompts, backend, prompts)
        else:
            prompt_ids = tuple(prompt for prompt in prompts if not isinstance(prompt, str))
        echo = None
        if parsed.echo:  # token prompts are decoded (off the event loop)
            texts = tuple(prompt for prompt in prompts if isinstance(prompt, str))
            if len(texts) < len(prompts):
                texts = await trio.to_thread.run_sync(_echo_texts, backend, prompts)
            echo = texts
        return await generate(
            backend, "completion", parsed, prompt_ids, "prompt", nursery=app.nursery, echo=echo
        )


def _encode_prompts(
    backend: Backend, prompts: Sequence[str | tuple[int, ...]]
) -> tuple[tuple[int, ...], ...]:
    """Token ids for every prompt: text is encoded, ids pass through."""
    return tuple(
        tuple(backend.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, str)
        else prompt
        for prompt in prompts
    )


def _echo_texts(backend: Backend, prompts: Sequence[str | tuple[int, ...]]) -> tuple[str, ...]:
    """What ``echo`` returns of each prompt: its text as sent, or its token ids decoded."""
    return tuple(p if isinstance(p, str) else backend.engine.decode(p) for p in prompts)
