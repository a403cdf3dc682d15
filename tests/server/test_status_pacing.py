"""The prefill pacer's part of ``GET /status`` and ``/metrics`` over a real socket."""

from __future__ import annotations

import httpx

from furnace_trio.engine import EngineConfig

from ..http_server import serve_scripted
from .test_status import _check_schema


async def test_status_and_metrics_show_what_the_pacer_learned() -> None:
    config = EngineConfig(max_step_tokens=64, target_itl_ms=25.0)
    async with (
        serve_scripted(engine_config=config) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
    ):
        body = {"model": "furnace-test", "prompt": "x" * 150, "max_tokens": 5}
        reply = await http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        await served.wait_idle()
        status = (await http.get("/status")).json()
        _check_schema(status)
        pacing = status["engine"]["pacing"]
        assert pacing["target_itl_ms"] == 25.0
        assert pacing["steps_measured"] >= 3  # three prefill chunks, then decodes
        assert pacing["prefill_ms_per_token"] > 0
        assert pacing["decode_step_base_ms"] is not None
        assert pacing["chunk_tokens"] == 64  # a lone prompt: the whole step budget
        metrics = (await http.get("/metrics")).text.splitlines()
        assert "furnace_pacing_target_seconds 0.025" in metrics
        assert "furnace_pacing_chunk_tokens 64" in metrics
        assert any(line.startswith("furnace_pacing_prefill_token_seconds ") for line in metrics)


async def test_status_shows_no_pacing_without_a_target() -> None:
    async with (
        serve_scripted() as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
    ):
        status = (await http.get("/status")).json()
        _check_schema(status)
        assert status["engine"]["pacing"] is None
        assert "furnace_pacing" not in (await http.get("/metrics")).text
