"""The engine with a scripted model: generation, batching, chunking, admission, n > 1,
counters.

Timing is never asserted: steps are counted through the plans the runner recorded.
"""

from __future__ import annotations

import threading

import pytest
import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine import (
    Admitted,
    Delta,
    EngineBusy,
    EngineConfig,
    Finished,
    GenerationRequest,
    RequestRejected,
    RequestTooLarge,
)

from ..scripted import EOS, ScriptedRunner, encode
from .harness import (
    Outcome,
    chunks_of,
    collect,
    collect_all,
    request,
    seq_ids_of,
    serving,
)

# -- basics -------------------------------------------------------------------------------


async def test_generates_scripted_text_and_stops_at_eos() -> None:
    runner = ScriptedRunner({encode("hi"): [*encode("hello"), EOS, *encode("never")]})
    async with serving(runner) as engine:
        out = await collect(engine.submit(request("hi", max_tokens=20)))
    assert isinstance(out.events[0], Admitted)
    assert out.events[0].prompt_tokens == 2
    assert out.text == {0: "hello"}
    assert out.token_ids == {0: list(encode("hello"))}
    assert out.finished[0].reason == "stop"
    assert out.finished[0].completion_tokens == 5
    assert isinstance(out.events[-1], Finished)


async def test_max_tokens_finishes_with_length() -> None:
    runner = ScriptedRunner({encode("hi"): encode("abcdefgh")})
    async with serving(runner) as engine:
        out = await collect(engine.submit(request("hi", max_tokens=3)))
    assert out.text == {0: "abc"}
    assert out.finished[0].reason == "length"
    assert out.finished[0].completion_tokens == 3


async def test_stop_token_ids_and_ignore_eos() -> None:
    script = [*encode("ab"), EOS, *encode("cd"), ord("!"), *encode("ef")]
    runner = ScriptedRunner({encode("p"): script})
    async with serving(runner) as engine:
        plain = await collect(engine.submit(request("p", max_tokens=20)))
        ignoring = await collect(
            engine.submit(request("p", max_tokens=20, ignore_eos=True, stop_token_ids=(ord("!"),)))
        )
        capped = await collect(engine.submit(request("p", max_tokens=4, ignore_eos=True)))
    assert (plain.text[0], plain.finished[0].reason) == ("ab", "stop")
    # EOS decodes to nothing but is a token of the output when ignored
    assert (ignoring.text[0], ignoring.finished[0].reason) == ("abcd", "stop")
    assert ignoring.finished[0].completion_tokens == 5
    assert ignoring.token_ids[0] == [*encode("ab"), EOS, *encode("cd")]
    assert (capped.text[0], capped.finished[0].reason) == ("abc", "length")


# -- batching -----------------------------------------------------------------------------


async def test_32_concurrent_requests_match_their_solo_runs() -> None:
    prompts = [f"prompt number {i}: " + "z" * (i % 7) for i in range(32)]

    def script(prompt: tuple[int, ...], index: int) -> list[int]:
        n = 3 + sum(prompt) % 9
        return [*(97 + (sum(prompt) + k) % 26 for k in range(n)), EOS]

    config = EngineConfig(max_running=8, max_step_tokens=32)
    solo: dict[str, Outcome] = {}
    async with serving(ScriptedRunner(script), config) as engine:
        for p in prompts:
            solo[p] = await collect(engine.submit(request(p, max_tokens=30)))
    together: dict[str, Outcome] = {}
    runner = ScriptedRunner(script, sleep=0)
    async with serving(runner, config) as engine:
        streams = {p: engine.submit(request(p, max_tokens=30)) for p in prompts}

        async def consume(p: str) -> None:
            together[p] = await collect(streams[p])

        async with trio.open_nursery() as nursery:
            for p in prompts:
                nursery.start_soon(consume, p)
        stats = engine.statistics()
    for p in prompts:
        assert together[p].failed is None
        assert together[p].text == solo[p].text
        assert together[p].finished == solo[p].finished
    assert max(len(plan.chunks) for plan in runner.plans) > 1  # they really were batched
    assert all(plan.num_tokens <= 32 for plan in runner.plans)
    assert stats.requests["finished_stop"] == 32
    assert stats.kv_blocks_used == 0


