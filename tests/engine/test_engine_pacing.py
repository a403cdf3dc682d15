"""Prefill paced by step time in the engine: a scripted runner whose steps "take" a time
that grows with their tokens, on a fake clock the pacer reads (no real time measured).

A step of ``c`` chunks and ``t`` tokens takes ``2 ms + 0.1 ms * t + 0.4 ms * c``: 8
decodes alone take 6 ms, and a 20 ms target leaves room for about 136 prefill tokens.
"""

from __future__ import annotations

import threading

import trio

from furnace_trio.core.plan import SampledToken, StepPlan
from furnace_trio.engine import EngineConfig
from furnace_trio.engine.pacing import StepPacer

from ..scripted import ScriptedRunner, encode
from .harness import collect, collect_all, request, seq_ids_of, serving

TARGET_MS = 20.0
LONG = ("The quick brown fox jumps over the lazy dog. " * 34)[:1500]


class Clock:
    def __init__(self) -> None:
        self._now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def step_seconds(plan: StepPlan) -> float:
    tokens = sum(len(chunk.token_ids) for chunk in plan.chunks)
    return 0.002 + 0.0001 * tokens + 0.0004 * len(plan.chunks)


class TimedRunner(ScriptedRunner):
    """Each step advances ``clock`` by :func:`step_seconds` of its plan."""

    def __init__(self, clock: Clock, **kwargs: object) -> None:
        super().__init__(block_size=16, num_blocks=512, max_context=4096, **kwargs)  # type: ignore[arg-type]
        self.clock = clock

    def step(self, plan: StepPlan) -> list[SampledToken]:
        self.clock.advance(step_seconds(plan))
        return super().step(plan)


def prefill_steps(runner: ScriptedRunner, prompt: str) -> list[tuple[StepPlan, int]]:
    """The steps that ran a chunk of ``prompt``'s prefill, with the chunk's size."""
    ids, end = seq_ids_of(runner, encode(prompt)), len(prompt)
    return [
        (plan, len(chunk.token_ids))
        for plan in runner.plans
        for chunk in plan.chunks
        if chunk.seq_id in ids and chunk.start_pos < end
    ]


CONFIG = EngineConfig(max_running=16, max_step_tokens=512, target_itl_ms=TARGET_MS)
SCRIPT = {encode(LONG): encode("long answer")}


async def test_a_prompt_beside_running_streams_is_chunked_to_the_target() -> None:
    clock = Clock()
    runner = TimedRunner(clock, script=SCRIPT)
    pacer = StepPacer(TARGET_MS / 1000, clock=clock)
    async with serving(runner, CONFIG, pacer=pacer) as engine:
        streams = [
            engine.submit(request(f"stream {i}", max_tokens=300, ignore_eos=True)) for i in range(8)
        ]
        # some decode-only steps first, then the long prompt joins them
        await engine.wait_statistics(lambda s: s.generation_tokens_total >= 8 * 4)
        long_out = await collect(engine.submit(request(LONG, max_tokens=11)))
        outs = await collect_all(streams)
        status = engine.status().pacing
    assert long_out.text[0] == "long answer"
    assert all(out.finished[0].reason == "length" for out in outs)
    assert all(len(out.token_ids[0]) == 300 for out in outs)
    steps = prefill_steps(runner, LONG)
    chunks = [size for _, size in steps]
    assert sum(chunks) == len(LONG) and len(chunks) >= 8, chunks
    paced = [plan for plan, _ in steps]
    # it learns within a few steps: then every chunk fits the target, and the steps with
    # a chunk take about the target (the last chunk is the prompt's rest)
    settled = paced[3:-1]
    assert settled, chunks
    for plan in settled:
        assert 0.9 * TARGET_MS <= step_seconds(plan) * 1000 <= 1.02 * TARGET_MS, chunks
    assert all(len(p.chunks) - 1 == 8 for p in paced)  # the 8 streams decoded in each
    assert status is not None and status.prefill_token_s is not None
    assert status.steps_measured >= len(runner.plans) - 1


async def test_a_lone_prompt_gets_the_whole_budget() -> None:
    clock = Clock()
    runner = TimedRunner(clock, script=SCRIPT)
    pacer = StepPacer(TARGET_MS / 1000, clock=clock)
    async with serving(runner, CONFIG, pacer=pacer) as engine:
        # teach the pacer first: streams decoding beside a long prompt
        streams = [engine.submit(request(f"s{i}", max_tokens=40)) for i in range(8)]
        await engine.wait_statistics(lambda s: s.generation_tokens_total >= 8)
        teach = "Z" + LONG  # shares no cached block with LONG
        await collect(engine.submit(request(teach, max_tokens=2)))
        await collect_all(streams)
        assert pacer.prefill_token_s is not None
        assert [size for _, size in prefill_steps(runner, teach)][1] < 200
        out = await collect(engine.submit(request(LONG, max_tokens=11)))
    assert out.text[0] == "long answer"
    assert [size for _, size in prefill_steps(runner, LONG)] == [512, 512, len(LONG) - 1024]


async def test_without_a_target_the_fixed_budget_decides() -> None:
    runner = ScriptedRunner(SCRIPT, block_size=16, num_blocks=512, max_context=4096)
    config = EngineConfig(max_running=16, max_step_tokens=512)
    async with serving(runner, config) as engine:
        streams = [engine.submit(request(f"s{i}", max_tokens=60)) for i in range(8)]
        await engine.wait_statistics(lambda s: s.generation_tokens_total >= 8)
        out = await collect(engine.submit(request(LONG, max_tokens=11)))
        await collect_all(streams)
        assert engine.status().pacing is None
        assert engine.statistics().pacing is None
    chunks = [size for _, size in prefill_steps(runner, LONG)]
    assert out.text[0] == "long answer"
    assert chunks[:2] == [512 - 8, 512 - 8]  # the budget less the 8 decodes


async def test_the_target_in_the_config_builds_a_pacer() -> None:
    runner = ScriptedRunner(SCRIPT, block_size=16, num_blocks=512, max_context=4096)
    async with serving(runner, CONFIG) as engine:
        out = await collect(engine.submit(request(LONG, max_tokens=11)))
        with trio.fail_after(5):
            stats = await engine.wait_statistics(lambda s: s.requests["finished_length"] == 1)
    assert out.text[0] == "long answer"
    assert stats.pacing is not None and stats.pacing.target_s == TARGET_MS / 1000
    assert stats.pacing.chunk_tokens == 512  # a lone prompt
