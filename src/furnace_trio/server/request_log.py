"""The per-request log line: status, token counts, queue time, prefill and decode rates.

:class:`RequestTiming` collects the times as a generation's events arrive, and counts the
tokens of every delta the handler takes off the engine's stream (:meth:`~RequestTiming.observe`):
the usage's ``completion_tokens`` only comes with a sample's ``Finished``, which a stream
the client left never gets. Its :meth:`~RequestTiming.log` runs once, when the response
ends however it ends, and writes one line, whose numbers the JSON log format also carries
as fields (:mod:`furnace_trio.server.log_setup`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from furnace_trio.engine import Delta
from furnace_trio.server.log_setup import FIELDS
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
    #: Tokens of the deltas taken off the engine's stream, every sample together.
    streamed_tokens: int = 0

    def observe(self, event: object) -> None:
        """Count an engine event's tokens (before any tool-call or echo translation, which
        may hold text back but not the tokens the model generated)."""
        if isinstance(event, Delta):
            self.streamed_tokens += len(event.token_ids)

    def log(self, collector: Collector) -> None:
        end = time.monotonic()
        # Finished samples report their usage; an aborted one only what it streamed.
        generated = max(collector.completion_tokens, self.streamed_tokens)
        prefill_rate = decode_rate = 0.0
        if self.admitted is not None and self.first_token is not None:
            prefill_s = self.first_token - self.admitted
            new_tokens = collector.prompt_tokens - collector.cached_tokens
            prefill_rate = new_tokens / prefill_s if prefill_s > 0 else 0.0
            decode_s = end - self.first_token
            decode_rate = (generated - collector.n) / decode_s if decode_s > 0 else 0.0
        decode_rate = max(decode_rate, 0.0)
        reasons = ",".join(c.finish_reason or "-" for c in collector.choices)
        fields = {
            "request_id": self.request_id,
            "status": self.status,
            "prompt_tokens": collector.prompt_tokens,
            "cached_tokens": collector.cached_tokens,
            "generated_tokens": generated,
            "queue_time_s": round(self.queue_time, 6),
            "prefill_tok_s": round(prefill_rate, 1),
            "decode_tok_s": round(decode_rate, 1),
            "finish": reasons,
            "total_s": round(end - self.started, 6),
        }
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
            decode_rate,
            reasons,
            end - self.started,
            extra={FIELDS: fields},
        )
