"""The engine's configuration: batch sizes, context, sessions, prefix cache, watchdog,
pacing.

Frozen and validated at construction, so the engine and the HTTP layer read settings
from one place and never check them again. A running engine takes a new one
(:meth:`Engine.reconfigure <furnace_trio.engine.Engine.reconfigure>`) for the
:data:`LIVE_FIELDS` only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from furnace_trio.engine.speculation import SpeculationConfig

_NO_SPECULATION = SpeculationConfig()  # frozen, so one default is safe to share

__all__ = ["LIVE_FIELDS", "EngineConfig", "fixed_changes"]

#: The settings :meth:`Engine.reconfigure <furnace_trio.engine.Engine.reconfigure>` changes
#: while the engine serves; the others are fixed for the engine's life.
LIVE_FIELDS = frozenset(
    {
        "max_running",
        "max_waiting",
        "max_step_tokens",
        "session_ttl_s",
        "session_max_blocks",
        "max_sessions",
        "step_timeout_s",
        "max_response_bytes",
    }
)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's settings, validated once here (``ValueError`` on a bad value)."""

    max_running: int = 16  # sequences decoding at once
    max_waiting: int = 256  # queued sequences (n per request) before EngineBusy
    max_step_tokens: int = 512  # tokens per step (decode tokens + prefill chunks)
    max_context: int | None = None  # default runner.max_context
    session_ttl_s: float = 1800.0  # idle sessions expire after this
    session_max_blocks: int | None = None  # pinned KV of all sessions; None: half the pool
    max_sessions: int = 1024
    prefix_cache: bool = True  # reuse cached KV of equal prompt prefixes
    step_timeout_s: float | None = None  # watchdog: a longer step kills the engine
    # A sample's tokens after its first reach its stream in groups of this many (and at its
    # end): fewer, larger deltas, less work per token above the model (vLLM's
    # --stream-interval). 1 streams every token.
    stream_interval: int = 1
    # A request whose stream holds more than this unsent (estimated response bytes) pauses
    # until its client reads; see furnace_trio.engine.backlog.
    max_response_bytes: int = 1 << 20
    # Prefill chunks sized so that a step with running decodes takes about this long (see
    # furnace_trio.engine.pacing); None: the fixed max_step_tokens budget alone.
    target_itl_ms: float | None = None
    # Speculative decoding (furnace_trio.engine.speculation); method "off" by default.
    speculation: SpeculationConfig = _NO_SPECULATION

    def __post_init__(self) -> None:
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError("step_timeout_s must be > 0")
        if self.session_ttl_s <= 0:
            raise ValueError("session_ttl_s must be > 0")
        if self.session_max_blocks is not None and self.session_max_blocks < 0:
            raise ValueError("session_max_blocks must be >= 0")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if self.max_running < 1:
            raise ValueError("max_running must be at least 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.max_step_tokens < self.max_running:
            raise ValueError("max_step_tokens must be at least max_running")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError("max_context must be at least 2")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")
        if self.max_response_bytes < 1:
            raise ValueError("max_response_bytes must be at least 1")
        if self.target_itl_ms is not None and not 0 < self.target_itl_ms < float("inf"):
            raise ValueError("target_itl_ms must be a finite number > 0")


def fixed_changes(old: EngineConfig, new: EngineConfig) -> list[str]:
    """The settings outside :data:`LIVE_FIELDS` that differ between ``old`` and ``new``."""
    return [
        f.name
        for f in dataclasses.fields(new)
        if f.name not in LIVE_FIELDS and getattr(new, f.name) != getattr(old, f.name)
    ]
