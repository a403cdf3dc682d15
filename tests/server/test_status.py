"""``GET /status`` over a real socket, the counters of ``/metrics`` it goes with, and the
per-request log line.

The main test runs the real default model: a long streamed request decodes while a
second one waits (``max_running = 1``), and ``/status`` shows both.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import httpx
import jsonschema
import openai
import trio

from furnace_trio.engine import EngineConfig
from furnace_trio.server.openapi import openapi_document

from .. import scripted
from ..http_server import default_script, serve_scripted
from ..real_model import NAME, serve_real
from .waiting import engine_reaches

KEY = "sk-status"


def _check_schema(body: dict[str, Any]) -> None:
    document = openapi_document()
    schema = {**document["components"]["schemas"]["Status"], "components": document["components"]}
    jsonschema.Draft202012Validator(schema).validate(body)


async def test_status_shows_a_decoding_request_and_a_queued_one() -> None:
    config = EngineConfig(max_running=1, max_step_tokens=256)
    async with (
        serve_real(engine_config=config, api_key=KEY) as (url, engine),
        httpx.AsyncClient(base_url=url, timeout=60) as http,
        trio.open_nursery() as nursery,
    ):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        stream = await client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "Count from one to a thousand."}],
            max_tokens=1000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                long_id = chunk.id
                break
        queued_reply: list[Any] = []

        async def queued() -> None:
            queued_reply.append(
                await client.completions.create(model=NAME, prompt="Hello", max_tokens=3)
            )

        nursery.start_soon(queued)
        await engine_reaches(engine, lambda s: s.waiting == 1 and s.generation_tokens_total >= 3)
        response = await http.get("/status", headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 200, response.text
        body = response.json()
        _check_schema(body)
        decoding, waiting = body["requests"]
        assert decoding["id"] == long_id
        assert decoding["phase"] == "decoding"
        assert decoding["prompt_tokens"] > 10
        assert decoding["prefilled_tokens"] == decoding["prompt_tokens"]
        assert decoding["generated_tokens"] >= 3
        assert 0 < decoding["kv_blocks"]["used"] <= decoding["kv_blocks"]["reserved"]
        assert decoding["age_s"] > 0 and decoding["n"] == 1 and decoding["session_id"] is None
        assert waiting["id"].startswith("cmpl-") and waiting["phase"] == "queued"
        assert waiting["prompt_tokens"] == 1 and waiting["generated_tokens"] == 0
        assert waiting["prefilled_tokens"] == 0 and waiting["kv_blocks"] == {
            "used": 0,
            "reserved": 0,
        }
        state = body["engine"]
        assert (state["state"], state["running"], state["waiting"]) == ("running", 1, 1)
        kv = state["kv_blocks"]
        assert kv["used"] >= decoding["kv_blocks"]["used"]
        assert kv["used"] + kv["free"] == kv["total"]
        assert kv["reserved"] == decoding["kv_blocks"]["reserved"] - decoding["kv_blocks"]["used"]
        assert state["steps_total"] >= 3 and state["step_rate"] > 0
        assert body["http_requests_in_flight"] == 3  # the two generations and this one

        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = await http.get("/status", headers=headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"

        metrics = (await http.get("/metrics")).text
        assert f"furnace_kv_blocks_reserved {kv['reserved']}" in metrics.splitlines()
        await stream.close()  # the long request ends; the queued one runs
        await engine_reaches(engine, lambda s: s.waiting == 0 and s.running == 0)
    assert queued_reply[0].choices[0].text


async def test_the_admin_key_guards_status_and_only_status() -> None:
    async with (
        serve_scripted(api_key="user-key", admin_key="admin-key") as served,
        httpx.AsyncClient(base_url=served.url) as http,
    ):

        async def get(path: str, key: str) -> int:
            response = await http.get(path, headers={"Authorization": f"Bearer {key}"})
            return response.status_code

        assert await get("/status", "admin-key") == 200
        assert await get("/status", "user-key") == 401
        assert await get("/v1/models", "admin-key") == 401
        assert await get("/v1/models", "user-key") == 200


async def test_a_client_gone_before_admission_is_counted_in_metrics(caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="furnace_trio.server.request_log")
    gate = threading.Event()
    runner = scripted.ScriptedRunner(default_script, gate=gate)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    async with (
        serve_scripted(runner, engine_config=EngineConfig(max_running=1)) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(functools.partial(http.post, "/v1/chat/completions", json=chat))
        await engine_reaches(served.engine, lambda s: s.running == 1)
        queued = trio.CancelScope()

        async def post_queued() -> None:
            with queued:
                await http.post("/v1/chat/completions", json=chat)

        nursery.start_soon(post_queued)
        await engine_reaches(served.engine, lambda s: s.waiting == 1)
        queued.cancel()
        await engine_reaches(served.engine, lambda s: s.waiting == 0)
        metrics = (await http.get("/metrics")).text.splitlines()
        assert "furnace_requests_cancelled_before_admission_total 1" in metrics
        gate.set()
        await served.wait_idle()
        metrics = (await http.get("/metrics")).text.splitlines()
    # the request that ran to the end is not counted
    assert "furnace_requests_cancelled_before_admission_total 1" in metrics
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("request_log")]
    gone = [line for line in lines if "status=499" in line]
    done = [line for line in lines if "status=200" in line]
    assert len(gone) == 1 and len(done) == 1
    # the finished one: its prompt plus its answer of the model's context, and the KV
    prompt_tokens = int(done[0].split("prompt_tokens=")[1].split()[0])
    generated = int(done[0].split("generated_tokens=")[1].split()[0])
    assert f"context={prompt_tokens + generated}/{served.runner.max_context} " in done[0]
    total = served.engine.statistics().kv_blocks_total
    assert f"kv=0/{total} blocks (0%)" in done[0]  # logged after its blocks were freed


async def test_status_names_the_session_of_a_turn() -> None:
    gate = threading.Event()
    runner = scripted.ScriptedRunner(default_script, gate=gate)
    chat = {"messages": [{"role": "user", "content": "hi"}], "session_id": "status-s1"}
    async with (
        serve_scripted(runner) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(functools.partial(http.post, "/v1/chat/completions", json=chat))
        await engine_reaches(served.engine, lambda s: s.running == 1)
        body = (await http.get("/status")).json()
        _check_schema(body)
        (turn,) = body["requests"]
        assert turn["session_id"] == "status-s1" and turn["phase"] == "prefill"
        gate.set()
        await served.wait_idle(sessions_may_hold=True)
