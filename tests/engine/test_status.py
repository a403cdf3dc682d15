"""``Engine.status()``: every request in flight with its phase and KV, step by step.

The runner takes one permit per step, so the test holds the engine between steps and
reads the status of a known schedule (a 10-token prompt in chunks of 4, a second request
queued behind it with ``max_running = 1``).
"""

from __future__ import annotations

import threading

import trio

from furnace_trio.core.plan import SampledToken, StepPlan
from furnace_trio.engine import Engine, EngineConfig, RequestPhase

from ..scripted import ScriptedRunner, encode
from .harness import collect, request, serving


class SteppedRunner(ScriptedRunner):
    """Each step waits for a permit (:meth:`allow`) before it runs."""

    def __init__(self) -> None:
        super().__init__({encode("A" * 10): encode("abcdef")}, block_size=4)
        self.permits = threading.Semaphore(0)

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.permits.release()

    def step(self, plan: StepPlan) -> list[SampledToken]:
        if not self.permits.acquire(timeout=10):
            raise RuntimeError("no permit came")
        return super().step(plan)


async def _after_steps(engine: Engine, steps: int) -> None:
    with trio.fail_after(10):
        await engine.wait_statistics(lambda s: s.steps_total >= steps)


async def test_status_follows_a_request_from_queue_to_decoding() -> None:
    runner = SteppedRunner()
    config = EngineConfig(max_running=1, max_step_tokens=4)
    async with serving(runner, config) as engine:
        stream_a = engine.submit(request("A" * 10, max_tokens=6))
        stream_b = engine.submit(request("B", max_tokens=2))
        await trio.testing.wait_all_tasks_blocked()
        status = engine.status()
        assert [r.phase for r in status.requests] == [RequestPhase.PREFILL, RequestPhase.QUEUED]
        runner.allow()  # A's first chunk: 4 of 10 prompt tokens
        await _after_steps(engine, 1)
        status = engine.status()
        a, b = status.requests
        assert (a.request_id, b.request_id) == (stream_a.request_id, stream_b.request_id)
        assert (a.phase, a.prefilled_tokens, a.prompt_tokens) == (RequestPhase.PREFILL, 4, 10)
        assert (b.phase, b.prefilled_tokens, b.kv_blocks_used, b.kv_blocks_reserved) == (
            RequestPhase.QUEUED,
            0,
            0,
            0,
        )
        # A reserved its worst case (10 + 6 - 1 positions: 4 blocks), holds what the
        # step in flight writes (positions up to 8: 2 blocks)
        assert (a.kv_blocks_used, a.kv_blocks_reserved) == (2, 4)
        assert (status.running, status.waiting) == (1, 1)
        assert status.kv_blocks_used == 2 and status.kv_blocks_reserved == 2
        assert status.kv_blocks_free == status.kv_blocks_total - 2
        assert a.generated_tokens == 0 and a.session_id is None and a.age_s >= 0
        runner.allow(2)  # the rest of the prompt; its last chunk samples "a"
        await _after_steps(engine, 3)
        a, b = engine.status().requests
        assert (a.phase, a.prefilled_tokens, a.generated_tokens) == (RequestPhase.DECODING, 10, 1)
        assert b.phase is RequestPhase.QUEUED
        assert engine.status().steps_total == 3
        runner.allow(100)
        out_a, out_b = await collect(stream_a), await collect(stream_b)
        assert out_a.text == {0: "abcdef"} and out_b.failed is None
        status = engine.status()
    assert status.requests == () and status.kv_blocks_used == 0
    assert status.kv_blocks_reserved == 0 and status.state == "running"


async def test_a_request_cancelled_in_the_queue_is_counted() -> None:
    runner = SteppedRunner()
    async with serving(runner, EngineConfig(max_running=1, max_step_tokens=4)) as engine:
        stream_a = engine.submit(request("A" * 10, max_tokens=6))
        stream_b = engine.submit(request("B", max_tokens=2))
        stream_b.close()  # its client left while it waited
        runner.allow(100)
        await collect(stream_a)
        stats = engine.statistics()
    assert stats.requests_cancelled_before_admission_total == 1
    assert stats.requests["aborted"] == 1
