"""Client JSON schemas (tools' ``parameters``, ``response_format``) are decoded, checked and
compiled off the event loop under a size budget and a time budget: the hostile request
gets a clear 400 (or, within the budgets, its answer) while every other client is served.

Each test watches the loop (``tests/loop_watch.py``) for the whole of one request and
asserts that it never stalled for 100 ms. Run on the loop, each of these requests stalled
it for seconds: 44,000 ``anyOf`` branches for about a minute, 5,000 for several seconds.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from furnace_trio.server.config import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_SCHEMA_NODES
from furnace_trio.server.schemas import MAX_JSON_VALUES

from ..http_server import MODEL_NAME, Served, serve_scripted
from ..loop_watch import STALL_LIMIT_S, watch_loop

MESSAGES = [{"role": "user", "content": "hi"}]


def branches(count: int) -> dict[str, Any]:
    """An object schema whose one property is any of ``count`` small object schemas (six
    JSON values and about 90 bytes each): ``6 * count + 5`` values."""
    return {
        "type": "object",
        "properties": {
            "x": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {f"field_{i:06d}": {"type": "string", "maxLength": 1024}},
                    }
                    for i in range(count)
                ]
            }
        },
    }


def with_tool(schema: dict[str, Any]) -> bytes:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return json.dumps({"model": MODEL_NAME, "messages": MESSAGES, "tools": [tool]}).encode()


def with_response_format(schema: dict[str, Any]) -> bytes:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"model": MODEL_NAME, "messages": MESSAGES, "response_format": response_format}
    return json.dumps(body).encode()


async def post(served: Served, body: bytes) -> httpx.Response:
    async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:
        return await http.post(
            "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
        )


async def test_a_schema_of_44000_branches_is_a_400_and_the_loop_runs_on() -> None:
    body = with_tool(branches(44_000))
    assert 3.5 * 2**20 < len(body) < DEFAULT_MAX_BODY_BYTES  # the 3.9 MiB of the report
    async with serve_scripted() as served:
        async with watch_loop(served.url) as watch:
            response = await post(served, body)
        assert response.status_code == 400, response.text[:300]
        message = response.json()["error"]["message"]
        assert "JSON values" in message and str(MAX_JSON_VALUES) in message
        assert watch.samples >= 1 and watch.longest_stall_s < STALL_LIMIT_S, str(watch)
        assert (await post(served, with_tool(branches(3)))).status_code == 200
    await served.wait_idle()


async def test_a_schema_past_the_budget_is_a_400_naming_it() -> None:
    schema = branches(5_000)  # 30,005 values, within the body's budget
    async with serve_scripted() as served:
        async with watch_loop(served.url) as watch:
            response = await post(served, with_response_format(schema))
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert error["param"] == "response_format.json_schema.schema"
        assert "FURNACE_MAX_SCHEMA_NODES" in error["message"]
        assert str(DEFAULT_MAX_SCHEMA_NODES) in error["message"]
        assert watch.longest_stall_s < STALL_LIMIT_S, str(watch)
    await served.wait_idle()


async def test_the_budget_is_shared_by_every_schema_and_is_a_setting() -> None:
    async with serve_scripted(max_schema_nodes=50) as served:
        one = branches(6)  # 41 values: fits alone, not twice
        assert (await post(served, with_tool(one))).status_code == 200
        body = json.loads(with_tool(one))
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": one}}
        response = await post(served, json.dumps(body).encode())
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "response_format.json_schema.schema"
    await served.wait_idle()


async def test_a_large_schema_within_the_budgets_compiles_off_the_loop() -> None:
    schema = branches(2_000)  # 12,005 values: checked and compiled, a second or so of work
    async with serve_scripted() as served:
        # The scripted backend builds its llguidance tokenizer on first use (a real one is
        # built with the model, before serving): a small grammar request builds it first.
        assert (await post(served, with_response_format(branches(2)))).status_code == 200
        async with watch_loop(served.url) as watch:
            response = await post(served, with_response_format(schema))
        assert response.status_code == 200, response.text[:300]
        assert watch.samples >= 5 and watch.longest_stall_s < STALL_LIMIT_S, str(watch)
    await served.wait_idle()


async def test_a_grammar_past_the_time_budget_is_a_400() -> None:
    async with serve_scripted() as served:
        served.state.off_loop.compile_budget_s = 0.0
        response = await post(served, with_response_format(branches(3)))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "response_format"
        assert "did not compile within 0 s" in error["message"]
        served.state.off_loop.compile_budget_s = 10.0
        assert (await post(served, with_response_format(branches(3)))).status_code == 200
    await served.wait_idle()


async def test_an_unknown_meta_schema_is_a_400_without_fetching_it() -> None:
    schema = {"$schema": "http://127.0.0.1:9/evil", "type": "object"}
    async with serve_scripted() as served:
        response = await post(served, with_tool(schema))
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "tools[0].function.parameters.$schema"
        assert "draft" in error["message"]
    await served.wait_idle()
