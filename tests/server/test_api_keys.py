"""Named API keys over a real socket, with the official client: each request is served
under its key's name (log line, ``/status``, ``/metrics``), a key's ``max_concurrent``
is a 429 with OpenAI's error object, sessions stay with the key that opened them, and the
keys themselves never show."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import openai
import pytest
import trio

from furnace_trio.server.api_keys import APIKey

from .. import scripted
from ..http_server import MODEL_NAME, default_script, serve_scripted
from .waiting import engine_reaches

KEYS = (APIKey("alice", "sk-alice-secret", max_concurrent=1), APIKey("bob", "sk-bob-secret"))
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_requests_are_served_under_their_keys_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="furnace_trio")
    gate = threading.Event()
    runner = scripted.ScriptedRunner(default_script, gate=gate)
    async with (
        serve_scripted(runner, api_key="sk-default-secret", api_keys=KEYS) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
        trio.open_nursery() as nursery,
    ):
        answers: dict[str, httpx.Response] = {}

        async def chat(who: str, key: str) -> None:
            answers[who] = await http.post("/v1/chat/completions", json=CHAT, headers=_auth(key))

        try:
            nursery.start_soon(chat, "alice", "sk-alice-secret")
            await engine_reaches(served.engine, lambda s: s.running == 1)
            # alice's one request is in flight: her next one is refused, bob is served
            refused = await http.post(
                "/v1/chat/completions", json=CHAT, headers=_auth("sk-alice-secret")
            )
            assert refused.status_code == 429
            assert refused.headers["Retry-After"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
            assert "'alice'" in error["message"] and "secret" not in error["message"]
            nursery.start_soon(chat, "bob", "sk-bob-secret")
            await engine_reaches(served.engine, lambda s: s.running + s.waiting == 2)
            status = await http.get("/status", headers=_auth("sk-default-secret"))
            names = sorted(r["api_key_name"] for r in status.json()["requests"])
            assert names == ["alice", "bob"]
            assert "secret" not in status.text
        finally:
            gate.set()
        nursery.start_soon(chat, "default", "sk-default-secret")  # FURNACE_API_KEY's key
    assert {who: r.status_code for who, r in answers.items()} == dict.fromkeys(
        ("alice", "bob", "default"), 200
    )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    keys = sorted(word for line in lines for word in line.split() if word.startswith("key="))
    assert keys == ["key=alice", "key=bob", "key=default"]
    fields = [r.fields for r in caplog.records if hasattr(r, "fields")]  # the JSON format's
    assert sorted(f["api_key_name"] for f in fields) == ["alice", "bob", "default"]
    assert all("secret" not in r.getMessage() for r in caplog.records)
    assert all("secret" not in json.dumps(f, default=str) for f in fields)

    async with (
        serve_scripted(api_keys=KEYS) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
    ):
        for key in ("sk-alice-secret", "sk-alice-secret", "sk-bob-secret", "sk-nobody"):
            await http.get("/v1/models", headers=_auth(key))
        metrics = (await http.get("/metrics")).text.splitlines()
    assert 'furnace_api_key_responses_total{key="alice",status="200"} 2' in metrics
    assert 'furnace_api_key_responses_total{key="bob",status="200"} 1' in metrics
    assert 'furnace_api_key_requests_in_flight{key="alice"} 0' in metrics
    assert "furnace_config_generation 1" in metrics
    assert not any("secret" in line or "nobody" in line for line in metrics)


async def test_a_429_is_counted_under_the_key() -> None:
    gate = threading.Event()
    runner = scripted.ScriptedRunner(default_script, gate=gate)
    async with (
        serve_scripted(runner, api_keys=KEYS) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
        trio.open_nursery() as nursery,
    ):
        try:
            nursery.start_soon(
                lambda: http.post("/v1/chat/completions", json=CHAT, headers=_auth(KEYS[0].key))
            )
            await engine_reaches(served.engine, lambda s: s.running == 1)
            refused = await http.get("/v1/models", headers=_auth(KEYS[0].key))
            assert refused.status_code == 429
            metrics = (await http.get("/metrics")).text.splitlines()
            assert 'furnace_api_key_responses_total{key="alice",status="429"} 1' in metrics
            assert 'furnace_api_key_requests_in_flight{key="alice"} 1' in metrics
        finally:
            gate.set()


async def test_the_official_client_and_sessions_per_key() -> None:
    async with serve_scripted(api_keys=KEYS) as served:
        alice = openai.AsyncOpenAI(
            base_url=served.url + "/v1", api_key="sk-alice-secret", max_retries=0
        )
        bob = openai.AsyncOpenAI(
            base_url=served.url + "/v1", api_key="sk-bob-secret", max_retries=0
        )
        async with alice, bob:
            reply = await alice.chat.completions.create(
                model=MODEL_NAME,
                extra_body={"session_id": "s1"},
                **CHAT,  # type: ignore[call-overload]
            )
            assert reply.choices[0].message.content
            mine = await alice.get("/sessions/s1", cast_to=httpx.Response)
            assert mine.status_code == 200
            with pytest.raises(openai.NotFoundError):
                await bob.get("/sessions/s1", cast_to=httpx.Response)
            with pytest.raises(openai.AuthenticationError):
                await openai.AsyncOpenAI(
                    base_url=served.url + "/v1", api_key="sk-nobody", max_retries=0
                ).models.list()
