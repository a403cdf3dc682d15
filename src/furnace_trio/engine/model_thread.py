"""One long-lived thread for every call into the model (loading, warm-up, steps).

Why not ``trio.to_thread``: torch (and the native kernels) parallelise with OpenMP, whose
thread teams belong to the thread that starts a parallel region. Every new thread that
runs torch gets a team of its own, and once the process holds more OpenMP threads than
CPUs, libgomp stops spinning between parallel regions and puts its threads to sleep after
each one: a decode step has a few hundred regions, and each wake-up costs tens of
microseconds. Trio's thread cache hands work to whichever idle thread it has, so the
model's thread would change from call to call; a :class:`ModelThread` never changes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")


class ModelThread:
    """A daemon thread that runs submitted calls one at a time, in order."""

    def __init__(self, name: str = "furnace-model") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)``; its future holds the result or the exception."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, whatever it is
                future.set_exception(exc)
            else:
                future.set_result(result)

        self._jobs.put(job)
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread and wait for it (from a thread that may block)."""
        return self.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread without blocking Trio.

        If the caller is cancelled the call is abandoned, not stopped: it finishes on the
        thread, and later calls queue behind it.

        The result goes straight back to the waiting task (``reschedule`` through
        ``run_sync_soon``), without a Future or an Event: this is on the path of every
        model step, and a Future and an Event add about a third to a round trip whose
        cost is otherwise mostly waking the two threads (docs/history.md).
        """
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
        abandoned = False

        def deliver(result: outcome.Outcome[T]) -> None:
            if not abandoned:
                trio.lowlevel.reschedule(task, result)

        def job() -> None:
            result = outcome.capture(fn, *args)  # any exception, BaseException included
            # If the Trio run that waited is over, nobody wants the result.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(deliver, result)

        def abort(_: Any) -> trio.lowlevel.Abort:
            nonlocal abandoned
            abandoned = True
            return trio.lowlevel.Abort.SUCCEEDED

        self._jobs.put(job)
        result: T = await trio.lowlevel.wait_task_rescheduled(abort)
        return result

    def close(self) -> None:
        """Let the thread exit once the calls already queued have run."""
        self._jobs.put(None)
