"""The Responses API's refusals and its conversations on the session machinery: the SDK
over a real socket, a scripted engine (so a turn can be held in flight).
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest
import trio

from furnace_trio.engine import EngineConfig
from furnace_trio.engine.sessions import SessionNotFound, owner_of

from .. import scripted
from ..http_server import ANSWERS, MODEL_NAME, Served, serve_scripted
from .waiting import wait_until


def client(served: Served, key: str = "alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0)


async def _refused(call: Any, status: int = 400) -> dict[str, Any]:
    with pytest.raises(openai.APIStatusError) as caught:
        await call
    assert caught.value.status_code == status, caught.value
    body = caught.value.body
    assert isinstance(body, dict)
    return body


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["x"]}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
async def test_unsupported_or_bad_fields_are_400s_naming_them(
    extra: dict[str, Any], param: str
) -> None:
    async with serve_scripted() as served, client(served) as c:
        body = await _refused(
            c.responses.create(model=MODEL_NAME, input="hi", extra_body=extra)  # type: ignore[call-overload]
        )
        assert body["param"] == param, body
        assert body["type"] == "invalid_request_error"
        # and the server goes on serving
        answer = await c.responses.create(model=MODEL_NAME, input="hi")
        assert answer.output_text == ANSWERS[0]
        await served.wait_idle(sessions_may_hold=True)


async def test_unknown_ids_and_another_keys_responses_are_404s() -> None:
    async with serve_scripted() as served:
        async with client(served, "alice") as alice:
            mine = await alice.responses.create(model=MODEL_NAME, input="hi")
            body = await _refused(
                alice.responses.create(
                    model=MODEL_NAME, input="again", previous_response_id="resp_nope"
                ),
                404,
            )
            assert body["param"] == "previous_response_id"
            await _refused(alice.responses.retrieve("resp_nope"), 404)
        async with client(served, "bob") as bob:
            await _refused(bob.responses.retrieve(mine.id), 404)
            await _refused(bob.responses.input_items.list(mine.id), 404)
            await _refused(bob.responses.delete(mine.id), 404)
            await _refused(
                bob.responses.create(model=MODEL_NAME, input="x", previous_response_id=mine.id),
                404,
            )
        async with client(served, "alice") as alice:
            assert (await alice.responses.retrieve(mine.id)).id == mine.id


async def test_a_continuation_is_the_next_session_turn_and_a_second_one_waits() -> None:
    gate = threading.Event()
    runner = scripted.ScriptedRunner(lambda p, i: [*scripted.encode("x" * 40), scripted.EOS])
    async with serve_scripted(runner) as served, client(served) as c:
        gate.set()
        first = await c.responses.create(model=MODEL_NAME, input="first")
        stats = served.engine.statistics()
        assert stats.sessions == 1 and stats.session_pinned_blocks > 0
        runner.gate = gate
        gate.clear()
        async with trio.open_nursery() as nursery:
            done: list[Any] = []

            async def in_flight() -> None:
                done.append(
                    await c.responses.create(
                        model=MODEL_NAME, input="second", previous_response_id=first.id
                    )
                )

            nursery.start_soon(in_flight)
            await wait_until(lambda: served.engine.statistics().running, "the turn in flight")
            body = await _refused(
                c.responses.create(model=MODEL_NAME, input="third", previous_response_id=first.id),
                409,
            )
            assert body["param"] == "previous_response_id"
            gate.set()
        [second] = done
        # the continuation ran on the same session: one session, its history grown
        assert served.engine.statistics().sessions == 1
        assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
        # continuing the older response again branches into a session of its own
        branch = await c.responses.create(
            model=MODEL_NAME, input="other", previous_response_id=first.id
        )
        assert branch.status == "completed"
        assert served.engine.statistics().sessions == 2
        assert branch.usage is not None and branch.usage.input_tokens_details.cached_tokens > 0
        # store false: answered, nothing kept
        await c.responses.create(model=MODEL_NAME, input="x", store=False)
        assert served.engine.statistics().sessions == 2
        # deleting a response another one continues keeps the session; the last frees it
        for response in (first, second, branch):
            await c.responses.delete(response.id)
        assert served.engine.statistics().sessions == 0
        await served.wait_idle()


async def test_input_items_pages() -> None:
    async with serve_scripted() as served, client(served) as c:
        items: Any = [{"role": "user", "content": f"m{i}"} for i in range(5)]
        response = await c.responses.create(model=MODEL_NAME, input=items)
        page = await c.responses.input_items.list(response.id, limit=2, order="asc")
        texts = [i.content[0].text for i in page.data]  # type: ignore[union-attr]
        assert texts == ["m0", "m1"] and page.has_more
        page = await c.responses.input_items.list(response.id, after=page.last_id, order="asc")
        assert [i.content[0].text for i in page.data] == ["m2", "m3", "m4"]  # type: ignore[union-attr]
        assert not page.has_more
        newest = await c.responses.input_items.list(response.id, limit=1)
        assert [i.content[0].text for i in newest.data] == ["m4"]  # type: ignore[union-attr]
        async with httpx.AsyncClient(headers={"Authorization": "Bearer alice"}) as h:
            url = f"{served.url}/v1/responses/{response.id}/input_items"
            for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=x", "after")):
                answer = await h.get(f"{url}?{query}")
                assert answer.status_code == 400
                assert answer.json()["error"]["param"] == param


async def test_a_model_failure_fails_the_response_and_leaves_the_conversation() -> None:
    runner = scripted.ScriptedRunner(lambda p, i: [*scripted.encode("x" * 20), scripted.EOS])
    async with serve_scripted(runner) as served, client(served) as c:
        first = await c.responses.create(model=MODEL_NAME, input="first")
        turns = served.engine.statistics().sessions
        # streamed: the model fails after a few tokens; the stream ends in response.failed
        runner.fail_on = {len(runner.plans) + 3}
        stream = await c.responses.create(
            model=MODEL_NAME, input="second", previous_response_id=first.id, stream=True
        )
        events = [event async for event in stream]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        last = events[-1]
        assert last.type == "response.failed"
        assert last.response.status == "failed" and last.response.error is not None
        stored = await c.responses.retrieve(last.response.id)
        assert stored.status == "failed"
        body = await _refused(
            c.responses.create(model=MODEL_NAME, input="x", previous_response_id=stored.id)
        )
        assert body["param"] == "previous_response_id"
        # not streamed: a 500, the server goes on
        runner.fail_on = {len(runner.plans) + 1}
        await _refused(
            c.responses.create(model=MODEL_NAME, input="third", previous_response_id=first.id),
            500,
        )
        # the conversation is as it was: continuing the first response is still its
        # session's next turn (no new session), with its KV reused
        again = await c.responses.create(
            model=MODEL_NAME, input="fourth", previous_response_id=first.id
        )
        assert again.status == "completed"
        assert served.engine.statistics().sessions == turns
        assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0
        await served.wait_idle(sessions_may_hold=True)


async def test_an_idle_conversation_expires_with_its_responses() -> None:
    config = EngineConfig(session_ttl_s=0.2)
    async with serve_scripted(engine_config=config) as served, client(served) as c:
        first = await c.responses.create(model=MODEL_NAME, input="first")
        assert served.engine.statistics().sessions == 1
        created = trio.current_time()
        await wait_until(lambda: trio.current_time() - created > 0.3, "the TTL to pass")
        body = await _refused(
            c.responses.create(model=MODEL_NAME, input="again", previous_response_id=first.id),
            404,
        )
        assert body["param"] == "previous_response_id"
        await _refused(c.responses.retrieve(first.id), 404)
        with pytest.raises(SessionNotFound):  # the session expired too (checked on use)
            served.engine.get_session(first.id, owner_of("alice"))
        await served.wait_idle()


async def test_a_conversation_whose_session_was_ended_cannot_be_continued() -> None:
    async with serve_scripted() as served, client(served) as c:
        first = await c.responses.create(model=MODEL_NAME, input="first")
        async with httpx.AsyncClient(headers={"Authorization": "Bearer alice"}) as h:
            ended = await h.delete(f"{served.url}/v1/sessions/{first.id}")
        assert ended.status_code == 200, ended.text
        body = await _refused(
            c.responses.create(model=MODEL_NAME, input="again", previous_response_id=first.id),
            404,
        )
        assert body["param"] == "previous_response_id" and "expired" in body["message"]
        assert (await c.responses.retrieve(first.id)).id == first.id  # the record stays
        await served.wait_idle()
