"""Prefix caching and sessions over HTTP: the official SDK on a real socket, scripted engine."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest
import trio

from .. import scripted
from ..http_server import ANSWERS, MODEL_NAME, Served, serve_scripted
from .waiting import engine_reaches

USER = {"role": "user", "content": "Say hello, and tell me about the weather in Paris today."}


def client(served: Served, key: str = "alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0)


async def turn(c: openai.AsyncOpenAI, sid: str, content: str, **kw: Any) -> Any:
    return await c.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": content}],
        extra_body={"session_id": sid},
        **kw,
    )


async def test_repeated_prompt_reports_cached_tokens_and_metrics() -> None:
    async with serve_scripted() as served, client(served) as c:
        first = await c.chat.completions.create(model=MODEL_NAME, messages=[USER])
        second = await c.chat.completions.create(model=MODEL_NAME, messages=[USER])
        assert first.choices[0].message.content == second.choices[0].message.content
        assert first.usage is not None and second.usage is not None
        assert first.usage.prompt_tokens_details is not None
        assert second.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = second.usage.prompt_tokens_details.cached_tokens
        # every token but the last (full blocks shared, the last prompt block copied from
        # the first request's, which its answer filled)
        assert cached == second.usage.prompt_tokens - 1 and cached % 4
        async with httpx.AsyncClient() as h:
            text = (await h.get(served.url + "/metrics")).text
        assert "furnace_prefix_cache_queries_total " in text
        assert f"furnace_prefix_cache_hits_total {cached}" in text
        await served.wait_idle()


async def test_session_turns_history_get_and_delete() -> None:
    async with serve_scripted() as served, client(served) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=[USER], extra_body={"session_id": "chat-1"}
        )
        first = raw.parse()
        assert raw.headers["x-session-id"] == "chat-1"
        assert first.model_extra is not None and first.model_extra["session_id"] == "chat-1"
        assert first.choices[0].message.content == ANSWERS[0]
        second = await turn(c, "chat-1", "And tomorrow?")
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        # the first prompt (at least) came from the session's pinned KV
        assert first.usage is not None
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 4
        async with httpx.AsyncClient(headers={"Authorization": "Bearer alice"}) as h:
            got = (await h.get(served.url + "/v1/sessions/chat-1")).json()
            assert [m["role"] for m in got["messages"]] == ["user", "assistant"] * 2
            assert got["messages"][1]["content"] == ANSWERS[0] and got["turns"] == 2
            deleted = await h.delete(served.url + "/v1/sessions/chat-1")
            assert deleted.status_code == 200 and deleted.json()["deleted"] is True
            assert (await h.get(served.url + "/v1/sessions/chat-1")).status_code == 404
            assert (await h.delete(served.url + "/v1/sessions/chat-1")).status_code == 404
        await served.wait_idle()  # deleting unpinned everything


async def test_header_session_id_and_streaming_first_chunk() -> None:
    async with serve_scripted() as served, client(served) as c:
        stream = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[USER],
            stream=True,
            extra_headers={"X-Session-Id": "s-stream"},
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[0].model_extra is not None
        assert chunks[0].model_extra["session_id"] == "s-stream"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == ANSWERS[0]
        async with httpx.AsyncClient(headers={"Authorization": "Bearer alice"}) as h:
            got = (await h.get(served.url + "/v1/sessions/s-stream")).json()
        assert got["messages"][-1] == {"role": "assistant", "content": ANSWERS[0]}
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(
                model=MODEL_NAME,
                messages=[USER],
                extra_body={"session_id": "a"},
                extra_headers={"X-Session-Id": "b"},
            )


async def test_concurrent_turn_gets_409_and_cancelled_turn_changes_nothing() -> None:
    gate = threading.Event()
    runner = scripted.ScriptedRunner(lambda p, i: [*scripted.encode("x" * 40), scripted.EOS])
    async with serve_scripted(runner) as served, client(served) as c:
        gate.set()
        await turn(c, "busy", "first")
        before = served.engine.get_session("busy", _owner("alice"))
        snapshot = (list(before.messages), before.token_ids, before.blocks, before.rng_state)
        runner.gate = gate
        gate.clear()
        async with trio.open_nursery() as nursery:
            cancel = trio.CancelScope()

            async def in_flight() -> None:
                with cancel:
                    await turn(c, "busy", "second", max_tokens=30)

            nursery.start_soon(in_flight)
            await engine_reaches(served.engine, lambda s: s.running, "the turn in flight")
            with pytest.raises(openai.ConflictError):
                await turn(c, "busy", "concurrent")
            cancel.cancel()  # the client goes away mid-turn
        gate.set()
        await engine_reaches(
            served.engine,
            lambda _: not served.engine.get_session("busy", _owner("alice")).busy,
            "an idle session",
        )
        after = served.engine.get_session("busy", _owner("alice"))
        assert (list(after.messages), after.token_ids, after.blocks, after.rng_state) == snapshot
        await turn(c, "busy", "third", max_tokens=3)  # the session takes turns again


def _owner(key: str) -> str:
    from furnace_trio.engine.sessions import owner_of

    return owner_of(key)


async def test_another_api_key_cannot_see_or_use_a_session() -> None:
    async with serve_scripted() as served:
        async with client(served, "alice") as alice:
            await turn(alice, "private", "hello")
        async with client(served, "bob") as bob:
            with pytest.raises(openai.NotFoundError):
                await turn(bob, "private", "let me in")
        async with httpx.AsyncClient(headers={"Authorization": "Bearer bob"}) as h:
            assert (await h.get(served.url + "/v1/sessions/private")).status_code == 404
            assert (await h.delete(served.url + "/v1/sessions/private")).status_code == 404
            assert (await h.get(served.url + "/v1/sessions/nope")).status_code == 404
        assert len(served.engine.get_session("private", _owner("alice")).messages) == 2
