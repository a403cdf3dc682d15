"""The engine with a scripted model when requests end early: aborts, closed streams,
failing steps, a dead engine task, shutdown.

Timing is never asserted: steps are counted through the plans the runner recorded.
"""

from __future__ import annotations

import pytest
import trio

from furnace_trio.engine import (
    Admitted,
    Delta,
    Engine,
    EngineConfig,
    EngineUnavailable,
    Failed,
)

from ..scripted import EOS, EngineKillingRunner, ScriptedRunner, decode, encode
from .harness import (
    chunks_of,
    collect,
    collect_all,
    request,
    seq_ids_of,
    serving,
)

# -- aborts -------------------------------------------------------------------------------


async def test_abort_while_queued() -> None:
    runner = ScriptedRunner({encode("A"): encode("a" * 20)})
    async with serving(runner, EngineConfig(max_running=1, max_step_tokens=8)) as engine:
        stream_a = engine.submit(request("A", max_tokens=20))
        stream_b = engine.submit(request("B", max_tokens=20))
        assert isinstance(await stream_a.__anext__(), Admitted)
        assert engine.statistics().waiting == 1
        stream_b.close()
        stream_b.close()  # idempotent
        assert engine.statistics().waiting == 0
        out = await collect(stream_a)
        stats = engine.statistics()
    assert out.finished[0].reason == "length"
    assert stats.requests["aborted"] == 1
    assert not seq_ids_of(runner, encode("B"))  # never ran


async def test_abort_during_multichunk_prefill_frees_blocks_by_next_step() -> None:
    runner = ScriptedRunner({encode("A"): encode("a" * 40)}, sleep=0)
    config = EngineConfig(max_running=4, max_step_tokens=8)
    prompt_b = "B" * 40
    async with serving(runner, config) as engine:
        stream_a = engine.submit(request("A", max_tokens=40))
        async with stream_a:
            deltas = 0
            async for event in stream_a:
                if not isinstance(event, Delta):
                    continue
                deltas += 1
                if deltas == 1:
                    stream_b = engine.submit(request(prompt_b, max_tokens=4))
                    first = await stream_b.__anext__()
                    assert isinstance(first, Admitted)
                    used_before = engine.statistics().kv_blocks_used
                    stream_b.close()
                    aborted_at = len(runner.plans)
                    assert engine.statistics().kv_blocks_used < used_before
                if deltas == 6:
                    break
        stats = engine.statistics()
    b_ids = seq_ids_of(runner, encode(prompt_b))
    assert b_ids
    assert all(not chunks_of(p, b_ids) for p in runner.plans[aborted_at + 1 :])
    assert stats.requests["aborted"] == 2  # B, then A when its stream closed
    assert stats.kv_blocks_used == 0


async def test_abort_during_decode_frees_blocks() -> None:
    runner = ScriptedRunner({encode("A"): encode("a" * 40)}, sleep=0)
    async with serving(runner) as engine:
        stream = engine.submit(request("A", max_tokens=40))
        async for event in stream:
            if isinstance(event, Delta):
                assert engine.statistics().kv_blocks_used > 0
                engine.abort(stream.request_id)
                engine.abort(stream.request_id)  # idempotent
                aborted_at = len(runner.plans)
                assert engine.statistics().kv_blocks_used == 0
        # the stream ends after an abort from elsewhere
        assert isinstance(event, Failed)
        stats = engine.statistics()
    assert len(runner.plans) <= aborted_at + 1
    assert stats.requests["aborted"] == 1


async def test_leaving_the_stream_aborts_the_request() -> None:
    runner = ScriptedRunner({encode("A"): encode("a" * 40)})
    async with serving(runner) as engine:
        async with engine.submit(request("A", max_tokens=40)) as stream:
            async for event in stream:
                if isinstance(event, Delta):
                    break
        stats = engine.statistics()
        assert stats.requests["aborted"] == 1
        assert stats.running == 0 and stats.kv_blocks_used == 0
        # the engine goes on serving
        out = await collect(engine.submit(request("A", max_tokens=2)))
    assert out.text == {0: "aa"}


