"""Prefill chunks sized by measured step time (``FURNACE_TARGET_ITL_MS``).

A fixed token budget per step (``max_step_tokens``) decides how much of a long prompt
joins a step whatever the hardware: on a slow CPU a 512-token chunk makes every running
stream wait a long step, on a GPU it barely shows. The :class:`StepPacer` learns what a
step costs on this machine and sizes the prefill so that a step with running decodes
takes about ``target_s``, the inter-token latency the decoding streams should see::

    step time  ~  decode_step(D)  +  prefill_token_s * P

    decode_step(D) = base + per_row * D     (fit on steps without prefill)
    prefill_token_s                         (what a step's prefill adds, per token)

    chunk P = (target - decode_step(D)) / prefill_token_s, within [min_chunk, cap]

- Both parts are learned online from the durations of real steps, exponentially weighted
  so that they follow the machine (other load, longer contexts): ``decode_step`` is a
  weighted least-squares line of step time against decode rows over the steps without
  prefill; ``prefill_token_s`` is the weighted ratio of what the prefill steps took beyond
  their decodes' share to their prefill tokens (a least-squares fit through the origin
  whose noise grows with the chunk). They are kept apart, each forgetting only with its
  own kind of step, so that a long run of decode-only steps never washes out what the
  last prompt taught about prefill.
- A lone prompt (no decodes running) gets the whole ``cap``: nobody waits on its steps.
  Before a prefill step has been measured, so does every prompt (the fixed budget).
- ``min_chunk`` guarantees progress: when the decodes alone already take the target, a
  prompt still advances ``min_chunk`` tokens a step instead of waiting for them to end.
- Odd measurements do not break it: zero, negative or non-finite durations are ignored,
  and once a prediction exists a measurement counts as at most ``max_ratio`` times (at
  least a ``1/max_ratio``-th of) what was predicted, so an outlier (a page fault storm, a
  step re-run after a failure) moves the estimates by a bounded step and a real change
  of speed is still followed within a few steps.

Plain Python with an injected clock (``time.perf_counter`` by default): the engine calls
:meth:`StepPacer.start` and :meth:`StepPacer.finish` around each step on the Trio thread,
and the scheduler asks :meth:`StepPacer.prefill_budget` while planning. Tests drive it
with a fake clock and scripted step times.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PacingStatus", "StepPacer"]


@dataclass(frozen=True, slots=True)
class PacingStatus:
    """What the pacer has learned, for ``/status`` and ``/metrics`` (seconds).

    ``None`` where nothing has been measured yet. ``chunk_tokens`` is the prefill budget
    the last step was given (the whole cap for a lone prompt).
    """

    target_s: float
    prefill_token_s: float | None
    decode_base_s: float | None
    decode_row_s: float | None
    chunk_tokens: int | None
    steps_measured: int
    measurements_ignored: int


class _Line:
    """Exponentially weighted least-squares line ``y = a + b x``, slope kept >= 0.

    ``ridge`` (in x units squared) damps the slope when the xs barely vary, so a run of
    steps with one batch size gives a flat line through their mean instead of a wild one.
    """

    __slots__ = ("_sw", "_sx", "_sxx", "_sxy", "_sy", "decay", "ridge")

    def __init__(self, decay: float, ridge: float) -> None:
        self.decay = decay
        self.ridge = ridge
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0

    @property
    def empty(self) -> bool:
        return self._sw == 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self._sw = d * self._sw + 1.0
        self._sx = d * self._sx + x
        self._sy = d * self._sy + y
        self._sxx = d * self._sxx + x * x
        self._sxy = d * self._sxy + x * y

    def coefficients(self) -> tuple[float, float] | None:
        """``(a, b)``; ``None`` when empty."""
        if self._sw == 0.0:
            return None
        mx, my = self._sx / self._sw, self._sy / self._sw
        var = max(self._sxx / self._sw - mx * mx, 0.0)
        cov = self._sxy / self._sw - mx * my
        slope = max(cov / (var + self.ridge), 0.0)
        return my - slope * mx, slope

    def predict(self, x: float) -> float | None:
        ab = self.coefficients()
        return None if ab is None else max(ab[0] + ab[1] * x, 0.0)


class StepPacer:
    """Sizes prefill chunks so that steps with running decodes take about ``target_s``.

    See the module docstring for the model. ``decay`` is the weight a decode-only step's
    measurement keeps per later decode-only step, ``prefill_decay`` the same for steps
    with prefill (fewer, and their cost changes along a prompt, so they forget faster).
    """

    def __init__(
        self,
        target_s: float,
        *,
        clock: Callable[[], float] = time.perf_counter,
        min_chunk: int = 16,
        decay: float = 0.95,
        prefill_decay: float = 0.8,
        max_ratio: float = 4.0,
    ) -> None:
        if not (target_s > 0 and math.isfinite(target_s)):
            raise ValueError("target_s must be a finite number > 0")
        if min_chunk < 1:
            raise ValueError("min_chunk must be at least 1")
        if not (0 < decay < 1 and 0 < prefill_decay < 1):
            raise ValueError("decay and prefill_decay must be between 0 and 1")
        if not max_ratio > 1:
            raise ValueError("max_ratio must be > 1")
        self.target_s = target_s
        self.clock = clock
        self.min_chunk = min_chunk
        self.max_ratio = max_ratio
        self._decode = _Line(decay, ridge=0.25)
        self._prefill_decay = prefill_decay
        self._prefill_s = 0.0  # weighted seconds beyond the decodes' share
        self._prefill_tokens = 0.0  # weighted prefill tokens
        self._started: float | None = None
        self.chunk_tokens: int | None = None
        self.steps_measured = 0
        self.measurements_ignored = 0

    # -- what it has learned -----------------------------------------------------------------

    @property
    def prefill_token_s(self) -> float | None:
        """Seconds a prefill token adds to a step; ``None`` before any was measured."""
        if self._prefill_tokens == 0.0:
            return None
        return max(self._prefill_s / self._prefill_tokens, 1e-12)

    def decode_step_s(self, decode_rows: int) -> float | None:
        """Predicted seconds of a step of ``decode_rows`` decodes and no prefill."""
        return self._decode.predict(decode_rows)

    def predict(self, prefill_tokens: int, decode_rows: int) -> float | None:
        """Predicted seconds of a step; ``None`` until both parts have been measured."""
        decode = self._decode.predict(decode_rows)
        per_token = self.prefill_token_s
        if prefill_tokens and per_token is None:
            return None
        if decode is None:
            # nothing decode-only measured yet: a decode row costs what a prefill token does
            return None if per_token is None else per_token * (prefill_tokens + decode_rows)
        return decode + (per_token or 0.0) * prefill_tokens

    def status(self) -> PacingStatus:
        line = self._decode.coefficients()
        return PacingStatus(
            target_s=self.target_s,
            prefill_token_s=self.prefill_token_s,
            decode_base_s=None if line is None else line[0],
            decode_row_s=None if line is None else line[1],
            chunk_tokens=self.chunk_tokens,
            steps_measured=self.steps_measured,
            measurements_ignored=self.measurements_ignored,
        )

    # -- planning ----------------------------------------------------------------------------

    def prefill_budget(self, decode_rows: int, cap: int) -> int:
        """Prefill tokens for a step that also decodes ``decode_rows`` rows, at most ``cap``
        (what the fixed token budget leaves): the whole ``cap`` for a lone prompt or before
        prefill has been measured, else what fits the target, and never under ``min_chunk``
        (unless ``cap`` is smaller)."""
        cap = max(cap, 0)
        per_token = self.prefill_token_s
        if decode_rows <= 0 or per_token is None:
            chunk = cap
        else:
            decode = self.predict(0, decode_rows) or 0.0
            spare = self.target_s - decode
            fit = spare / per_token if spare > 0 else 0.0
            chunk = min(max(int(min(fit, cap)), self.min_chunk), cap)
        self.chunk_tokens = chunk
        return chunk

    # -- measuring ---------------------------------------------------------------------------

    def start(self) -> None:
        """A step starts now (the engine calls this right before running it)."""
        self._started = self.clock()

    def finish(self, prefill_tokens: int, decode_rows: int) -> None:
        """The step started by :meth:`start` is done: learn from how long it took. Nothing
        without a :meth:`start` (a step that ended in failure is not measured)."""
        started, self._started = self._started, None
        if started is not None:
            self.observe(prefill_tokens, decode_rows, self.clock() - started)

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """Learn from one step of ``prefill_tokens`` and ``decode_rows`` that took
        ``seconds``. Zero, negative and non-finite durations, and empty steps, are ignored;
        a duration far from the prediction is clipped to ``max_ratio`` times it."""
        if not (math.isfinite(seconds) and seconds > 0) or prefill_tokens + decode_rows <= 0:
            self.measurements_ignored += 1
            return
        if prefill_tokens < 0 or decode_rows < 0:
            self.measurements_ignored += 1
            return
        predicted = self.predict(prefill_tokens, decode_rows)
        if predicted is not None and predicted > 0:
            seconds = min(max(seconds, predicted / self.max_ratio), predicted * self.max_ratio)
        self.steps_measured += 1
        if prefill_tokens == 0:
            self._decode.add(decode_rows, seconds)
            return
        decode = self._decode.predict(decode_rows)
        if decode is None:
            # no decode-only step yet: the whole step is the prefill's (rows as tokens)
            prefill_s, tokens = seconds, prefill_tokens + decode_rows
        else:
            prefill_s, tokens = max(seconds - decode, 0.0), prefill_tokens
        d = self._prefill_decay
        self._prefill_s = d * self._prefill_s + prefill_s
        self._prefill_tokens = d * self._prefill_tokens + tokens
