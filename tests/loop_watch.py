"""How long a server's event loop stalls while something else happens.

Two probes run side by side until the block ends:

- ``/health`` round trips every 10 ms on a connection of their own, warmed up first: what
  any other client of the server sees;
- when the server runs in this process (the test servers do), a task that sleeps 10 ms
  at a time and records how late it wakes: the loop's own stall, without the HTTP work.

A stall is the longest of either. The bound the tests assert (:data:`STALL_LIMIT_S`,
100 ms) is about ten times what the probes see on a quiet 2-core machine, and the work
they watch stalls the loop for seconds when it runs on it, so the verdict does not hinge
on timing noise. ``samples`` says how many round trips fell inside the block, so a test can
tell that the probes ran while the work did.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import trio

STALL_LIMIT_S = 0.1
INTERVAL_S = 0.01


@dataclass(slots=True)
class LoopWatch:
    """The longest ``/health`` round trip and the longest late wake-up seen so far."""

    longest_health_s: float = 0.0
    longest_lag_s: float = 0.0
    samples: int = 0

    @property
    def longest_stall_s(self) -> float:
        return max(self.longest_health_s, self.longest_lag_s)

    def __str__(self) -> str:
        return (
            f"longest /health round trip {self.longest_health_s * 1000:.0f} ms, longest late "
            f"wake-up {self.longest_lag_s * 1000:.0f} ms, {self.samples} round trips"
        )


@asynccontextmanager
async def watch_loop(url: str, *, in_process: bool = True) -> AsyncIterator[LoopWatch]:
    """Probe the server at ``url`` for the duration of the block (see the module docstring)."""
    watch = LoopWatch()
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for _ in range(3):  # connection set up, first-request costs paid
            (await http.get("/health")).raise_for_status()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_health, http, watch)
            if in_process:
                nursery.start_soon(_lag, watch)
            try:
                yield watch
            finally:
                nursery.cancel_scope.cancel()


async def _health(http: httpx.AsyncClient, watch: LoopWatch) -> None:
    while True:
        started = time.perf_counter()
        response = await http.get("/health")
        watch.longest_health_s = max(watch.longest_health_s, time.perf_counter() - started)
        watch.samples += 1
        response.raise_for_status()
        await trio.sleep(INTERVAL_S)


async def _lag(watch: LoopWatch) -> None:
    while True:
        started = time.perf_counter()
        await trio.sleep(INTERVAL_S)
        late = time.perf_counter() - started - INTERVAL_S
        watch.longest_lag_s = max(watch.longest_lag_s, late)
