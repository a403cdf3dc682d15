"""The model thread: every call on one thread, in order; errors and cancellation."""

from __future__ import annotations

import threading
import time

import pytest
import trio
import trio.testing

from furnace_trio.engine import Engine, EngineConfig
from furnace_trio.engine.model_thread import ModelThread

from ..scripted import EOS, ScriptedRunner, decode, token_bytes
from .harness import collect, request


async def test_calls_run_on_one_thread_in_order() -> None:
    thread = ModelThread()
    seen: list[tuple[int, int]] = []

    def job(i: int) -> int:
        seen.append((threading.get_ident(), i))
        return i * 2

    results = [await thread.run(job, i) for i in range(5)]
    results.append(await trio.to_thread.run_sync(thread.call, job, 5))
    assert results == [0, 2, 4, 6, 8, 10]
    assert [i for _, i in seen] == list(range(6))
    assert len({ident for ident, _ in seen}) == 1
    assert seen[0][0] != threading.get_ident()
    thread.close()


async def test_exceptions_reach_the_caller() -> None:
    thread = ModelThread()

    def boom() -> None:
        raise ValueError("bad step")

    with pytest.raises(ValueError, match="bad step"):
        await thread.run(boom)
    assert await thread.run(lambda: "still serving") == "still serving"
    thread.close()


class _Fatal(BaseException):
    """Not an Exception: still handed to the caller, and the thread keeps serving."""


async def test_base_exceptions_reach_the_caller() -> None:
    thread = ModelThread()

    def fatal() -> None:
        raise _Fatal("stop")

    with pytest.raises(_Fatal, match="stop"):
        await thread.run(fatal)
    assert await thread.run(lambda: 42) == 42
    thread.close()


def test_a_call_outliving_its_trio_run_does_not_stop_the_thread() -> None:
    """The run that waited is over when the call ends (its result has nowhere to go)."""
    thread = ModelThread()
    release = threading.Event()

    def slow() -> str:
        release.wait(10)
        return "late"

    async def give_up() -> None:
        with trio.move_on_after(0.05):
            await thread.run(slow)

    trio.run(give_up, clock=trio.testing.MockClock(autojump_threshold=0))
    release.set()
    assert thread.submit(lambda: "alive").result(timeout=10) == "alive"
    thread.close()


async def test_a_cancelled_call_is_abandoned_and_later_calls_queue_behind_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    thread = ModelThread()
    release = threading.Event()
    finished: list[str] = []

    def slow() -> None:
        release.wait(10)
        finished.append("slow")

    with trio.move_on_after(0.05) as scope:
        await thread.run(slow)
    assert scope.cancelled_caught and finished == []
    release.set()
    await thread.run(lambda: finished.append("next"))
    assert finished == ["slow", "next"]
    thread.close()


def test_close_lets_the_thread_exit() -> None:
    thread = ModelThread(name="furnace-model-test-close")
    thread.call(time.sleep, 0)
    thread.close()
    for t in threading.enumerate():
        if t.name == "furnace-model-test-close":
            t.join(timeout=1)
    if any(t.name == "furnace-model-test-close" for t in threading.enumerate()):
        pytest.fail("the model thread did not exit after close()")


async def test_engine_steps_all_run_on_the_model_thread() -> None:
    """The engine's steps never hop threads (OpenMP teams are per thread)."""
    idents: set[int] = set()

    class Recording(ScriptedRunner):
        def step(self, plan):  # type: ignore[no-untyped-def]
            idents.add(threading.get_ident())
            return super().step(plan)

    thread = ModelThread()
    loader_ident = thread.call(threading.get_ident)
    runner = Recording()
    engine = Engine(
        runner,
        decode=decode,
        eos_token_ids=frozenset({EOS}),
        token_bytes=token_bytes,
        config=EngineConfig(),
        model_thread=thread,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with trio.open_nursery() as clients:
            for i in range(4):
                clients.start_soon(collect, engine.submit(request(f"hi {i}", max_tokens=5)))
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    assert len(runner.plans) > 3
    assert idents == {loader_ident}
