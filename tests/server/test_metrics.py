"""Prometheus text rendering of engine statistics."""

from __future__ import annotations

from furnace_trio.engine.pacing import StepPacer
from furnace_trio.engine.stats import EngineMetrics, EngineStatistics
from furnace_trio.server.metrics import render_metrics


def test_render_metrics_has_every_family() -> None:
    metrics = EngineMetrics()
    metrics.time_to_first_token.observe(0.02)
    metrics.time_to_first_token.observe(100.0)
    metrics.count("finished_stop")
    metrics.prompt_tokens_total = 12
    metrics.cancelled_before_admission = 4
    stats = metrics.snapshot(
        running=2, waiting=1, kv_used=3, kv_total=12, alive=True, kv_blocks_reserved=5
    )
    text = render_metrics(stats, {200: 5, 400: 1}, engine_up=True)
    lines = set(text.splitlines())
    assert "furnace_engine_up 1" in lines
    assert "furnace_requests_running 2" in lines
    assert "furnace_requests_waiting 1" in lines
    assert "furnace_kv_blocks_used 3" in lines
    assert "furnace_kv_cache_usage_ratio 0.25" in lines
    assert "furnace_kv_blocks_reserved 5" in lines
    assert "furnace_requests_cancelled_before_admission_total 4" in lines
    assert 'furnace_requests_total{outcome="finished_stop"} 1' in lines
    assert 'furnace_requests_total{outcome="aborted"} 0' in lines
    assert "furnace_prompt_tokens_total 12" in lines
    assert "furnace_generation_tokens_total 0" in lines
    assert 'furnace_time_to_first_token_seconds_bucket{le="0.025"} 1' in lines
    assert 'furnace_time_to_first_token_seconds_bucket{le="+Inf"} 2' in lines
    assert "furnace_time_to_first_token_seconds_count 2" in lines
    assert "furnace_time_to_first_token_seconds_sum 100.02" in lines
    for family in ("inter_token_latency", "e2e_request_latency", "request_queue_time"):
        assert f"# TYPE furnace_{family}_seconds histogram" in lines
    assert 'furnace_http_responses_total{status="400"} 1' in lines
    assert text.endswith("\n")


def test_render_metrics_without_backend() -> None:
    text = render_metrics(None, {}, engine_up=False)
    assert "furnace_engine_up 0" in text
    assert "furnace_requests_running" not in text
    text = render_metrics(EngineStatistics(), {}, engine_up=True)
    # six latency histograms, and speculative decoding's acceptance and tokens per step
    assert text.count("_bucket{") == 6 * 19 + 2 * 11
    assert "furnace_spec_drafted_tokens_total 0" in text
    assert 'furnace_spec_acceptance_ratio_bucket{le="1"} 0' in text


def test_render_metrics_has_the_pacers_gauges() -> None:
    pacer = StepPacer(1.0)
    pacer.observe(0, 8, 0.25)
    pacer.observe(100, 8, 0.5)
    pacer.prefill_budget(8, 504)
    stats = EngineMetrics().snapshot(
        running=8, waiting=0, kv_used=3, kv_total=12, alive=True, pacing=pacer.status()
    )
    lines = set(render_metrics(stats, {}, engine_up=True).splitlines())
    assert "furnace_pacing_target_seconds 1" in lines
    assert "furnace_pacing_prefill_token_seconds 0.0025" in lines
    assert "furnace_pacing_chunk_tokens 300" in lines
    assert "# TYPE furnace_pacing_decode_row_seconds gauge" in lines
    assert "furnace_pacing" not in render_metrics(EngineStatistics(), {}, engine_up=True)
    # before anything was measured, only the target
    fresh = EngineStatistics(pacing=StepPacer(0.05).status())
    text = render_metrics(fresh, {}, engine_up=True)
    assert "furnace_pacing_target_seconds 0.05" in text
    assert "furnace_pacing_prefill_token_seconds" not in text
