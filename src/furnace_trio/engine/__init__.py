"""The engine layer: continuous batching over a model runner, in plain Python on Trio.

:class:`Engine` takes :class:`GenerationRequest`\\ s and hands back a
:class:`RequestStream` of events per request. Inside: the scheduler decides what runs in
each model step, the KV cache manager keeps the blocks, the block pool allocates them,
and the session store keeps multi-turn KV. Nothing here imports torch or HTTP code.
"""

from __future__ import annotations

from furnace_trio.engine.config import EngineConfig
from furnace_trio.engine.engine import Engine
from furnace_trio.engine.errors import (
    EngineBusy,
    EngineError,
    EngineUnavailable,
    RequestRejected,
    RequestTooLarge,
)
from furnace_trio.engine.events import (
    Admitted,
    Delta,
    Event,
    Failed,
    FailureCause,
    Finished,
    GenerationRequest,
    LogprobEntry,
    TopLogprob,
)
from furnace_trio.engine.speculation import SpeculationConfig
from furnace_trio.engine.stats import EngineStatistics
from furnace_trio.engine.status import EngineStatus, RequestPhase, RequestStatus
from furnace_trio.engine.stream import RequestStream

__all__ = [
    "Admitted",
    "Delta",
    "Engine",
    "EngineBusy",
    "EngineConfig",
    "EngineError",
    "EngineStatistics",
    "EngineStatus",
    "EngineUnavailable",
    "Event",
    "Failed",
    "FailureCause",
    "Finished",
    "GenerationRequest",
    "LogprobEntry",
    "RequestPhase",
    "RequestRejected",
    "RequestStatus",
    "RequestStream",
    "RequestTooLarge",
    "SpeculationConfig",
    "TopLogprob",
]
