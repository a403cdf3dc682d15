"""Prometheus text exposition (format 0.0.4) of engine statistics and HTTP response counts.

Pure function of a snapshot: no registry, no global state. Every name starts with
``furnace_``; histograms follow Prometheus conventions (cumulative ``le`` buckets ending at
``+Inf``, ``_sum``, ``_count``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from furnace_trio.engine.pacing import PacingStatus
from furnace_trio.engine.stats import EngineStatistics, HistogramSnapshot

_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("time_to_first_token", "furnace_time_to_first_token_seconds", "Time to first token."),
    ("inter_token_latency", "furnace_inter_token_latency_seconds", "Time between tokens."),
    ("e2e_latency", "furnace_e2e_request_latency_seconds", "End-to-end request latency."),
    ("queue_time", "furnace_request_queue_time_seconds", "Time requests waited to be admitted."),
    ("prefill_step_time", "furnace_prefill_step_seconds", "Duration of steps with prefill."),
    ("decode_step_time", "furnace_decode_step_seconds", "Duration of decode-only steps."),
    (
        "spec_acceptance",
        "furnace_spec_acceptance_ratio",
        "Speculative decoding: per request that drafted, the share of its drafts accepted.",
    ),
    (
        "spec_tokens_per_step",
        "furnace_spec_tokens_per_step",
        "Speculative decoding: tokens a drafting sequence got from one step.",
    ),
)


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _histogram(lines: list[str], name: str, help_text: str, snap: HistogramSnapshot) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} histogram")
    bounds = [*snap.bounds, math.inf]
    for bound, count in zip(bounds, snap.counts, strict=False):
        lines.append(f'{name}_bucket{{le="{_number(bound)}"}} {count}')
    lines.append(f"{name}_sum {_number(snap.sum)}")
    lines.append(f"{name}_count {snap.count}")


def _metric(lines: list[str], name: str, kind: str, help_text: str, value: float) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    lines.append(f"{name} {_number(value)}")


def _pacing(lines: list[str], pacing: PacingStatus) -> None:
    """Gauges of the prefill pacer (``FURNACE_TARGET_ITL_MS``); unmeasured ones are left out."""
    _metric(
        lines,
        "furnace_pacing_target_seconds",
        "gauge",
        "Step time that prefill chunks are sized for while streams decode.",
        pacing.target_s,
    )
    for name, help_text, value in (
        (
            "furnace_pacing_prefill_token_seconds",
            "Learned step time per prefill token.",
            pacing.prefill_token_s,
        ),
        (
            "furnace_pacing_decode_step_base_seconds",
            "Learned step time of decodes, fixed part.",
            pacing.decode_base_s,
        ),
        (
            "furnace_pacing_decode_row_seconds",
            "Learned step time per decode row.",
            pacing.decode_row_s,
        ),
        (
            "furnace_pacing_chunk_tokens",
            "Prefill token budget of the last step.",
            pacing.chunk_tokens,
        ),
    ):
        if value is not None:
            _metric(lines, name, "gauge", help_text, value)


def _expert_tokens(lines: list[str], counts: tuple[tuple[int, ...], ...]) -> None:
    name = "furnace_expert_tokens_total"
    lines.append(f"# HELP {name} Tokens routed to each expert of a mixture-of-experts layer.")
    lines.append(f"# TYPE {name} counter")
    for layer, row in enumerate(counts):
        for expert, count in enumerate(row):
            lines.append(f'{name}{{layer="{layer}",expert="{expert}"}} {count}')


def render_metrics(
    stats: EngineStatistics | None, http_responses: Mapping[int, int], *, engine_up: bool
) -> str:
    """The ``/metrics`` body. ``stats is None`` (no backend yet) renders only what is known."""
    lines: list[str] = []
    _metric(lines, "furnace_engine_up", "gauge", "1 while the engine task runs.", int(engine_up))
    if stats is not None:
        _metric(lines, "furnace_requests_running", "gauge", "Running sequences.", stats.running)
        _metric(lines, "furnace_requests_waiting", "gauge", "Queued requests.", stats.waiting)
        _metric(
            lines,
            "furnace_requests_paused",
            "gauge",
            "Running requests paused until their client reads (FURNACE_MAX_RESPONSE_BYTES).",
            stats.requests_paused,
        )
        _metric(
            lines,
            "furnace_request_pauses_total",
            "counter",
            "Times a request paused because its client did not read.",
            stats.pauses_total,
        )
        _metric(lines, "furnace_kv_blocks_used", "gauge", "KV blocks in use.", stats.kv_blocks_used)
        _metric(
            lines,
            "furnace_kv_blocks_total",
            "gauge",
            "KV blocks in the pool.",
            stats.kv_blocks_total,
        )
        _metric(
            lines,
            "furnace_kv_blocks_reserved",
            "gauge",
            "KV blocks set aside for admitted requests to grow into, not yet in use.",
            stats.kv_blocks_reserved,
        )
        usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        _metric(
            lines, "furnace_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks used.", usage
        )
        lines.append("# HELP furnace_requests_total Finished requests by outcome.")
        lines.append("# TYPE furnace_requests_total counter")
        for outcome, count in sorted(stats.requests.items()):
            lines.append(f'furnace_requests_total{{outcome="{_label(outcome)}"}} {count}')
        _metric(
            lines,
            "furnace_requests_cancelled_before_admission_total",
            "counter",
            "Requests whose client went away while they were queued (status 499 in the log).",
            stats.requests_cancelled_before_admission_total,
        )
        _metric(
            lines,
            "furnace_prompt_tokens_total",
            "counter",
            "Prompt tokens processed.",
            stats.prompt_tokens_total,
        )
        _metric(
            lines,
            "furnace_generation_tokens_total",
            "counter",
            "Tokens generated.",
            stats.generation_tokens_total,
        )
        _metric(
            lines,
            "furnace_prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries_total,
        )
        _metric(
            lines,
            "furnace_prefix_cache_hits_total",
            "counter",
            "Prompt tokens found in the prefix cache (not computed).",
            stats.prefix_cache_hits_total,
        )
        _metric(lines, "furnace_sessions", "gauge", "Sessions kept.", stats.sessions)
        _metric(
            lines,
            "furnace_session_pinned_blocks",
            "gauge",
            "KV blocks pinned by sessions.",
            stats.session_pinned_blocks,
        )
        _metric(
            lines,
            "furnace_spec_drafted_tokens_total",
            "counter",
            "Speculative decoding: draft tokens verified.",
            stats.spec_drafted_tokens_total,
        )
        _metric(
            lines,
            "furnace_spec_accepted_tokens_total",
            "counter",
            "Speculative decoding: draft tokens accepted (the rest were wasted).",
            stats.spec_accepted_tokens_total,
        )
        if stats.pacing is not None:
            _pacing(lines, stats.pacing)
        if any(stats.expert_tokens):
            _expert_tokens(lines, stats.expert_tokens)
        for attribute, name, help_text in _HISTOGRAMS:
            _histogram(lines, name, help_text, getattr(stats, attribute))
    lines.append("# HELP furnace_http_responses_total HTTP responses by status code.")
    lines.append("# TYPE furnace_http_responses_total counter")
    for status, count in sorted(http_responses.items()):
        lines.append(f'furnace_http_responses_total{{status="{status}"}} {count}')
    return "\n".join(lines) + "\n"


def render_config_generation(generation: int) -> str:
    """The configuration's generation (1 at startup, one more at each reload) as a gauge."""
    return (
        "# HELP furnace_config_generation The configuration's generation: 1 at startup, "
        "one more at each reload.\n# TYPE furnace_config_generation gauge\n"
        f"furnace_config_generation {generation}\n"
    )
