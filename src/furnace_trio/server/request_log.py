"""The per-request log line: status, token counts, context and KV fullness, queue time,
prefill and decode rates.

:class:`RequestTiming` collects the times as a generation's events arrive, and counts the
tokens of every delta the handler takes off the engine's stream (:meth:`~RequestTiming.observe`):
the usage's ``completion_tokens`` only comes with a sample's ``Finished``, which a stream
the client left never gets. Its :meth:`~RequestTiming.log` runs once, when the response
ends however it ends, and writes one line, whose numbers the JSON log format also carries
as fields (:mod:`furnace_trio.server.log_setup`). The line also says how close the request came to the context limit (``context=<tokens>/<max>``: its
longest prompt plus its longest choice) and how full the KV cache was when it ended
(``kv=<used>/<total>`` blocks), the two limits an operator tunes, and the name of the API
key it was served under (``key=<name>``, ``-`` on a server without keys; never the key).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from furnace_trio.engine import Delta, Finished
from furnace_trio.server.log_setup import FIELDS
from furnace_trio.server.sse import Collector

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestTiming:
    """Times and counts for the per-request log line.

    ``kv_blocks`` reads the engine's (used, total) KV blocks when the line is written.
    """

    request_id: str
    started: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    queue_time: float = 0.0
    status: int = 200
    longest_prompt: int = 0
    max_context: int = 0
    kv_blocks: Callable[[], tuple[int, int]] | None = None
    #: Tokens of the deltas taken off the engine's stream, every sample together.
    streamed_tokens: int = 0
    #: The name of the API key it was served under (``None``: a server without keys).
    key_name: str | None = None
    #: Speculative decoding, every finished sample together: drafts run, and accepted.
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    def observe(self, event: object) -> None:
        """Count an engine event's tokens (before any tool-call or echo translation, which
        may hold text back but not the tokens the model generated)."""
        if isinstance(event, Delta):
            self.streamed_tokens += len(event.token_ids)
        elif isinstance(event, Finished):
            self.drafted_tokens += event.drafted_tokens
            self.accepted_tokens += event.accepted_tokens

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
        longest = max((c.completion_tokens for c in collector.choices), default=0)
        kv_used, kv_total = self.kv_blocks() if self.kv_blocks is not None else (0, 0)
        fields = {
            "request_id": self.request_id,
            "status": self.status,
            "api_key_name": self.key_name,
            "prompt_tokens": collector.prompt_tokens,
            "cached_tokens": collector.cached_tokens,
            "generated_tokens": generated,
            "context_tokens": (self.longest_prompt or collector.prompt_tokens) + longest,
            "max_context": self.max_context,
            "kv_blocks_used": kv_used,
            "kv_blocks_total": kv_total,
            "queue_time_s": round(self.queue_time, 6),
            "prefill_tok_s": round(prefill_rate, 1),
            "decode_tok_s": round(decode_rate, 1),
            "finish": reasons,
            "total_s": round(end - self.started, 6),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
        }
        logger.info(
            "request %s status=%d prompt_tokens=%d cached_tokens=%d generated_tokens=%d "
            "context=%d/%d kv=%d/%d blocks (%.0f%%) "
            "queue_time=%.3fs prefill=%.1f tok/s decode=%.1f tok/s finish=%s total=%.3fs key=%s "
            "drafted=%d accepted=%d",
            self.request_id,
            self.status,
            collector.prompt_tokens,
            collector.cached_tokens,
            generated,
            (self.longest_prompt or collector.prompt_tokens) + longest,
            self.max_context,
            kv_used,
            kv_total,
            100 * kv_used / kv_total if kv_total else 0.0,
            self.queue_time,
            prefill_rate,
            decode_rate,
            reasons,
            end - self.started,
            self.key_name or "-",
            self.drafted_tokens,
            self.accepted_tokens,
            extra={FIELDS: fields},
        )
