"""One request's failure fails that request only: a step that raises runs again by
requests (engine/isolation.py), the request that makes it raise fails, and the others go
on with exactly the output they have without it.

The scripted runner raises after writing the step's chunks to its simulated cache (as a
failure in sampling would) and checks every sequence's cache against its tokens before
sampling, so a re-run that appended a token twice, lost a block copy or wrote a freed
block fails a request that should not fail.
"""

from __future__ import annotations

import pytest

from furnace_trio.core.plan import StepPlan
from furnace_trio.engine import Admitted, EngineConfig, GenerationRequest

from ..scripted import EOS, ScriptedRunner, encode
from .harness import Outcome, collect_all, request, serving

POISON = ord("!")
CONFIG = EngineConfig(max_running=8, max_step_tokens=64)


def _poisoned(plan: StepPlan) -> bool:
    return any(POISON in chunk.token_ids for chunk in plan.chunks)


def _script(prompt: tuple[int, ...], index: int) -> list[int]:
    """A's samples differ by index; B answers with the poison first; C is plain."""
    if prompt[0] == ord("A"):
        return [*encode(f"a{index}" * 5), EOS]
    if prompt[0] == ord("B"):
        return [*encode("b"), POISON, *encode("bbbb")]
    return [*encode("cccccccc"), EOS]


def _good_requests() -> list[GenerationRequest]:
    return [
        request("AAAAAA", max_tokens=12, n=2),  # forks: copies its partial block
        request("CCCCC", max_tokens=8, logprobs=1, prompt_logprobs=2),  # scored prompt
    ]


def _bad_request(where: str) -> GenerationRequest:
    # "prompt": B's prefill raises (the step with everyone's prefill and C's scores);
    # "output": the poison B samples raises the step that feeds it back.
    return request("B!B" if where == "prompt" else "BB", max_tokens=6)


def _comparable(out: Outcome) -> tuple[object, ...]:
    """Everything a request's stream said but when (Admitted's queue time)."""
    events = [event for event in out.events if not isinstance(event, Admitted)]
    return (out.text, out.token_ids, out.finished, out.failed, events)


async def _run(requests: list[GenerationRequest]) -> tuple[list[Outcome], ScriptedRunner]:
    runner = ScriptedRunner(_script, fail_when=_poisoned)
    async with serving(runner, CONFIG) as engine:
        outs = await collect_all([engine.submit(r) for r in requests])
        stats = engine.statistics()
        assert engine.alive
    assert stats.running == 0 and stats.kv_blocks_used == 0
    return outs, runner


@pytest.mark.parametrize("where", ["prompt", "output"])
async def test_the_failing_request_fails_alone_and_the_others_are_unchanged(where: str) -> None:
    alone, _ = await _run(_good_requests())
    good = _good_requests()
    outs, runner = await _run([good[0], _bad_request(where), good[1]])
    a, b, c = outs
    assert b.failed is not None and "scripted failure" in b.failed.message
    assert not b.finished
    assert b.text.get(0, "") == ("" if where == "prompt" else "b!")
    for out, reference in ((a, alone[0]), (c, alone[1])):
        assert out.failed is None
        assert _comparable(out) == _comparable(reference)
    assert a.text == {0: "a0" * 5, 1: "a1" * 5}
    assert c.text == {0: "cccccccc"}
    # the failing step ran again in parts: some plan after it holds A and C but not B
    failed_at = next(i for i, plan in enumerate(runner.plans) if _poisoned(plan))
    assert any(
        plan.chunks and not _poisoned(plan) for plan in runner.plans[failed_at + 1 : failed_at + 4]
    )


async def test_statistics_count_one_failure() -> None:
    runner = ScriptedRunner(_script, fail_when=_poisoned)
    async with serving(runner, CONFIG) as engine:
        good = _good_requests()
        outs = await collect_all([engine.submit(r) for r in [good[0], _bad_request("output")]])
        stats = engine.statistics()
    assert outs[1].failed is not None and outs[0].failed is None
    assert stats.requests["failed"] == 1 and stats.requests["finished_stop"] == 1


async def test_each_of_several_failing_requests_fails_with_the_others_unchanged() -> None:
    prompts = ["A1", "B!", "C1", "B!!", "A2", "C2"]
    alone, _ = await _run([request(p, max_tokens=6) for p in prompts if "!" not in p])
    outs, _ = await _run([request(p, max_tokens=6) for p in prompts])
    good = [out for p, out in zip(prompts, outs, strict=True) if "!" not in p]
    bad = [out for p, out in zip(prompts, outs, strict=True) if "!" in p]
    assert all(out.failed is not None for out in bad)
    assert [_comparable(out) for out in good] == [_comparable(out) for out in alone]


async def test_a_runner_that_always_fails_fails_everyone_in_bounded_steps() -> None:
    runner = ScriptedRunner(_script, fail_when=lambda plan: bool(plan.chunks))
    async with serving(runner, CONFIG) as engine:
        outs = await collect_all([engine.submit(request(p, max_tokens=4)) for p in "CDEFG"])
        stats = engine.statistics()
        assert engine.alive
    assert all(out.failed is not None and "scripted failure" in out.failed.message for out in outs)
    # one step, then at most 2 * 5 - 2 re-runs, each smaller than the one before
    assert len(runner.plans) <= 1 + 2 * 5 - 2
    assert stats.requests["failed"] == 5 and stats.kv_blocks_used == 0


async def test_a_runner_failing_even_without_chunks_fails_everyone() -> None:
    # With block copies pending (n = 2 forks), the re-run starts with a plan of no chunks;
    # when that raises too, nobody can run and everyone fails, as a single step would.
    state = {"fail": False}

    def failing(plan: StepPlan) -> bool:
        state["fail"] |= bool(plan.block_copies)
        return state["fail"]

    runner = ScriptedRunner(_script, fail_when=failing)
    async with serving(runner, CONFIG) as engine:
        outs = await collect_all(
            [engine.submit(request("AAAAAA", max_tokens=6, n=2)), engine.submit(request("C"))]
        )
        stats = engine.statistics()
        assert engine.alive
    assert all(out.failed is not None for out in outs)
    assert stats.kv_blocks_used == 0
