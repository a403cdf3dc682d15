"""Finding the request that made a model step raise, so that only it fails.

A step batches every running request, so one request's bad input (a constraint that
raises, a tensor it makes the wrong shape) fails the whole step. :func:`isolate` re-runs
the step's requests on the model thread in halves, recursively, until each failing
request runs alone; the requests of every sub-step that succeeded keep their tokens, and
the engine applies them as if the step had been just those requests::

    step [A B C D] raises
      [A B] ok -> tokens of A, B        [C D] raises
                                          [C] ok -> tokens of C    [D] raises -> D fails

Why re-running is safe. The scheduler changes nothing until a step succeeded
(:meth:`~furnace_trio.engine.scheduler.Scheduler.update`), so a sub-step's chunks are the
failed step's own: the same tokens at the same positions of the same blocks. A chunk's
positions belong to its sequence alone (a shared block is copied before anyone writes
into it), so writing them again writes the same keys and values, and what the failed
step wrote for a request that then fails lies in blocks freed without ever being
registered in the prefix cache. The step's block copies and releases run first, once, in
a step of no chunks: a copy must not run again after a sub-step wrote into its
destination. What a runner keeps per sequence must tolerate a re-run too (see
:class:`~furnace_trio.core.plan.StepRunner`).

Cost: a request that fails alone costs about ``2 log2(requests)`` extra steps; a runner
that fails whatever it runs costs ``2 * requests - 2`` and fails every request, each
with its own error. Nothing loops: each re-run has fewer requests than the one before.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from furnace_trio.core.plan import ChunkPlan, SampledToken, StepPlan

__all__ = ["Isolated", "StepAbandoned", "isolate", "run_isolating"]

logger = logging.getLogger(__name__)


class StepAbandoned(Exception):
    """A step that must not be re-run (the watchdog fired): :func:`isolate` lets it out."""


@dataclass(frozen=True, slots=True)
class Isolated:
    """What re-running a failed step found.

    ``plan`` holds the chunks that ran (in the failed step's order) and ``sampled`` their
    tokens; ``failures`` maps each request that failed alone to its error.
    """

    plan: StepPlan
    sampled: list[SampledToken]
    failures: dict[str, Exception]


RunStep = Callable[[StepPlan], Awaitable[list[SampledToken]]]


async def isolate(
    plan: StepPlan, request_of: Callable[[int], str | None], run: RunStep, error: Exception
) -> Isolated:
    """Re-run the failed ``plan`` (which raised ``error``) by requests, see the module
    docstring. ``request_of(seq_id)`` names a chunk's request, ``None`` for a sequence
    that is gone (aborted while the step ran: its chunks are dropped). ``run`` runs a
    plan on the model thread; :class:`StepAbandoned` from it propagates."""
    by_request: dict[str, list[ChunkPlan]] = {}
    for chunk in plan.chunks:
        request_id = request_of(chunk.seq_id)
        if request_id is not None:
            by_request.setdefault(request_id, []).append(chunk)
    groups = list(by_request.items())
    if plan.block_copies or plan.released:
        try:
            await run(StepPlan((), plan.block_copies, plan.released))
        except StepAbandoned:
            raise
        except Exception as exc:  # the step's bookkeeping itself fails: nobody can run
            return Isolated(StepPlan(()), [], {request_id: exc for request_id, _ in groups})
    finder = _Finder(run)
    if sum(len(chunks) for _, chunks in groups) < len(plan.chunks):
        await finder.search(groups)  # without the gone: run again as a whole first
    elif len(groups) == 1:
        finder.failures[groups[0][0]] = error  # it ran alone already
    else:
        await finder.split(groups)
    ran = [chunk for request_id, chunks in groups if request_id in finder.ran for chunk in chunks]
    return Isolated(StepPlan(tuple(ran)), finder.sampled, finder.failures)


async def run_isolating(
    plan: StepPlan, request_of: Callable[[int], str | None], run: RunStep
) -> Isolated:
    """Run ``plan``; when it raises, :func:`isolate` the requests that make it raise. The
    result's ``plan`` is ``plan`` itself when it ran whole (no failures)."""
    try:
        return Isolated(plan, await run(plan), {})
    except StepAbandoned:
        raise
    except Exception as exc:
        error = exc
    requests = {request_of(chunk.seq_id) for chunk in plan.chunks} - {None}
    logger.warning(
        "A model step of %d requests failed (%r); running them again apart", len(requests), error
    )
    isolated = await isolate(plan, request_of, run, error)
    for request_id, failure in isolated.failures.items():
        logger.warning("Request %s fails the model step: %r", request_id, failure, exc_info=failure)
    return isolated


class _Finder:
    """The bisection's state: requests whose sub-step ran, their tokens, the failures."""

    __slots__ = ("failures", "ran", "run", "sampled")

    def __init__(self, run: RunStep) -> None:
        self.run = run
        self.ran: set[str] = set()
        self.sampled: list[SampledToken] = []
        self.failures: dict[str, Exception] = {}

    async def search(self, groups: Sequence[tuple[str, list[ChunkPlan]]]) -> None:
        """Run ``groups`` as one step; if it raises, split it (a lone request fails)."""
        if not groups:
            return
        chunks = tuple(chunk for _, group in groups for chunk in group)
        try:
            sampled = await self.run(StepPlan(chunks))
        except StepAbandoned:
            raise
        except Exception as exc:
            if len(groups) == 1:
                self.failures[groups[0][0]] = exc
            else:
                await self.split(groups)
            return
        self.ran.update(request_id for request_id, _ in groups)
        self.sampled.extend(sampled)

    async def split(self, groups: Sequence[tuple[str, list[ChunkPlan]]]) -> None:
        half = len(groups) // 2
        await self.search(groups[:half])
        await self.search(groups[half:])
