"""The messages the engine task sends a request's stream over its memory channel.

Internal to the engine package: raw sampled tokens and ends, which the stream turns into
text in the consumer's task (so detokenization costs the engine loop nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from furnace_trio.core.plan import SampledToken
from furnace_trio.engine.events import Admitted, Failed
from furnace_trio.engine.scheduler import FinishReason

__all__ = ["Finish", "Message", "PromptScores", "Tokens"]


@dataclass(frozen=True, slots=True)
class Tokens:
    """Tokens of sample ``index``, in order: one, or up to ``stream_interval`` held back."""

    index: int
    tokens: tuple[SampledToken, ...]
    #: Speculative decoding since the sample's previous message: drafts run, accepted.
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True, slots=True)
class Finish:
    """Sample ``index`` ended (its held-back tokens went out before this)."""

    index: int
    reason: FinishReason


@dataclass(frozen=True, slots=True)
class PromptScores:
    """The scored prompt tokens of sample ``index`` (``prompt_logprobs``), before its first
    token."""

    index: int
    scores: tuple[SampledToken, ...]


#: Everything the engine sends a stream. Admitted and Failed reach the consumer as they
#: are; the stream turns the others into Delta and Finished events.
Message = Admitted | Failed | Tokens | Finish | PromptScores
