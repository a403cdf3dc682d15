"""The scheduler on its own: plans, budgets, reservations, forks, ends. Plain Python."""

from __future__ import annotations

import random

import pytest

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import SampledToken
from furnace_trio.engine.block_pool import BlockPool
from furnace_trio.engine.kv_cache_manager import KVCacheManager
from furnace_trio.engine.scheduler import (
    FinishReason,
    SampleOutput,
    ScheduledStep,
    Scheduler,
    StepMismatch,
)

EOS = 0


def make(
    num_blocks: int = 64, block_size: int = 4, max_running: int = 4, max_step_tokens: int = 16
) -> Scheduler:
    return Scheduler(
        KVCacheManager(BlockPool(num_blocks, block_size)),
        max_running=max_running,
        max_step_tokens=max_step_tokens,
        max_context=1024,
        eos_token_ids={EOS},
    )


def answer(step: ScheduledStep, token: int = 7) -> list[SampledToken]:
    return [SampledToken(s.seq_id, token) for c in step.plan.chunks for s in c.samples]


def run_step(s: Scheduler, token: int = 7) -> tuple[ScheduledStep, list[SampleOutput]]:
    step = s.schedule()
    assert step is not None
    return step, s.update(step, answer(step, token))


def test_prompt_then_decode_with_one_counter() -> None:
    s = make()
    s.add("a", [1, 2, 3], SamplingParams(max_tokens=3))
    step, outs = run_step(s)
    (chunk,) = step.plan.chunks
    assert (chunk.token_ids, chunk.start_pos, len(chunk.samples)) == ((1, 2, 3), 0, 1)
    assert step.admitted == ("a",)
    assert outs == [SampleOutput("a", 0, SampledToken(chunk.seq_id, 7), None)]
    step, outs = run_step(s, 8)
    (chunk,) = step.plan.chunks
    assert (chunk.token_ids, chunk.start_pos) == ((7,), 3)
    assert chunk.samples[0].output_token_ids == (7,)
    step, outs = run_step(s, 9)
    assert outs[0].finish is FinishReason.LENGTH
    assert not s.has_work and s.kv.pool.num_used == 0
    assert s.schedule() is None  # idle: the release waits for the next plan
    s.add("b", [1], SamplingParams())
    step, _ = run_step(s)
    assert step.plan.released == (chunk.seq_id,)


def test_decodes_first_then_prefill_chunks_within_budget() -> None:
    s = make(max_step_tokens=8)
    s.add("a", [1, 2], SamplingParams(max_tokens=50))
    run_step(s)
    s.add("b", list(range(1, 21)), SamplingParams(max_tokens=5))
    sizes = []
    while True:
        step, _ = run_step(s)
        chunks = step.plan.chunks
        assert step.plan.num_tokens <= 8
        assert len(chunks[0].token_ids) == 1  # a's decode leads every step
        if len(chunks) == 1:
            break
        sizes.append(len(chunks[1].token_ids))
    assert sizes[:3] == [7, 7, 6]


def test_admission_waits_for_blocks_in_order() -> None:
    s = make(num_blocks=6, block_size=4, max_step_tokens=64)
    s.add("big", [1] * 8, SamplingParams(max_tokens=9))  # 16 positions: 4 blocks
    s.add("big2", [1] * 8, SamplingParams(max_tokens=9))
    s.add("small", [1], SamplingParams(max_tokens=1))  # fits, but must not overtake
    step, _ = run_step(s)
    assert step.admitted == ("big",)
    assert s.num_waiting == 2
    while "big" in s.running:
        run_step(s)
    step, _ = run_step(s)
    assert step.admitted == ("big2", "small")


def test_max_running_counts_samples() -> None:
    s = make(max_running=3)
    s.add("a", [1], SamplingParams(max_tokens=5, n=2))
    s.add("b", [1], SamplingParams(max_tokens=5, n=2))
    step, _ = run_step(s)
    assert step.admitted == ("a",) and s.num_running == 2


