"""Engine metrics: Prometheus-style histograms, counters, and the frozen snapshot the engine
hands out (:meth:`furnace_trio.engine.Engine.statistics`).

All durations are seconds measured with ``trio.current_time()`` by the engine, so tests can
drive them with ``autojump_clock``. Plain Python: rendering to the Prometheus text format
belongs to the HTTP layer.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from furnace_trio.engine.pacing import PacingStatus

#: Latencies from a millisecond (a decode step on a GPU) to a minute (a long queue).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0,
)  # fmt: skip

#: Speculative decoding: a request's accepted share of its drafts.
RATIO_BUCKETS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
#: Speculative decoding: tokens a drafting sequence got from one step.
STEP_TOKEN_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)

#: Request outcomes counted in :attr:`EngineStatistics.requests`.
OUTCOMES: tuple[str, ...] = ("finished_stop", "finished_length", "aborted", "failed", "rejected")


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """``counts[i]`` observations were ``<= bounds[i]``; the last entry of ``counts`` is
    the ``+Inf`` bucket, equal to ``count`` (Prometheus's cumulative ``le`` buckets)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int


class Histogram:
    """Fixed buckets, O(log buckets) per observation."""

    __slots__ = ("_bounds", "_buckets", "_count", "_sum")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        bounds = tuple(float(b) for b in bounds)
        if not bounds or any(b >= c for b, c in itertools.pairwise(bounds)):
            raise ValueError("histogram bounds must be non-empty and strictly increasing")
        self._bounds = bounds
        self._buckets = [0] * (len(bounds) + 1)  # per bucket, not cumulative; last is +Inf
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        self._buckets[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value
        self._count += 1

    def snapshot(self) -> HistogramSnapshot:
        cumulative: list[int] = []
        total = 0
        for n in self._buckets:
            total += n
            cumulative.append(total)
        return HistogramSnapshot(self._bounds, tuple(cumulative), self._sum, self._count)


def _no_outcomes() -> Mapping[str, int]:
    return MappingProxyType(dict.fromkeys(OUTCOMES, 0))


def _empty(bounds: Sequence[float] = LATENCY_BUCKETS) -> HistogramSnapshot:
    return Histogram(bounds).snapshot()


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of the engine. ``running`` counts sequences (``n`` per request).

    KV accounting, for leak checks: ``kv_blocks_used`` blocks have references
    (``kv_block_refs`` of them in all: running sequences, session pins, finished turns not
    yet committed); ``kv_blocks_cached`` more hold reusable prefix-cache KV that no one
    references. When idle (nothing running, waiting, in flight or in an open turn), every
    reference is a session pin: ``kv_block_refs == session_pinned_blocks``.
    """

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    requests: Mapping[str, int] = field(default_factory=_no_outcomes)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    time_to_first_token: HistogramSnapshot = field(default_factory=_empty)
    inter_token_latency: HistogramSnapshot = field(default_factory=_empty)
    e2e_latency: HistogramSnapshot = field(default_factory=_empty)
    queue_time: HistogramSnapshot = field(default_factory=_empty)
    prefill_step_time: HistogramSnapshot = field(default_factory=_empty)
    decode_step_time: HistogramSnapshot = field(default_factory=_empty)
    alive: bool = True
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of which were found (reused, not computed)
    sessions: int = 0
    session_pinned_blocks: int = 0
    kv_blocks_cached: int = 0  # unreferenced prefix-cache blocks (evictable)
    kv_blocks_reserved: int = 0  # set aside for admitted requests, not yet allocated
    kv_blocks_evicted_total: int = 0  # cached blocks handed out again for new KV
    kv_block_refs: int = 0  # references held on blocks (a shared block counts per owner)
    requests_in_flight: int = 0  # accepted, not yet finished, failed or aborted
    turns_open: int = 0  # session turns whose request has not ended
    requests_paused: int = 0  # running requests waiting for their client to read
    pauses_total: int = 0  # times a request paused so (see engine/backlog.py)
    #: Aborted while queued: the client left before admission (the log's 499s among them).
    requests_cancelled_before_admission_total: int = 0
    steps_total: int = 0  # model steps run (a failed step and its re-runs count once)
    pacing: PacingStatus | None = None  # the prefill pacer's estimates, when it paces
    spec_drafted_tokens_total: int = 0  # speculative drafts run
    spec_accepted_tokens_total: int = 0  # of which verification kept
    #: Per request that drafted: accepted / drafted.
    spec_acceptance: HistogramSnapshot = field(default_factory=lambda: _empty(RATIO_BUCKETS))
    #: Per drafted step of a sequence: the tokens it got (accepted drafts + 1).
    spec_tokens_per_step: HistogramSnapshot = field(
        default_factory=lambda: _empty(STEP_TOKEN_BUCKETS)
    )
    #: Tokens a mixture-of-experts model routed to each expert, one tuple per layer (empty
    #: for dense layers; empty altogether for a dense model or a runner that does not say).
    expert_tokens: tuple[tuple[int, ...], ...] = ()

    @property
    def idle(self) -> bool:
        """Nothing running, queued, in flight or in an open session turn."""
        return not (self.running or self.waiting or self.requests_in_flight or self.turns_open)

    def leaks(self) -> list[str]:
        """What an idle engine should not hold (empty when nothing leaked). Only
        meaningful when :attr:`idle`; a busy engine holds references legitimately."""
        found = []
        if self.kv_block_refs != self.session_pinned_blocks:
            found.append(
                f"{self.kv_block_refs} KV block references held, "
                f"{self.session_pinned_blocks} of them by sessions"
            )
        if self.kv_blocks_used > self.session_pinned_blocks:
            found.append(
                f"{self.kv_blocks_used} KV blocks in use, sessions pin {self.session_pinned_blocks}"
            )
        return found


@dataclass(slots=True)
class EngineMetrics:
    """The engine's mutable counters; :meth:`snapshot` freezes them."""

    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    time_to_first_token: Histogram = field(default_factory=Histogram)
    inter_token_latency: Histogram = field(default_factory=Histogram)
    e2e_latency: Histogram = field(default_factory=Histogram)
    queue_time: Histogram = field(default_factory=Histogram)
    prefill_step_time: Histogram = field(default_factory=Histogram)
    decode_step_time: Histogram = field(default_factory=Histogram)
    pauses_total: int = 0
    cancelled_before_admission: int = 0
    spec_drafted_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_acceptance: Histogram = field(default_factory=lambda: Histogram(RATIO_BUCKETS))
    spec_tokens_per_step: Histogram = field(default_factory=lambda: Histogram(STEP_TOKEN_BUCKETS))

    def count(self, outcome: str) -> None:
        if outcome not in self.outcomes:
            raise ValueError(f"unknown outcome {outcome!r}")
        self.outcomes[outcome] += 1

    def snapshot(
        self,
        *,
        running: int,
        waiting: int,
        kv_used: int,
        kv_total: int,
        alive: bool,
        prefix_queries: int = 0,
        prefix_hits: int = 0,
        sessions: int = 0,
        session_pinned_blocks: int = 0,
        kv_blocks_cached: int = 0,
        kv_blocks_reserved: int = 0,
        kv_blocks_evicted: int = 0,
        kv_block_refs: int = 0,
        requests_in_flight: int = 0,
        turns_open: int = 0,
        requests_paused: int = 0,
        steps_total: int = 0,
        pacing: PacingStatus | None = None,
        expert_tokens: tuple[tuple[int, ...], ...] = (),
    ) -> EngineStatistics:
        return EngineStatistics(
            running=running,
            waiting=waiting,
            kv_blocks_used=kv_used,
            kv_blocks_total=kv_total,
            requests=MappingProxyType(dict(self.outcomes)),
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            time_to_first_token=self.time_to_first_token.snapshot(),
            inter_token_latency=self.inter_token_latency.snapshot(),
            e2e_latency=self.e2e_latency.snapshot(),
            queue_time=self.queue_time.snapshot(),
            prefill_step_time=self.prefill_step_time.snapshot(),
            decode_step_time=self.decode_step_time.snapshot(),
            alive=alive,
            prefix_cache_queries_total=prefix_queries,
            prefix_cache_hits_total=prefix_hits,
            sessions=sessions,
            session_pinned_blocks=session_pinned_blocks,
            kv_blocks_cached=kv_blocks_cached,
            kv_blocks_reserved=kv_blocks_reserved,
            kv_blocks_evicted_total=kv_blocks_evicted,
            kv_block_refs=kv_block_refs,
            requests_in_flight=requests_in_flight,
            turns_open=turns_open,
            requests_paused=requests_paused,
            pauses_total=self.pauses_total,
            requests_cancelled_before_admission_total=self.cancelled_before_admission,
            steps_total=steps_total,
            pacing=pacing,
            spec_drafted_tokens_total=self.spec_drafted_tokens_total,
            spec_accepted_tokens_total=self.spec_accepted_tokens_total,
            spec_acceptance=self.spec_acceptance.snapshot(),
            spec_tokens_per_step=self.spec_tokens_per_step.snapshot(),
            expert_tokens=expert_tokens,
        )
