"""One model step of the engine's loop: run a scheduled step, then settle its results.

:meth:`Stepper.step` runs the step's plan on the model thread and applies what it sampled:
the scheduler advances its sequences (:meth:`~furnace_trio.engine.scheduler.Scheduler.update`),
the step's time and rate are recorded, the tokens go out through the
:class:`~furnace_trio.engine.delivery.Outbox`, and the pacer measures the step.

- Failure isolation: when ``runner.step`` raises, the step's requests run again in halves
  on the model thread until each failing one ran alone (:mod:`~furnace_trio.engine.isolation`):
  only those fail, and the others go on with the tokens their re-run drew. A runner's
  output that does not answer the plan (:class:`StepMismatch`) fails the step's requests.
- Watchdog: a step that runs past ``step_timeout_s`` raises :class:`StepAbandoned` out of
  :meth:`Stepper.step`; its thread is abandoned, not stopped (it finishes on its own), and
  the engine dies, so no other step ever starts.
"""

from __future__ import annotations

import logging
import math

import trio

from furnace_trio.core.plan import SampledToken, StepPlan, StepRunner
from furnace_trio.engine.delivery import Outbox
from furnace_trio.engine.events import FailureCause
from furnace_trio.engine.isolation import StepAbandoned, run_isolating
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.engine.pacing import StepPacer
from furnace_trio.engine.scheduler import ScheduledStep, Scheduler, StepMismatch
from furnace_trio.engine.stats import EngineMetrics
from furnace_trio.engine.status import StepRate

__all__ = ["Stepper"]

logger = logging.getLogger(__name__)


class Stepper:
    """Runs the engine's steps on its model thread and settles their results.

    ``step_timeout_s`` (``None``: no watchdog) may change between steps
    (:meth:`Engine.reconfigure <furnace_trio.engine.Engine.reconfigure>`).
    """

    def __init__(
        self,
        runner: StepRunner,
        model_thread: ModelThread,
        scheduler: Scheduler,
        outbox: Outbox,
        metrics: EngineMetrics,
        steps: StepRate,
        pacer: StepPacer | None,
        step_timeout_s: float | None,
    ) -> None:
        self._runner = runner
        self._model_thread = model_thread
        self._scheduler = scheduler
        self._outbox = outbox
        self._metrics = metrics
        self._steps = steps
        self._pacer = pacer
        self.step_timeout_s = step_timeout_s

    async def step(self, step: ScheduledStep) -> None:
        """Run ``step`` and settle it. Raises :class:`StepAbandoned` when the watchdog fired."""
        started = trio.current_time()
        if self._pacer is not None:
            self._pacer.start()
        step, sampled = await self._run(step)
        try:
            outputs = self._scheduler.update(step, sampled)
        except StepMismatch as exc:
            logger.error("Bad runner output: %s", exc)
            self._fail_step(step, f"the model failed: {exc}")
            return
        now = trio.current_time()
        self._steps.record(now)
        if step.num_prefill_tokens:
            self._metrics.prefill_step_time.observe(now - started)
        else:
            self._metrics.decode_step_time.observe(now - started)
        self._outbox.deliver(outputs, now)
        if self._pacer is not None:
            self._pacer.finish(
                step.num_prefill_tokens, step.num_decode_tokens + step.num_draft_tokens
            )

    async def _run(self, step: ScheduledStep) -> tuple[ScheduledStep, list[SampledToken]]:
        """Run ``step``; if it raises, find the requests that make it raise and fail only
        them (:func:`~furnace_trio.engine.isolation.isolate`). The step that ran and its
        tokens: ``step`` itself, or the part of it whose requests did not fail."""
        isolated = await run_isolating(step.plan, self._scheduler.request_of, self._run_step)
        if isolated.plan is step.plan:
            return step, isolated.sampled
        for request_id, failure in isolated.failures.items():
            self._scheduler.abort(request_id)
            self._outbox.fail(request_id, f"the model failed: {failure}", FailureCause.MODEL)
        return self._scheduler.narrow(step, isolated.plan), isolated.sampled

    async def _run_step(self, plan: StepPlan) -> list[SampledToken]:
        """Run the model step on the model thread under the watchdog.

        The scope is shielded, so only its own deadline (the watchdog) cancels it: an
        outer cancellation waits for the step, as ``abandon_on_cancel=False`` would. When
        the watchdog fires the thread is abandoned, not stopped; it finishes on its own.
        """
        timeout = self.step_timeout_s
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        with trio.CancelScope(deadline=deadline, shield=True):
            return await self._model_thread.run(self._runner.step, plan)
        raise StepAbandoned(f"a model step ran past the watchdog of {timeout} s")

    def _fail_step(self, step: ScheduledStep, message: str) -> None:
        for request_id in self._scheduler.fail(step):
            self._outbox.fail(request_id, message, FailureCause.MODEL)