async def test_request_submitted_mid_stream_joins_the_next_step() -> None:
    long = [*encode("a" * 30), EOS]
    runner = ScriptedRunner({encode("A"): long, encode("B"): [*encode("bb"), EOS]}, sleep=0)
    async with serving(runner) as engine:
        stream_a = engine.submit(request("A", max_tokens=40))
        got = 0
        async with stream_a:
            async for event in stream_a:
                if isinstance(event, Delta):
                    got += 1
                    if got == 3:
                        at_submit = len(runner.plans)
                        out_b = await collect(engine.submit(request("B", max_tokens=5)))
                        break
        assert out_b.text == {0: "bb"}
    b_ids = seq_ids_of(runner, encode("B"))
    a_ids = seq_ids_of(runner, encode("A"))
    first_b = next(i for i, plan in enumerate(runner.plans) if chunks_of(plan, b_ids))
    # the step after the one in flight (whose plan the thread may not have recorded yet)
    assert at_submit <= first_b <= at_submit + 1
    assert chunks_of(runner.plans[first_b], a_ids) == [1]  # alongside A's decode


async def test_chunked_prefill_keeps_decodes_flowing() -> None:
    runner = ScriptedRunner(
        {encode("A"): [*encode("a" * 40), EOS], encode("B" * 30): [*encode("b"), EOS]}
    )
    config = EngineConfig(max_running=4, max_step_tokens=8)
    async with serving(runner, config) as engine:
        stream_a = engine.submit(request("A", max_tokens=50))
        async with stream_a:
            async for event in stream_a:
                if isinstance(event, Delta):
                    out_b = await collect(engine.submit(request("B" * 30, max_tokens=5)))
                    break
    assert out_b.text == {0: "b"}
    a_ids = seq_ids_of(runner, encode("A"))
    b_ids = seq_ids_of(runner, encode("B" * 30))
    prefill_plans = [p for p in runner.plans if any(c.token_ids[0] == ord("B") for c in p.chunks)]
    assert len(prefill_plans) >= 4  # 30 prompt tokens in chunks of at most 7
    for plan in runner.plans:
        assert plan.num_tokens <= 8
    for plan in prefill_plans:
        assert chunks_of(plan, a_ids) == [1]  # A decodes in every step of B's prefill
        assert sum(chunks_of(plan, b_ids)) <= 7


# -- admission ----------------------------------------------------------------------------


async def test_admission_refusals() -> None:
    runner = ScriptedRunner(block_size=4, num_blocks=8, max_context=64)
    config = EngineConfig(max_running=2, max_waiting=1, max_step_tokens=16)
    async with serving(runner, config) as engine:
        with pytest.raises(RequestRejected) as empty:
            engine.submit(GenerationRequest((), SamplingParams()))
        assert empty.value.param == "prompt"
        with pytest.raises(RequestRejected) as long:
            engine.submit(request("p" * 60, max_tokens=5))
        assert long.value.param == "max_tokens"
        with pytest.raises(RequestRejected):
            engine.submit(request("p" * 64, max_tokens=1))
        with pytest.raises(RequestTooLarge):  # 40 tokens > 8 blocks of 4
            engine.submit(request("p" * 30, max_tokens=12))
        with pytest.raises(RequestTooLarge):
            engine.submit(request("p", n=3))
        first = engine.submit(request("a", max_tokens=2))
        with pytest.raises(EngineBusy):
            engine.submit(request("b", max_tokens=2))
        first.close()
        assert engine.statistics().requests["rejected"] == 6


async def test_the_queue_counts_sequences() -> None:
    # submit is synchronous: until the engine task runs, everything submitted waits
    runner = ScriptedRunner(block_size=4, num_blocks=64, max_context=64)
    config = EngineConfig(max_running=4, max_waiting=4, max_step_tokens=16)
    async with serving(runner, config) as engine:
        three = engine.submit(request("a", n=3, max_tokens=2))
        with pytest.raises(EngineBusy, match="3 sequences are waiting"):
            engine.submit(request("b", n=2, max_tokens=2))
        one = engine.submit(request("c", max_tokens=2))
        with pytest.raises(EngineBusy):
            engine.check_room(1)
        assert engine.statistics().requests["rejected"] == 2
        three.close()
        engine.check_room(3)  # an aborted request gives its places back
        one.close()


