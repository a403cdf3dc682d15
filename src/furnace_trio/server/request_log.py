"""The per-request log line: status, token counts, queue time, prefill and decode rates.

:class:`RequestTiming` collects the times as a generation's events arrive; its
:meth:`~RequestTiming.log` runs once, when the response ends however it ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from furnace_trio.server.sse import Collector

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestTiming:
    """Times and counts for the per-request log line."""

    request_id: str
    started: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    queue_time: float = 0.0
    status: int = 200

    def log(self, collector: Collector) -> None:
        end = time.monotonic()
        generated = collector.completion_tokens
        prefill_rate = decode_rate = 0.0
        if self.admitted is not None and self.first_token is not None:
            prefill_s = self.first_token - self.admitted
            new_tokens = collector.prompt_tokens - collector.cached_tokens
            prefill_rate = new_tokens / prefill_s if prefill_s > 0 else 0.0
            decode_s = end - self.first_token
            decode_rate = (generated - collector.n) / decode_s if decode_s > 0 else 0.0
        reasons = ",".join(c.finish_reason or "-" for c in collector.choices)
        logger.info(
            "request %s status=%d prompt_tokens=%d cached_tokens=%d generated_tokens=%d "
            "queue_time=%.3fs prefill=%.1f tok/s decode=%.1f tok/s finish=%s total=%.3fs",
            self.request_id,
            self.status,
            collector.prompt_tokens,
            collector.cached_tokens,
            generated,
            self.queue_time,
            prefill_rate,
            max(decode_rate, 0.0),
            reasons,
            end - self.started,
        )
