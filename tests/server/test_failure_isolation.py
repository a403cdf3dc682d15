"""Over HTTP: a request whose model step raises gets a 500 error object (an error event
when streamed), and the requests that shared its steps complete as they would without
it (engine/isolation.py)."""

from __future__ import annotations

import threading
from typing import Any

import openai
import pytest
import trio

from furnace_trio.core.plan import StepPlan
from furnace_trio.engine import EngineConfig

from .. import scripted
from ..http_server import ANSWERS, MODEL_NAME, default_script, serve_scripted
from .waiting import engine_reaches

#: A token id inside the vocabulary that no rendered prompt holds: the scripted model
#: raises on any step that feeds it.
POISON = 49_000


def _poisoned(plan: StepPlan) -> bool:
    return any(POISON in chunk.token_ids for chunk in plan.chunks)


async def _serve_all(with_bad: bool) -> dict[str, Any]:
    gate = threading.Event()
    runner = scripted.ScriptedRunner(default_script, gate=gate, fail_when=_poisoned)
    results: dict[str, Any] = {}
    async with serve_scripted(runner, engine_config=EngineConfig(max_running=8)) as served:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)

        async def chat_streamed() -> None:
            stream = await client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            results["chat"] = "".join(pieces)

        async def completion(prompt: list[int], key: str) -> None:
            try:
                reply = await client.completions.create(
                    model=MODEL_NAME, prompt=prompt, max_tokens=20, n=2
                )
                results[key] = [choice.text for choice in reply.choices]
            except openai.APIStatusError as exc:
                results[key] = exc

        async def completion_streamed(prompt: list[int], key: str) -> None:
            stream = await client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=20, stream=True
            )
            texts: list[str] = []
            try:
                async for chunk in stream:
                    texts.append(chunk.choices[0].text)
            except openai.APIError as exc:
                results[key] = exc
            else:
                results[key] = "".join(texts)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(chat_streamed)
            await engine_reaches(served.engine, lambda s: s.running == 1)  # its step waits
            nursery.start_soon(completion, [5, 6, 7], "completion")
            if with_bad:
                nursery.start_soon(completion, [5, POISON, 7], "bad")
                nursery.start_soon(completion_streamed, [POISON, 9], "bad streamed")
            # everyone but the first waits, to be admitted together into one step
            waiting = 3 if with_bad else 1
            await engine_reaches(served.engine, lambda s: s.waiting == waiting)
            gate.set()
        results["stats"] = served.engine.statistics()
        await served.wait_idle()
    return results


async def test_the_failing_requests_get_errors_and_the_others_their_answers() -> None:
    alone = await _serve_all(with_bad=False)
    together = await _serve_all(with_bad=True)
    bad = together["bad"]
    assert isinstance(bad, openai.InternalServerError)
    assert bad.status_code == 500
    error = bad.body
    assert isinstance(error, dict) and set(error) >= {"message", "type", "param", "code"}
    assert "scripted failure" in error["message"]
    streamed = together["bad streamed"]
    assert isinstance(streamed, openai.APIError) and "scripted failure" in streamed.message
    assert together["chat"] == alone["chat"] == ANSWERS[0]
    assert together["completion"] == alone["completion"] == list(ANSWERS)
    assert together["stats"].requests["failed"] == 2


@pytest.fixture(autouse=True)
def _quiet_failures(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="furnace_trio.engine.engine")
