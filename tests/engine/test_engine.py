"""The engine with a scripted model: batching, chunking, aborts, failures, text, counters.

Timing is never asserted: steps are counted through the plans the runner recorded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import StepPlan
from furnace_trio.engine.engine import (
    Admitted,
    Delta,
    Engine,
    EngineBusy,
    EngineConfig,
    EngineUnavailable,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    RequestRejected,
    RequestStream,
    RequestTooLarge,
)

from ..scripted import EOS, ScriptedRunner, decode, encode, token_bytes


@dataclass(slots=True)
class Outcome:
    events: list[Event] = field(default_factory=list)
    text: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)
    failed: Failed | None = None


async def collect(stream: RequestStream) -> Outcome:
    out = Outcome()
    async with stream:
        async for event in stream:
            out.events.append(event)
            if isinstance(event, Delta):
                out.text[event.index] = out.text.get(event.index, "") + event.text
                out.token_ids.setdefault(event.index, []).extend(event.token_ids)
            elif isinstance(event, Finished):
                assert event.index not in out.finished
                out.finished[event.index] = event
            elif isinstance(event, Failed):
                out.failed = event
    return out


@asynccontextmanager
async def serving(
    runner: ScriptedRunner,
    config: EngineConfig | None = None,
    decode: Callable[[list[int]], str] = decode,
) -> AsyncIterator[Engine]:
    engine = Engine(
        runner,
        decode=decode,
        eos_token_ids=frozenset({EOS}),
        token_bytes=token_bytes,
        config=config or EngineConfig(),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        yield engine
        nursery.cancel_scope.cancel()


def request(prompt: str, **params: object) -> GenerationRequest:
    return GenerationRequest(encode(prompt), SamplingParams(**params))  # type: ignore[arg-type]


def chunks_of(plan: StepPlan, seq_ids: set[int]) -> list[int]:
    return [len(c.token_ids) for c in plan.chunks if c.seq_id in seq_ids]


def seq_ids_of(runner: ScriptedRunner, prompt: tuple[int, ...]) -> set[int]:
    """Seq ids that ran or sampled for a prompt (first-chunk match on the prompt's start)."""
    ids: set[int] = set()
    for plan in runner.plans:
        for chunk in plan.chunks:
            if chunk.start_pos == 0 and chunk.token_ids == prompt[: len(chunk.token_ids)]:
                ids.add(chunk.seq_id)
            for spec in chunk.samples:
                if spec.prompt_token_ids == prompt:
                    ids.add(spec.seq_id)
                    ids.add(chunk.seq_id)
    return ids


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


async def test_multibyte_characters_split_across_tokens() -> None:
    # "é" is one token, "😀" is two tokens that are each half a character
    script = [ord("a"), 256, 258, 259, ord("b"), EOS]
    runner = ScriptedRunner({encode("u"): script})
    async with serving(runner) as engine:
        out = await collect(engine.submit(request("u", max_tokens=10)))
    assert out.text == {0: "aé😀b"}
    for event in out.events:
        if isinstance(event, Delta):
            assert "\ufffd" not in event.text
    assert out.token_ids[0] == script[:-1]


async def test_stop_string_ends_the_sample_and_is_never_emitted() -> None:
    script = encode("one, two STOP three and more")
    runner = ScriptedRunner({encode("s"): script})
    async with serving(runner) as engine:
        out = await collect(engine.submit(request("s", max_tokens=40, stop=("STOP",))))
        stats = engine.statistics()
    assert out.text == {0: "one, two "}
    assert out.finished[0].reason == "stop"
    assert out.finished[0].completion_tokens == len("one, two STOP")
    assert stats.requests["finished_stop"] == 1
    assert stats.kv_blocks_used == 0 and stats.running == 0


async def test_stop_string_across_tokens_with_multibyte() -> None:
    script = [*encode("x"), 258, 259, *encode("EN"), *encode("D!"), *encode("tail")]
    runner = ScriptedRunner({encode("m"): script})
    async with serving(runner) as engine:
        out = await collect(engine.submit(request("m", max_tokens=40, stop=("END",))))
    assert out.text == {0: "x😀"}
    assert out.finished[0].reason == "stop"


async def test_logprobs_are_passed_through_with_token_text() -> None:
    runner = ScriptedRunner({encode("l"): [*encode("ok"), EOS]})
    async with serving(runner) as engine:
        out = await collect(engine.submit(request("l", max_tokens=5, logprobs=2)))
    entries = [e for ev in out.events if isinstance(ev, Delta) for e in ev.logprobs]
    assert [e.token for e in entries] == ["o", "k"]
    assert entries[0].bytes == (ord("o"),)
    assert entries[0].logprob == -0.5
    assert [t.token_id for t in entries[0].top] == [ord("o"), ord("o") + 1]


# -- stream interval ----------------------------------------------------------------------


def delta_sizes(out: Outcome, index: int = 0) -> list[int]:
    return [len(e.token_ids) for e in out.events if isinstance(e, Delta) and e.index == index]


async def test_stream_interval_sends_the_first_token_alone_then_groups() -> None:
    runner = ScriptedRunner({encode("g"): [*encode("abcdefghij"), EOS]})
    async with serving(runner, EngineConfig(stream_interval=4)) as engine:
        out = await collect(engine.submit(request("g", max_tokens=20)))
    # the tenth token is held when EOS ends the sample, and sent before Finished
    assert delta_sizes(out) == [1, 4, 4, 1]
    assert out.text == {0: "abcdefghij"}
    assert out.token_ids == {0: list(encode("abcdefghij"))}
    assert out.finished[0].reason == "stop"
    assert out.finished[0].completion_tokens == 10
    assert isinstance(out.events[-1], Finished)


async def test_stream_interval_at_max_tokens_and_for_every_sample() -> None:
    runner = ScriptedRunner(lambda prompt, index: encode("pqrstuvwxyz"[index:]) * 2)
    async with serving(runner, EngineConfig(stream_interval=3)) as engine:
        out = await collect(engine.submit(request("n", max_tokens=8, n=2, seed=1)))
    for index, text in ((0, "pqrstuvw"), (1, "qrstuvwx")):
        assert delta_sizes(out, index) == [1, 3, 3, 1]  # the last group ends at max_tokens
        assert out.text[index] == text
        assert out.finished[index].reason == "length"
        assert out.finished[index].completion_tokens == 8


async def test_stream_interval_keeps_logprobs_and_multibyte_text() -> None:
    script = [*encode("a"), 258, 259, *encode("bc"), 256, EOS]
    runner = ScriptedRunner({encode("l"): script})
    async with serving(runner, EngineConfig(stream_interval=2)) as engine:
        out = await collect(engine.submit(request("l", max_tokens=20, logprobs=1)))
    deltas = [e for e in out.events if isinstance(e, Delta)]
    assert [len(d.token_ids) for d in deltas] == [1, 2, 2, 1]
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert [d.text for d in deltas] == ["a", "😀", "bc", "é"]
    assert [e.token_id for d in deltas for e in d.logprobs] == script[:-1]


async def test_stream_interval_stop_string_inside_a_group() -> None:
    script = encode("one, two STOP three and more and more and more")
    runner = ScriptedRunner({encode("s"): script})
    async with serving(runner, EngineConfig(stream_interval=5)) as engine:
        out = await collect(engine.submit(request("s", max_tokens=40, stop=("STOP",))))
        stats = engine.statistics()
    assert out.text == {0: "one, two "}
    assert delta_sizes(out)[:3] == [1, 5, 5]  # "o", "ne, t", "wo ST" (its text: "wo ")
    assert out.finished[0].reason == "stop"
    assert out.finished[0].completion_tokens == len("one, two STOP")
    # the stop is seen when its group arrives: at most one group of tokens past it ran
    sampled = sum(1 for plan in runner.plans for c in plan.chunks if c.samples)
    assert sampled <= len("one, two STOP") + 5 + 1
    assert stats.kv_blocks_used == 0 and stats.running == 0


def test_stream_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)


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
        with trio.move_on_after(0.05) as scope:
            async with engine.submit(request("A", max_tokens=1000 - 2)) as stream:
                async for _ in stream:
                    await trio.sleep(0.01)
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
    runner = ScriptedRunner({encode("A"): encode("a" * 20)})
    async with serving(runner, EngineConfig(max_running=1, max_step_tokens=4)) as engine:

        def broken(*args: object) -> None:
            raise RuntimeError("scheduler bug")

        engine._scheduler.update = broken  # type: ignore[method-assign]
        outs = await _collect_all(
            [engine.submit(request("A", max_tokens=5)), engine.submit(request("B", max_tokens=5))]
        )
        assert not engine.alive
        assert engine.failure is not None and "scheduler bug" in engine.failure
        with pytest.raises(EngineUnavailable):
            engine.submit(request("A"))
        assert engine.statistics().alive is False
    for out in outs:
        assert out.failed is not None and "scheduler bug" in out.failed.message


async def _collect_all(streams: list[RequestStream]) -> list[Outcome]:
    results: list[Outcome] = [Outcome()] * len(streams)

    async def one(i: int) -> None:
        results[i] = await collect(streams[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(streams)):
            nursery.start_soon(one, i)
    return results


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


async def test_request_waits_for_blocks_then_runs() -> None:
    # each request needs 5 of the 8 blocks: the second waits for the first to finish
    runner = ScriptedRunner(block_size=4, num_blocks=8, max_context=64)
    config = EngineConfig(max_running=2, max_step_tokens=16)
    async with serving(runner, config) as engine:
        outs = await _collect_all(
            [engine.submit(request("a" * 8, max_tokens=12)) for _ in range(2)]
        )
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
