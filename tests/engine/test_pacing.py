"""The prefill pacer against scripted step times on a fake clock (no real time anywhere).

The scripted machine: a step of ``D`` decode rows and ``P`` prefill tokens takes
``BASE + ROW * D + TOKEN * P`` seconds. With 8 decodes and a 20 ms target the chunk that
fits is ``(0.020 - 0.006) / 0.0001 = 140`` tokens.
"""

from __future__ import annotations

import math

import pytest

from furnace_trio.engine.pacing import StepPacer

BASE, ROW, TOKEN = 0.002, 0.0005, 0.0001
TARGET = 0.020
CAP = 512
FIT = 140  # prefill tokens that fit the target beside 8 decodes


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step_time(prefill: int, decodes: int, *, slow: float = 1.0) -> float:
    return slow * (BASE + ROW * decodes + TOKEN * prefill)


def run_step(pacer: StepPacer, clock: FakeClock, decodes: int, seconds: float | None = None, *,
             want: int = 10_000, slow: float = 1.0) -> tuple[int, float]:  # fmt: skip
    """One step as the engine runs it: plan (ask the budget), time it, learn. The prefill
    it got and the time it took."""
    prefill = min(pacer.prefill_budget(decodes, CAP - decodes), want)
    took = step_time(prefill, decodes, slow=slow) if seconds is None else seconds
    pacer.start()
    clock.now += took
    pacer.finish(prefill, decodes)
    return prefill, took


def warmed(decode_steps: int = 8) -> tuple[StepPacer, FakeClock]:
    clock = FakeClock()
    pacer = StepPacer(TARGET, clock=clock)
    for rows in range(decode_steps):
        run_step(pacer, clock, 4 + rows % 5, want=0)  # decode-only steps, 4..8 rows
    return pacer, clock


def test_chunks_converge_so_mixed_steps_take_the_target() -> None:
    pacer, clock = warmed()
    chunks, times = [], []
    for _ in range(30):
        prefill, took = run_step(pacer, clock, 8)
        chunks.append(prefill)
        times.append(took)
    assert chunks[0] == CAP - 8  # nothing known about prefill yet: the fixed budget
    assert all(abs(c - FIT) <= 2 for c in chunks[5:]), chunks
    assert all(t <= TARGET * 1.02 for t in times[5:]), times
    status = pacer.status()
    assert status.prefill_token_s == pytest.approx(TOKEN, rel=0.02)
    # the line through the decode-only steps (its slope damped a little by the ridge)
    assert pacer.decode_step_s(8) == pytest.approx(step_time(0, 8), rel=0.05)
    assert status.decode_row_s == pytest.approx(ROW, rel=0.2)
    assert status.chunk_tokens == chunks[-1]


def test_learns_without_any_decode_only_step_first() -> None:
    clock = FakeClock()
    pacer = StepPacer(TARGET, clock=clock)
    chunks = [run_step(pacer, clock, 8)[0] for _ in range(40)]
    assert all(abs(c - FIT) <= 3 for c in chunks[-10:]), chunks


def test_a_lone_prompt_gets_the_whole_budget() -> None:
    pacer, clock = warmed()
    for _ in range(10):
        run_step(pacer, clock, 8)
    assert pacer.prefill_budget(8, CAP - 8) < CAP // 2
    for _ in range(5):
        prefill, _ = run_step(pacer, clock, 0)
        assert prefill == CAP
    assert pacer.status().chunk_tokens == CAP


def test_the_cap_holds() -> None:
    pacer, clock = warmed()
    for _ in range(10):
        run_step(pacer, clock, 8)
    # a generous target: what fits is more than the cap, the cap wins
    pacer.target_s = 10.0
    assert pacer.prefill_budget(8, 100) == 100
    assert pacer.prefill_budget(8, 3) == 3  # under min_chunk too
    assert pacer.prefill_budget(8, 0) == 0
    assert pacer.prefill_budget(8, -5) == 0
    assert pacer.prefill_budget(0, 7) == 7


def test_decodes_over_the_target_still_leave_min_chunk() -> None:
    clock = FakeClock()
    pacer = StepPacer(0.004, clock=clock, min_chunk=16)  # 8 decodes alone take 6 ms
    for _ in range(5):
        run_step(pacer, clock, 8, want=0)
    chunks = [run_step(pacer, clock, 8)[0] for _ in range(10)]
    assert chunks[-5:] == [16] * 5


def test_zero_negative_and_non_finite_durations_are_ignored() -> None:
    pacer, clock = warmed()
    for _ in range(10):
        run_step(pacer, clock, 8)
    before = pacer.status()
    for seconds in (0.0, -1.0, math.nan, math.inf, -math.inf):
        pacer.observe(FIT, 8, seconds)
    pacer.observe(0, 0, 0.01)  # an empty step
    pacer.observe(-3, 8, 0.01)
    after = pacer.status()
    assert after.measurements_ignored == before.measurements_ignored + 7
    assert after.prefill_token_s == before.prefill_token_s
    assert after.decode_base_s == before.decode_base_s
    assert pacer.prefill_budget(8, CAP - 8) == before.chunk_tokens


@pytest.mark.parametrize("outlier", [1000.0, 1e-9])
def test_an_outlier_moves_the_chunk_a_bounded_step_and_it_recovers(outlier: float) -> None:
    pacer, clock = warmed()
    for _ in range(15):
        run_step(pacer, clock, 8)
    run_step(pacer, clock, 8, seconds=outlier)
    after = [run_step(pacer, clock, 8)[0] for _ in range(30)]
    assert FIT / 3 <= after[0] <= min(FIT * 3, CAP - 8), after
    assert all(abs(c - FIT) <= 3 for c in after[-5:]), after
    # an outlier in a decode-only step as well
    run_step(pacer, clock, 8, seconds=outlier, want=0)
    after = [run_step(pacer, clock, 8)[0] for _ in range(30)]
    assert all(abs(c - FIT) <= 3 for c in after[-5:]), after


def test_follows_a_machine_that_gets_slower() -> None:
    pacer, clock = warmed()
    for _ in range(15):
        run_step(pacer, clock, 8)
    # everything takes twice as long now (other load): decodes alone 12 ms, 40 tokens fit
    for _ in range(60):
        run_step(pacer, clock, 8, want=0, slow=2.0)
        prefill, took = run_step(pacer, clock, 8, slow=2.0)
    assert abs(prefill - 40) <= 2
    assert took <= TARGET * 1.02


def test_bad_settings_are_refused() -> None:
    for target in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            StepPacer(target)
    with pytest.raises(ValueError):
        StepPacer(0.02, min_chunk=0)
    with pytest.raises(ValueError):
        StepPacer(0.02, decay=1.0)
    with pytest.raises(ValueError):
        StepPacer(0.02, max_ratio=1.0)


def test_finish_without_start_learns_nothing() -> None:
    clock = FakeClock()
    pacer = StepPacer(TARGET, clock=clock)
    pacer.finish(100, 8)
    assert pacer.status().steps_measured == 0
    assert pacer.prefill_budget(8, 200) == 200