async def test_request_waits_for_blocks_then_runs() -> None:
    # each request needs 5 of the 8 blocks: the second waits for the first to finish
    runner = ScriptedRunner(block_size=4, num_blocks=8, max_context=64)
    config = EngineConfig(max_running=2, max_step_tokens=16)
    async with serving(runner, config) as engine:
        outs = await collect_all([engine.submit(request("a" * 8, max_tokens=12)) for _ in range(2)])
    assert [o.finished[0].reason for o in outs] == ["length", "length"]
    assert max(len(p.chunks) for p in runner.plans) == 1


# -- n > 1 --------------------------------------------------------------------------------


async def test_n2_shares_one_prefill_and_forks() -> None:
    def script(prompt: tuple[int, ...], index: int) -> list[int]:
        return [*encode("first" if index == 0 else "second!"), EOS]

    runner = ScriptedRunner(script, block_size=4)
    prompt = "shared"  # 6 tokens: one full block and a partial one
    async with serving(runner) as engine:
        out = await collect(engine.submit(request(prompt, max_tokens=20, n=2, seed=7)))
        stats = engine.statistics()
    assert out.text == {0: "first", 1: "second!"}
    assert set(out.finished) == {0, 1}
    prompt_chunks = [c for p in runner.plans for c in p.chunks if c.token_ids == encode(prompt)]
    assert len(prompt_chunks) == 1
    assert len(prompt_chunks[0].samples) == 2
    assert [s.params.seed for s in prompt_chunks[0].samples] == [7, 8]
    copies = [cp for p in runner.plans for cp in p.block_copies]
    assert len(copies) == 2  # each child copies the partial block
    parent_block = prompt_chunks[0].block_table[1]
    assert all(src == parent_block for src, _ in copies)
    # the full block is shared by both children
    child_tables = {
        c.seq_id: c.block_table for p in runner.plans for c in p.chunks if c.start_pos == 6
    }
    assert len(child_tables) == 2
    assert len({t[0] for t in child_tables.values()}) == 1
    assert stats.kv_blocks_used == 0
    assert stats.requests["finished_stop"] == 1


# -- statistics ---------------------------------------------------------------------------


async def test_statistics_count_tokens_and_outcomes() -> None:
    runner = ScriptedRunner({encode("ab"): [*encode("xyz"), EOS]})
    async with serving(runner) as engine:
        await collect(engine.submit(request("ab", max_tokens=10)))
        await collect(engine.submit(request("ab", max_tokens=2)))
        stats = engine.statistics()
    assert stats.prompt_tokens_total == 4
    assert stats.generation_tokens_total == 5
    assert stats.requests["finished_stop"] == 1
    assert stats.requests["finished_length"] == 1
    assert stats.time_to_first_token.count == 2
    assert stats.e2e_latency.count == 2
    assert stats.queue_time.count == 2
    assert stats.inter_token_latency.count == 3  # 2 + 1 gaps
    assert stats.prefill_step_time.count == 2
    assert stats.decode_step_time.count >= 3
    assert stats.kv_blocks_total == 256
    assert stats.time_to_first_token.counts[-1] == 2


async def test_wait_statistics_returns_the_first_snapshot_that_meets_the_condition() -> None:
    """A waiter wakes on the engine's changes, not on a clock: here on an admission while
    its step is still blocked on the model thread, then on an abort."""
    gate = threading.Event()
    runner = ScriptedRunner({encode("A"): encode("a" * 8)}, gate=gate)
    async with serving(runner) as engine:
        try:
            with trio.fail_after(5):
                stream = engine.submit(request("A", max_tokens=8))
                running = await engine.wait_statistics(lambda s: s.running == 1)
                assert running.waiting == 0 and running.requests["aborted"] == 0
                assert not gate.is_set() and len(runner.plans) <= 1
                stream.close()
                aborted = await engine.wait_statistics(lambda s: s.requests["aborted"] == 1)
                assert aborted.running == 0 and aborted.requests_in_flight == 0
        finally:
            gate.set()
