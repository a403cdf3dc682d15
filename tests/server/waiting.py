"""Waiting, bounded in time, for a state the server reaches on another task or thread.

The tests here serve over a real socket and run the model step on a worker thread, so
Trio's autojump clock cannot stand in for time. Engine states are waited for as events:
:func:`engine_reaches` parks on :meth:`~furnace_trio.engine.Engine.wait_statistics`, which
wakes after every change the statistics show. :func:`wait_until` polls, and is kept for
what has no event: state that hypercorn and the app's tasks reach by reacting to socket
I/O (a response counted, a handler task ended), which only the kernel's delivery of the
bytes moves forward.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from furnace_trio.engine import Engine, EngineStatistics


async def engine_reaches(
    engine: Engine,
    condition: Callable[[EngineStatistics], object],
    what: str = "the condition",
    *,
    timeout_s: float = 5.0,
) -> EngineStatistics:
    """The first statistics for which ``condition`` holds; an ``AssertionError`` naming
    ``what`` after ``timeout_s``."""
    with trio.move_on_after(timeout_s):
        return await engine.wait_statistics(condition)
    raise AssertionError(f"{what} not reached in {timeout_s} s: {engine.statistics()}")


async def wait_until(
    condition: Callable[[], object], what: str = "the condition", *, timeout_s: float = 5.0
) -> None:
    """Return once ``condition()`` is true, checked every 10 ms; an ``AssertionError`` after
    ``timeout_s``. Only for state without an event (see the module docstring)."""
    with trio.move_on_after(timeout_s):
        while True:
            if condition():
                return
            await trio.sleep(0.01)
    raise AssertionError(f"{what} not reached in {timeout_s} s")


def engine_idle(stats: EngineStatistics) -> bool:
    """Nothing runs or waits, and every KV block is free."""
    return stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0
