"""The body of ``GET /status`` from the engine's :class:`~furnace_trio.engine.EngineStatus`,
and its JSON Schema for the OpenAPI document.

An operator's view of now (what llama.cpp's ``/slots`` and Ollama's ``/api/ps`` show, per
request): every request in flight with its phase, tokens and KV, and the engine's KV and
step rate. Request ids are the response ids the clients got (``chatcmpl-...``; a batch of
completions prompts adds ``-<index>``), the ids of the per-request log line. Counters over
time are ``/metrics``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from furnace_trio.engine import EngineStatus, RequestPhase, RequestStatus
from furnace_trio.engine.pacing import PacingStatus


def _request(request: RequestStatus, key_name: str | None) -> dict[str, Any]:
    return {
        "id": request.request_id,
        "phase": request.phase.value,
        "prompt_tokens": request.prompt_tokens,
        "prefilled_tokens": request.prefilled_tokens,
        "cached_tokens": request.cached_tokens,
        "generated_tokens": request.generated_tokens,
        "n": request.samples,
        "kv_blocks": {"used": request.kv_blocks_used, "reserved": request.kv_blocks_reserved},
        "age_s": round(request.age_s, 3),
        "session_id": request.session_id,
        "api_key_name": key_name,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 4)


def _pacing(pacing: PacingStatus | None) -> dict[str, Any] | None:
    if pacing is None:
        return None
    return {
        "target_itl_ms": _ms(pacing.target_s),
        "prefill_ms_per_token": _ms(pacing.prefill_token_s),
        "decode_step_base_ms": _ms(pacing.decode_base_s),
        "decode_ms_per_row": _ms(pacing.decode_row_s),
        "chunk_tokens": pacing.chunk_tokens,
        "steps_measured": pacing.steps_measured,
        "measurements_ignored": pacing.measurements_ignored,
    }


def status_body(
    status: EngineStatus,
    *,
    model: str,
    http_in_flight: int,
    config_generation: int = 1,
    key_names: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The JSON object of ``/status`` (see :data:`STATUS_SCHEMA`). ``key_names`` maps request
    ids to the names of the API keys they are served under."""
    names = key_names or {}
    return {
        "object": "status",
        "model": model,
        "http_requests_in_flight": http_in_flight,
        "config_generation": config_generation,
        "engine": {
            "state": status.state,
            "alive": status.alive,
            "running": status.running,
            "waiting": status.waiting,
            "sessions": status.sessions,
            "steps_total": status.steps_total,
            "step_rate": round(status.step_rate, 2),
            "kv_blocks": {
                "total": status.kv_blocks_total,
                "used": status.kv_blocks_used,
                "free": status.kv_blocks_free,
                "reserved": status.kv_blocks_reserved,
                "pinned": status.kv_blocks_pinned,
                "cached": status.kv_blocks_cached,
            },
            "pacing": _pacing(status.pacing),
        },
        "requests": [
            _request(request, names.get(request.request_id)) for request in status.requests
        ],
    }


def _counts(*names: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": list(names),
        "properties": {name: {"type": "integer", "minimum": 0} for name in names},
        "additionalProperties": False,
    }


_COUNT = {"type": "integer", "minimum": 0}
_REQUEST_FIELDS: dict[str, Any] = {
    "id": {"type": "string"},
    "phase": {
        "enum": [phase.value for phase in RequestPhase],
        "description": "queued: waiting for admission; prefill: computing its prompt "
        "(prefilled_tokens of prompt_tokens done); decoding: generating.",
    },
    "prompt_tokens": _COUNT,
    "prefilled_tokens": _COUNT,
    "cached_tokens": _COUNT,
    "generated_tokens": {**_COUNT, "description": "Over every sample."},
    "n": {"type": "integer", "minimum": 1},
    "kv_blocks": {
        **_counts("used", "reserved"),
        "description": "Blocks its KV is in, and those plus what admission set aside "
        "for it to grow into.",
    },
    "age_s": {"type": "number", "minimum": 0, "description": "Seconds since it was accepted."},
    "session_id": {"type": ["string", "null"]},
    "api_key_name": {
        "type": ["string", "null"],
        "description": "The name of the API key it is served under (null: no keys).",
    },
}
_MS = {"type": ["number", "null"], "minimum": 0}
_PACING_FIELDS: dict[str, Any] = {
    "target_itl_ms": {"type": "number", "exclusiveMinimum": 0},
    "prefill_ms_per_token": _MS,
    "decode_step_base_ms": _MS,
    "decode_ms_per_row": _MS,
    "chunk_tokens": {"type": ["integer", "null"], "minimum": 0},
    "steps_measured": _COUNT,
    "measurements_ignored": _COUNT,
}
_ENGINE_FIELDS: dict[str, Any] = {
    "state": {"enum": ["new", "running", "shutting down", "draining", "stopped", "dead"]},
    "alive": {"type": "boolean"},
    "running": {**_COUNT, "description": "Running sequences (n per request)."},
    "waiting": {**_COUNT, "description": "Queued requests."},
    "sessions": _COUNT,
    "steps_total": _COUNT,
    "step_rate": {"type": "number", "minimum": 0, "description": "Steps per second, lately."},
    "kv_blocks": _counts("total", "used", "free", "reserved", "pinned", "cached"),
    "pacing": {
        "description": "Prefill paced by measured step time (FURNACE_TARGET_ITL_MS; null "
        "when unset): the learned costs (null until measured) and the prefill budget of the "
        "last step (chunk_tokens; the whole step budget for a lone prompt).",
        "oneOf": [
            {"type": "null"},
            {
                "type": "object",
                "required": list(_PACING_FIELDS),
                "properties": _PACING_FIELDS,
                "additionalProperties": False,
            },
        ],
    },
}

#: The JSON Schema of the ``/status`` body.
STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "object",
        "model",
        "http_requests_in_flight",
        "config_generation",
        "engine",
        "requests",
    ],
    "additionalProperties": False,
    "properties": {
        "object": {"const": "status"},
        "model": {"type": "string"},
        "http_requests_in_flight": _COUNT,
        "config_generation": {
            "type": "integer",
            "minimum": 1,
            "description": "1 at startup, one more at each reload (POST /admin/reload, SIGHUP).",
        },
        "engine": {
            "type": "object",
            "required": list(_ENGINE_FIELDS),
            "properties": _ENGINE_FIELDS,
            "additionalProperties": False,
        },
        "requests": {
            "type": "array",
            "items": {
                "type": "object",
                "required": list(_REQUEST_FIELDS),
                "properties": _REQUEST_FIELDS,
                "additionalProperties": False,
            },
        },
    },
}
