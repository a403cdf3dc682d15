"""The Responses API end to end: the official SDK over a real socket, the real default model.

Greedy sampling throughout, so the model's answers are fixed; where the small model could
wander (a tool call), the call is forced with ``tool_choice`` and a strict schema.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from ..real_model import NAME, default_model, serve_real

QUESTION = "What is the capital of France? Answer in one sentence."
TEACHER = "You are a geography teacher."
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
FORCED: dict[str, Any] = {"type": "function", "name": "get_weather"}


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


async def test_create_retrieve_input_items_delete() -> None:
    async with serve_real() as (url, engine), _client(url) as client:
        first = await client.responses.create(
            model=NAME, input=QUESTION, temperature=0, max_output_tokens=40
        )
        assert first.id.startswith("resp_") and first.object == "response"
        assert first.status == "completed" and first.incomplete_details is None
        assert "Paris" in first.output_text
        [message] = first.output
        assert message.type == "message" and message.role == "assistant"
        assert [part.type for part in message.content] == ["output_text"]
        assert first.usage is not None
        assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
        assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
        assert first.store is True

        # an item list with content parts, and instructions, which reach the prompt as its
        # system message
        items: Any = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
        instructed = await client.responses.create(
            model=NAME,
            input=items,
            instructions=TEACHER,
            temperature=0,
            max_output_tokens=1,
            metadata={"lesson": "capitals"},
        )
        tokenizer = default_model().tokenizer
        prompt = tokenizer.apply_chat_template(
            [{"role": "system", "content": TEACHER}, {"role": "user", "content": QUESTION}],
            add_generation_prompt=True,
        )
        assert instructed.usage is not None
        assert instructed.usage.input_tokens == len(
            tokenizer.encode(prompt, add_special_tokens=False)
        )
        assert instructed.instructions == TEACHER
        assert instructed.metadata == {"lesson": "capitals"}
        # one token cannot finish an answer: incomplete, and said why
        assert instructed.status == "incomplete"
        assert instructed.incomplete_details is not None
        assert instructed.incomplete_details.reason == "max_output_tokens"
        assert instructed.usage.output_tokens == 1

        again = await client.responses.retrieve(first.id)
        assert again.model_dump() == first.model_dump()
        listed = await client.responses.input_items.list(instructed.id)
        assert [(i.type, getattr(i, "role", None)) for i in listed.data] == [("message", "user")]
        assert listed.data[0].content[0].text == QUESTION  # type: ignore[union-attr]

        await client.responses.delete(first.id)
        for call in (client.responses.retrieve, client.responses.delete):
            with pytest.raises(openai.NotFoundError):
                await call(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.input_items.list("resp_unknown")
        # deleting the last response of a conversation ends its session: its KV is free
        await _idle_but_sessions(engine)
        assert engine.statistics().sessions == 1
        assert engine.statistics().session_pinned_blocks > 0
        await client.responses.delete(instructed.id)
        stats = engine.statistics()
        assert stats.sessions == 0 and stats.session_pinned_blocks == stats.kv_block_refs == 0


async def _idle_but_sessions(engine: Any) -> None:
    """Idle, and every KV block reference a pin of a session that stored responses keep."""
    from .waiting import wait_until

    def idle() -> bool:
        stats = engine.statistics()
        return bool(stats.idle and not stats.leaks())

    await wait_until(idle, "an idle engine")


async def test_stream_events_in_order_with_sequence_numbers() -> None:
    async with serve_real() as (url, engine), _client(url) as client:
        whole = await client.responses.create(
            model=NAME, input=QUESTION, temperature=0, max_output_tokens=40
        )
        async with client.responses.stream(
            model=NAME, input=QUESTION, temperature=0, max_output_tokens=40
        ) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_response()
        kinds = [event.type for event in events]
        assert [event.sequence_number for event in events] == list(range(len(events)))
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) > 1
        assert kinds == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            *["response.output_text.delta"] * len(deltas),
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert "".join(deltas) == final.output_text == whole.output_text
        assert final.id == events[0].response.id  # type: ignore[union-attr]
        assert final.status == "completed" and final.usage is not None
        assert final.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]

        # a forced call streams as a function_call item with its arguments
        async with client.responses.stream(
            model=NAME,
            input="What is the weather in Paris?",
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            tool_choice=FORCED,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            temperature=0,
            max_output_tokens=40,
        ) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_response()
        kinds = [event.type for event in events]
        assert [event.sequence_number for event in events] == list(range(len(events)))
        assert kinds == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        [call] = final.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments)["city"]
        assert events[4].arguments == call.arguments  # type: ignore[union-attr]

        # cut by max_output_tokens: the stream ends with response.incomplete
        raw = await client.responses.create(
            model=NAME, input=QUESTION, temperature=0, max_output_tokens=3, stream=True
        )
        events = [event async for event in raw]
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
        assert [event.sequence_number for event in events] == list(range(len(events)))
        await _idle_but_sessions(engine)


class Capital(BaseModel):
    country: str
    city: str


async def test_parse_with_a_pydantic_model() -> None:
    async with serve_real() as (url, engine), _client(url) as client:
        parsed = await client.responses.parse(
            model=NAME,
            input="What is the capital of France?",
            text_format=Capital,
            temperature=0,
            max_output_tokens=60,
        )
        assert parsed.status == "completed"
        assert isinstance(parsed.output_parsed, Capital)
        assert parsed.text is not None and parsed.text.format is not None
        assert parsed.text.format.type == "json_schema"
        await _idle_but_sessions(engine)


async def test_function_tool_round_trip_and_cached_continuation() -> None:
    async with serve_real() as (url, engine), _client(url) as client:
        asked = await client.responses.create(
            model=NAME,
            input="What is the weather in Paris?",
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            tool_choice=FORCED,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            temperature=0,
            max_output_tokens=40,
        )
        [call] = asked.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.call_id.startswith("call_") and json.loads(call.arguments)["city"]
        assert asked.status == "completed"
        assert asked.tool_choice.type == "function"  # type: ignore[union-attr]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 C"}

        # through previous_response_id: only the tool's output is sent, and the KV of the
        # prompt before it is reused (reported as cached) as far as the prompts agree (the
        # forced call's prompt names the function it must call)
        answered = await client.responses.create(
            model=NAME,
            previous_response_id=asked.id,
            input=[result],  # type: ignore[list-item]
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            temperature=0,
            max_output_tokens=80,
        )
        assert answered.previous_response_id == asked.id
        # What the small model makes of the tool's output is its own affair (greedy, it may
        # imitate a tool response until the limit); the response reports it either way.
        if answered.status == "incomplete":
            assert answered.incomplete_details is not None
            assert answered.incomplete_details.reason == "max_output_tokens"
        else:
            assert answered.status == "completed", answered.output_text
        assert {item.type for item in answered.output} <= {"message", "function_call"}
        assert answered.usage is not None and asked.usage is not None
        assert answered.usage.input_tokens_details.cached_tokens > 0
        assert answered.usage.input_tokens > asked.usage.input_tokens

        # through the whole input list, not stored: the same conversation, nothing kept
        whole = await client.responses.create(
            model=NAME,
            input=[
                {"role": "user", "content": "What is the weather in Paris?"},
                call.model_dump(exclude_none=True),
                result,
            ],  # type: ignore[list-item]
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            tool_choice="none",
            temperature=0,
            max_output_tokens=30,
            store=False,
        )
        assert whole.status == "completed" and whole.output_text
        assert whole.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(whole.id)

        # a function_call_output answering no call is refused, naming the item
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model=NAME,
                previous_response_id=asked.id,
                input=[{**result, "call_id": "call_unknown"}],  # type: ignore[list-item]
            )
        assert refused.value.body["param"] == "input[0].call_id"  # type: ignore[index]

        # a plain continuation of a plain response reuses its KV too
        first = await client.responses.create(
            model=NAME, input=QUESTION, temperature=0, max_output_tokens=20
        )
        second = await client.responses.create(
            model=NAME,
            previous_response_id=first.id,
            input="And of Germany?",
            temperature=0,
            max_output_tokens=20,
        )
        assert first.usage is not None and second.usage is not None
        cached = second.usage.input_tokens_details.cached_tokens
        assert cached >= first.usage.input_tokens // 16 * 16
        assert cached > first.usage.input_tokens_details.cached_tokens
        assert "Berlin" in second.output_text
        await _idle_but_sessions(engine)
