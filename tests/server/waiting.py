"""Waiting for a state the server reaches on another thread or task, bounded in time.

The tests here serve over a real socket and run the model step on a worker thread, so
Trio's autojump clock cannot stand in for time, and the engine offers no event for a
change of its statistics: :func:`wait_until` checks a condition every 10 ms and fails the
test, naming what it waited for, if the condition does not hold within ``timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from furnace_trio.engine import Engine


async def wait_until(
    condition: Callable[[], object], what: str = "the condition", *, timeout_s: float = 5.0
) -> None:
    """Return once ``condition()`` is true; an ``AssertionError`` after ``timeout_s``."""
    with trio.move_on_after(timeout_s):
        while True:
            if condition():
                return
            await trio.sleep(0.01)
    raise AssertionError(f"{what} not reached in {timeout_s} s")


def engine_idle(engine: Engine) -> bool:
    """Nothing runs or waits, and every KV block is free."""
    stats = engine.statistics()
    return stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0
