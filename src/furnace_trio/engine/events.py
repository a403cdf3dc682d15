"""What goes into the engine (:class:`GenerationRequest`) and what comes out of a
:class:`~furnace_trio.engine.stream.RequestStream` (the :data:`Event`\\ s).

Frozen dataclasses with no behaviour: the HTTP layer turns them into OpenAI responses,
the engine and the stream only build them.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Literal

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine.sessions import Turn

__all__ = [
    "Admitted",
    "Delta",
    "Event",
    "Failed",
    "FailureCause",
    "Finished",
    "GenerationRequest",
    "LogprobEntry",
    "TopLogprob",
]


@dataclass(frozen=True, slots=True)
class Admitted:
    """Once per request, when its prefill starts."""

    prompt_tokens: int
    cached_tokens: int
    queue_time: float


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    token: str
    token_id: int
    logprob: float | None  # None: an echoed prompt's first token
    bytes: tuple[int, ...] | None
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of sample ``index``, with every token id since the previous delta of it."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry, ...]
    #: With ``prompt_logprobs``, on the sample's first delta: the prompt's tokens after
    #: the first, scored.
    prompt_logprobs: tuple[LogprobEntry, ...] | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """Once per sample index; ``completion_tokens`` excludes an EOS/stop token."""

    index: int
    reason: Literal["stop", "length"]
    completion_tokens: int
    #: Speculative decoding: draft tokens the sample ran, and how many of them it kept.
    drafted_tokens: int = 0
    accepted_tokens: int = 0


class FailureCause(enum.Enum):
    """Why a request failed: its own model step (the server goes on), the engine (dead or
    stuck: nothing more will be served), or a shutdown that outlasted the drain."""

    MODEL = "model"
    ENGINE = "engine"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class Failed:
    """Terminal for the whole request."""

    message: str
    cause: FailureCause = FailureCause.MODEL


Event = Admitted | Delta | Finished | Failed


def _new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str = field(default_factory=_new_request_id)
    turn: Turn | None = None  # the session turn this request is (n == 1 only)
    # Its own limit on what it may hold unsent (None: the engine's max_response_bytes).
    max_response_bytes: int | None = None