def test_n_forks_after_one_prefill() -> None:
    s = make(block_size=4)
    s.add("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4, n=3, seed=10))
    step, outs = run_step(s)
    (chunk,) = step.plan.chunks
    assert len(chunk.samples) == 3
    assert [spec.params.seed for spec in chunk.samples] == [10, 11, 12]
    assert [o.index for o in outs] == [0, 1, 2]
    step, _ = run_step(s)
    full, partial = chunk.block_table
    assert len(step.plan.block_copies) == 3
    assert {src for src, _ in step.plan.block_copies} == {partial}
    assert [c.block_table[0] for c in step.plan.chunks] == [full] * 3
    assert s.kv.pool.refcount(full) == 3
    assert s.kv.pool.refcount(partial) == 0  # the parent let go
    s.abort("a")
    assert s.kv.pool.num_used == 0 and s.num_running == 0


def test_eos_stop_ids_and_ignore_eos() -> None:
    s = make()
    s.add("eos", [1], SamplingParams())
    s.add("stop", [1], SamplingParams(stop_token_ids=(7,)))
    s.add("ignore", [1], SamplingParams(ignore_eos=True, max_tokens=2))
    step = s.schedule()
    assert step is not None
    by_seq = {c.seq_id: c for c in step.plan.chunks}
    tokens = {sid: (EOS if i != 1 else 7) for i, sid in enumerate(by_seq)}
    outs = s.update(step, [SampledToken(sid, t) for sid, t in tokens.items()])
    assert [(o.request_id, o.token is None, o.finish) for o in outs] == [
        ("eos", True, FinishReason.STOP),
        ("stop", True, FinishReason.STOP),
        ("ignore", False, None),
    ]


def test_abort_during_a_step_frees_now_and_update_ignores_it() -> None:
    s = make()
    s.add("a", [1, 2, 3], SamplingParams())
    s.add("b", [4, 5], SamplingParams())
    step = s.schedule()
    assert step is not None
    used = s.kv.pool.num_used
    assert s.abort("a") and not s.abort("a")
    assert s.kv.pool.num_used < used
    outs = s.update(step, answer(step))
    assert [o.request_id for o in outs] == ["b"]


def test_abort_waiting() -> None:
    s = make(max_running=1)
    s.add("a", [1], SamplingParams())
    s.add("b", [1], SamplingParams())
    run_step(s)
    assert s.abort("b") and s.num_waiting == 0
    assert not s.contains("b")


def test_mismatched_results_raise_and_change_nothing() -> None:
    s = make()
    s.add("a", [1, 2], SamplingParams())
    step = s.schedule()
    assert step is not None
    with pytest.raises(StepMismatch):
        s.update(step, [])
    with pytest.raises(StepMismatch):
        s.update(step, [*answer(step), SampledToken(99, 1)])
    assert s.update(step, answer(step))[0].token is not None


def test_failed_step_drops_its_requests_and_keeps_releases() -> None:
    s = make()
    s.add("a", [1], SamplingParams(max_tokens=1))
    run_step(s)  # a finished: its seq id is released in the next plan
    s.add("b", [1, 2], SamplingParams())
    step = s.schedule()
    assert step is not None and step.plan.released
    assert s.fail(step) == ["b"]
    assert s.kv.pool.num_used == 0
    s.add("c", [3], SamplingParams())
    step = s.schedule()
    assert step is not None
    assert step.plan.released == (0, 1)  # a's again (the failed plan may not have run), and b's


def test_add_rejects_bad_input() -> None:
    s = make()
    with pytest.raises(ValueError):
        s.add("a", [], SamplingParams())
    s.add("a", [1], SamplingParams())
    with pytest.raises(ValueError):
        s.add("a", [1], SamplingParams())
    with pytest.raises(ValueError):
        make(max_running=8, max_step_tokens=4)


def test_random_workload_keeps_the_pool_consistent() -> None:
    rng = random.Random(0)
    s = make(num_blocks=40, block_size=4, max_running=6, max_step_tokens=12)
    live: set[str] = set()
    for i in range(300):
        if rng.random() < 0.3:
            rid = f"r{i}"
            params = SamplingParams(max_tokens=rng.randint(1, 12), n=rng.choice([1, 1, 2, 3]))
            prompt = [rng.randint(1, 50) for _ in range(rng.randint(1, 20))]
            if s.blocks_needed(len(prompt), params) <= 40:
                s.add(rid, prompt, params)
                live.add(rid)
        if live and rng.random() < 0.05:
            s.abort(rng.choice(sorted(live)))
        step = s.schedule()
        if step is None:
            continue
        assert step.plan.num_tokens <= 12
        assert s.kv.pool.num_free >= s.kv.num_reserved
        tokens = [
            SampledToken(sp.seq_id, rng.choice([EOS, 5, 6, 7, 8]))
            for c in step.plan.chunks
            for sp in c.samples
        ]
        for out in s.update(step, tokens):
            if out.finish is not None and out.request_id not in s.running:
                live.discard(out.request_id)
        live &= set(s.running) | {g.request_id for g in s.waiting}
    for rid in list(live):
        s.abort(rid)
    assert s.kv.pool.num_used == 0 and s.kv.num_reserved == 0 and s.num_running == 0
