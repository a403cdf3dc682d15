"""The OpenAI Agents SDK's default model (the Responses API) drives an agent with one
function tool to completion against this server: the real default model, a real socket.

The Agents SDK runs on asyncio, so the agent runs in a worker thread with an event loop
of its own while the server serves on Trio. The small model is steered where it could
wander: the first turn must call the tool (``tool_choice``); the Agents SDK then resets the
choice, and the model answers in text from the tool's output.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import trio
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.models.openai_responses import OpenAIResponsesModel

from ..real_model import NAME, serve_real


def _run_agent(url: str) -> dict[str, Any]:
    """Run the agent to completion (in its own asyncio loop); what the test checks."""
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"The weather in {city} is sunny, 22 degrees Celsius."

    async def main() -> dict[str, Any]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            agent = Agent(
                name="weather",
                instructions="You answer questions about the weather using your tool.",
                tools=[get_weather],
                model=OpenAIResponsesModel(model=NAME, openai_client=client),
                model_settings=ModelSettings(
                    tool_choice="get_weather",
                    temperature=0,
                    max_tokens=60,
                    parallel_tool_calls=False,
                ),
            )
            result = await Runner.run(
                agent,
                "What is the weather in Paris?",
                max_turns=4,
                run_config=RunConfig(tracing_disabled=True),
            )
            stored = [
                (await client.responses.retrieve(raw.response_id)).status
                for raw in result.raw_responses
                if raw.response_id is not None
            ]
        return {
            "calls": calls,
            "kinds": [item.type for item in result.new_items],
            "final_output": result.final_output,
            "model_calls": len(result.raw_responses),
            "stored": stored,
        }

    return asyncio.run(main())


async def test_an_agent_with_one_function_tool_runs_to_completion() -> None:
    async with serve_real() as (url, _engine):
        outcome = await trio.to_thread.run_sync(_run_agent, url)
    assert len(outcome["calls"]) == 1 and outcome["calls"][0]
    kinds = outcome["kinds"]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
    final = outcome["final_output"]
    assert isinstance(final, str) and final.strip()
    # two model calls (the tool call, then the answer), each a stored response here
    assert outcome["model_calls"] == 2
    assert outcome["stored"] == ["completed", "completed"]
