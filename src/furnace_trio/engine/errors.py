"""The errors :meth:`~furnace_trio.engine.Engine.submit` raises, and the checks that raise
them: :func:`check_request` (a request's own shape) and :func:`check_room` (the queue).

Each error maps to one HTTP answer (the HTTP layer does the mapping), so the engine says
what went wrong without knowing about status codes.
"""

from __future__ import annotations

from furnace_trio.engine.events import GenerationRequest
from furnace_trio.engine.sessions import TurnState

__all__ = [
    "EngineBusy",
    "EngineError",
    "EngineUnavailable",
    "RequestRejected",
    "RequestTooLarge",
    "check_request",
    "check_room",
]


class EngineError(Exception):
    """Base of the errors :meth:`Engine.submit` raises."""


class EngineBusy(EngineError):
    """The wait queue is full: HTTP 503 with ``Retry-After``."""


class RequestRejected(EngineError, ValueError):
    """Bad input (empty prompt, longer than the context): HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTooLarge(EngineError):
    """The request could never fit the KV pool (or ``max_running``): HTTP 503, no retry."""


class EngineUnavailable(EngineError):
    """Not started, dead, or shutting down: HTTP 503."""


def check_request(
    request: GenerationRequest,
    *,
    max_context: int,
    max_running: int,
    blocks_needed: int,
    num_blocks: int,
    id_in_use: bool,
) -> None:
    """Refuse a request that no engine state could serve: an empty prompt, one longer than
    the context, more samples or KV blocks than the server has, a session turn that is
    not open or asks for ``n > 1``; ``id_in_use``: the request's id is taken."""
    prompt = request.prompt_token_ids
    params = request.params
    if not prompt:
        raise RequestRejected("the prompt is empty", param="prompt")
    if len(prompt) >= max_context:
        raise RequestRejected(
            f"the prompt has {len(prompt)} tokens; the context holds {max_context}",
            param="prompt",
        )
    if len(prompt) + params.max_tokens > max_context:
        raise RequestRejected(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"the context of {max_context} tokens",
            param="max_tokens",
        )
    if params.n > max_running:
        raise RequestTooLarge(f"n={params.n} exceeds the {max_running} sequences this server runs")
    if blocks_needed > num_blocks:
        raise RequestTooLarge(
            f"the request needs {blocks_needed} KV blocks; the server has {num_blocks}"
        )
    if id_in_use:
        raise RequestRejected(f"request id {request.request_id!r} is in use", param=None)
    turn = request.turn
    if turn is not None:
        if params.n != 1:
            raise RequestRejected("a session turn samples one choice (n=1)", param="n")
        if turn.state is not TurnState.OPEN or turn.request_id is not None:
            raise RequestRejected("this session turn has a request already", param=None)


def check_room(waiting: int, max_waiting: int, num_sequences: int) -> None:
    """Raise :class:`EngineBusy` unless a queue of ``waiting`` sequences, which holds
    ``max_waiting``, can take ``num_sequences`` more."""
    if waiting + num_sequences > max_waiting:
        raise EngineBusy(
            f"{waiting} sequences are waiting, and the queue holds "
            f"{max_waiting}; this request needs {num_sequences}"
        )
