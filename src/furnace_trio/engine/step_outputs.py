"""What a scheduled step is, and what applying its results yields.

:class:`ScheduledStep` is the plan the scheduler hands the engine, with the counts the
engine's metrics need; :class:`SampleOutput` is one sample's token (or end) after the
scheduler applied a step's results. Frozen records of plain data, shared by the scheduler,
the engine and the :class:`~furnace_trio.engine.delivery.Outbox` (re-exported by
:mod:`~furnace_trio.engine.scheduler`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from furnace_trio.core.plan import SampledToken, StepPlan

__all__ = ["FinishReason", "SampleOutput", "ScheduledStep", "StepMismatch"]


class StepMismatch(ValueError):
    """The runner's tokens do not answer the plan's samples (a runner bug, not ours)."""


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """A plan plus what the engine needs to know about it."""

    plan: StepPlan
    admitted: tuple[str, ...]  # requests whose prefill starts in this step
    cached_tokens: tuple[int, ...]  # per admitted request: prompt tokens from the cache
    request_ids: tuple[str, ...]  # every request with a chunk in the plan
    num_prefill_tokens: int
    num_decode_tokens: int
    num_draft_tokens: int = 0  # speculative drafts among the chunks (not in the two above)


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """A sampled token of sample ``index`` of a request, and whether that sample finished.

    ``token`` is ``None`` when the sampled token ends the sample without being part of the
    output (an EOS or a ``stop_token_ids`` token).
    """

    request_id: str
    index: int
    token: SampledToken | None
    finish: FinishReason | None
    #: The prompt's scores (``prompt_logprobs``), with each sample's first token, even
    #: one that is not output.
    prompt_logprobs: tuple[SampledToken, ...] | None = None
    #: Speculation, on the first output of a drafted chunk: drafts run, drafts accepted.
    drafted: int = 0
    accepted: int = 0