async def test_cancelled_consumer_aborts_through_async_with() -> None:
    runner = ScriptedRunner({encode("A"): encode("a" * 40)}, sleep=0)
    async with serving(runner) as engine:
        with trio.CancelScope() as scope:
            async with engine.submit(request("A", max_tokens=1000 - 2)) as stream:
                async for event in stream:
                    if isinstance(event, Delta):
                        scope.cancel()  # the consumer is cancelled mid-stream
                    await trio.lowlevel.checkpoint()
        assert scope.cancelled_caught
        assert engine.statistics().requests["aborted"] == 1
        assert engine.statistics().kv_blocks_used == 0


# -- failures -----------------------------------------------------------------------------


async def test_a_raising_step_fails_only_its_requests() -> None:
    runner = ScriptedRunner({encode("A"): encode("aaaa"), encode("B"): encode("bbbb")}, fail_on={0})
    async with serving(runner) as engine:
        out_a = await collect(engine.submit(request("A", max_tokens=4)))
        out_b = await collect(engine.submit(request("B", max_tokens=4)))
        stats = engine.statistics()
        assert engine.alive
    assert out_a.failed is not None and "scripted failure" in out_a.failed.message
    assert not out_a.finished
    assert out_b.text == {0: "bbbb"}
    assert stats.requests["failed"] == 1 and stats.requests["finished_length"] == 1
    assert stats.kv_blocks_used == 0


async def test_a_failing_step_spares_requests_not_in_it() -> None:
    # B's plan fails while A waits in the queue (max_running=1): A is untouched
    runner = ScriptedRunner(
        {encode("A"): encode("aaaa"), encode("B"): encode("bbbb")},
        fail_when=lambda plan: any(c.token_ids == encode("B") for c in plan.chunks),
    )
    async with serving(runner, EngineConfig(max_running=1, max_step_tokens=4)) as engine:
        stream_b = engine.submit(request("B", max_tokens=4))
        stream_a = engine.submit(request("A", max_tokens=4))
        out_b = await collect(stream_b)
        out_a = await collect(stream_a)
    assert out_b.failed is not None
    assert out_a.text == {0: "aaaa"}


async def test_engine_task_death_fails_everyone_and_refuses_new_requests() -> None:
    runner = EngineKillingRunner({encode("A"): encode("a" * 20)})
    async with serving(runner, EngineConfig(max_running=1, max_step_tokens=4)) as engine:
        outs = await collect_all(
            [engine.submit(request("A", max_tokens=5)), engine.submit(request("B", max_tokens=5))]
        )
        assert not engine.alive
        assert engine.failure is not None and "scheduler bug" in engine.failure
        with pytest.raises(EngineUnavailable):
            engine.submit(request("A"))
        assert engine.statistics().alive is False
    for out in outs:
        assert out.failed is not None and "scheduler bug" in out.failed.message


async def test_not_started_and_shutdown_refuse_requests() -> None:
    runner = ScriptedRunner({encode("A"): encode("a" * 8)})
    engine = Engine(runner, decode=decode, eos_token_ids=frozenset({EOS}))
    with pytest.raises(EngineUnavailable):
        engine.submit(request("A"))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        waiting = engine.submit(request("A", max_tokens=8))
        engine.shutdown()  # before the engine admitted it: it fails, run() returns
        with pytest.raises(EngineUnavailable):
            engine.submit(request("A"))
        out = await collect(waiting)
    assert out.failed is not None and "shutting down" in out.failed.message
    assert engine.alive is False


async def test_shutdown_lets_running_requests_finish() -> None:
    runner = ScriptedRunner({encode("A"): encode("a" * 8)})
    engine = Engine(runner, decode=decode, eos_token_ids=frozenset({EOS}))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        stream = engine.submit(request("A", max_tokens=8))
        first = await stream.__anext__()
        assert isinstance(first, Admitted)
        engine.shutdown()
        out = await collect(stream)
    assert out.text == {0: "a" * 8}
    assert engine.alive is False
