"""Engine supervision: a dead engine or a step past the watchdog fails everyone with an
error (SSE event or 5xx object), ``/health`` and new requests answer 503, and with
``exit_on_engine_failure`` the process exits (the exit function is injected here)."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import trio
import trio.testing

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine import (
    Engine,
    EngineConfig,
    EngineUnavailable,
    Failed,
    FailureCause,
    GenerationRequest,
)
from furnace_trio.server.lifecycle import ENGINE_FAILURE_EXIT

from .. import scripted
from ..http_server import MODEL_NAME, default_script, serve_scripted
from .waiting import engine_reaches

MESSAGES = [{"role": "user", "content": "hi"}]
#: A real (short) watchdog: virtual time cannot be used while a worker thread runs.
WATCHDOG_S = 0.2


async def test_engine_watchdog_fails_everyone_and_returns_while_the_step_hangs() -> None:
    gate = threading.Event()
    runner = scripted.ScriptedRunner(default_script, gate=gate)
    engine = Engine(
        runner,
        decode=scripted.decode,
        eos_token_ids=frozenset({scripted.EOS}),
        config=EngineConfig(step_timeout_s=WATCHDOG_S),
    )
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            stream = engine.submit(
                GenerationRequest(scripted.encode("hello"), SamplingParams(max_tokens=5))
            )
            events = [event async for event in stream]
        # run() returned although the step's thread is still blocked on the gate
        assert not gate.is_set()
        failed = events[-1]
        assert isinstance(failed, Failed) and failed.cause is FailureCause.ENGINE
        assert "watchdog" in failed.message
        assert not engine.alive and engine.failure is not None
        with pytest.raises(EngineUnavailable):
            engine.submit(GenerationRequest(scripted.encode("x"), SamplingParams()))
    finally:
        gate.set()  # let the abandoned thread finish


async def test_watchdog_over_http_errors_everyone_and_health_fails() -> None:
    gate = threading.Event()
    runner = scripted.ScriptedRunner(default_script, gate=gate)
    try:
        async with (
            serve_scripted(runner, engine_config=EngineConfig(step_timeout_s=WATCHDOG_S)) as s,
            openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0) as client,
            httpx.AsyncClient(base_url=s.url, timeout=30) as http,
        ):
            outcomes: dict[str, object] = {}

            async def streaming() -> None:
                stream = await client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=MESSAGES,  # type: ignore[arg-type]
                    stream=True,
                )
                try:
                    async for _ in stream:
                        pass
                except openai.APIError as exc:
                    outcomes["stream"] = str(exc)

            async def blocking() -> None:
                response = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
                outcomes["blocking"] = (response.status_code, response.json())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(streaming)
                nursery.start_soon(blocking)
            assert "watchdog" in str(outcomes["stream"])
            status, body = outcomes["blocking"]  # type: ignore[misc]
            assert status == 503 and "watchdog" in body["error"]["message"]
            health = await http.get("/health")
            assert health.status_code == 503 and "watchdog" in health.json()["error"]
            late = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
            assert late.status_code == 503 and late.json()["error"]["code"] == "unavailable"
            assert not gate.is_set()  # all of it while the step still hangs
    finally:
        gate.set()


async def test_exit_on_engine_failure_calls_exit_after_the_errors_went_out() -> None:
    runner = scripted.EngineKillingRunner(default_script)
    async with serve_scripted(runner, exit_on_engine_failure=True) as served:
        exits: list[int] = []
        exited = trio.Event()

        def exit_process(code: int) -> None:
            exits.append(code)
            exited.set()

        served.state.exit_process = exit_process
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="k", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model=MODEL_NAME,
                messages=MESSAGES,  # type: ignore[arg-type]
                stream=True,
            )
            with pytest.raises(openai.APIError, match="engine failed"):
                async for _ in stream:
                    pass
        # the supervisor waits EXIT_GRACE_S, then exits
        with trio.fail_after(3.0):
            await exited.wait()
        assert exits == [ENGINE_FAILURE_EXIT]


async def test_no_exit_without_the_setting_or_on_a_normal_stop() -> None:
    exits: list[int] = []
    async with serve_scripted(exit_on_engine_failure=True) as served:
        served.state.exit_process = exits.append
        async with httpx.AsyncClient(base_url=served.url) as http:
            assert (await http.get("/health")).status_code == 200
    assert exits == []  # a shutdown is not a failure
    async with serve_scripted(scripted.EngineKillingRunner(default_script)) as served:
        served.state.exit_process = exits.append
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
            response = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
            assert response.status_code == 503
            await engine_reaches(served.engine, lambda s: not s.alive, "the engine stopped")
            await trio.testing.wait_all_tasks_blocked()  # the supervisor has done its part
    assert exits == []
