"""``Engine.reconfigure``: the live settings change while serving, the others refuse.

Steps are held with the scripted runner's gate, so what the engine does after the change is
read from the plans it recorded, never from timing.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import trio

from furnace_trio.engine import EngineBusy, EngineConfig, GenerationRequest
from furnace_trio.engine.backlog import TOKEN_BYTES

from ..scripted import ScriptedRunner, encode
from ..server.waiting import engine_reaches
from .harness import collect, request, serving


def _widest(runner: ScriptedRunner) -> int:
    """The most sequences any recorded step ran."""
    return max(len({chunk.seq_id for chunk in plan.chunks}) for plan in runner.plans)


async def test_a_larger_max_running_admits_the_queue() -> None:
    gate = threading.Event()
    runner = ScriptedRunner(gate=gate)
    config = EngineConfig(max_running=1, max_step_tokens=64)
    async with serving(runner, config) as engine, trio.open_nursery() as nursery:
        first = engine.submit(request("first", max_tokens=4))
        second = engine.submit(request("second", max_tokens=4))
        await engine_reaches(engine, lambda s: s.running == 1 and s.waiting == 1)
        engine.reconfigure(dataclasses.replace(config, max_running=2))
        assert engine.config.max_running == 2
        gate.set()
        outs = []

        async def read(stream: object) -> None:
            outs.append(await collect(stream))  # type: ignore[arg-type]

        nursery.start_soon(read, first)
        nursery.start_soon(read, second)
    assert [out.finished[0].completion_tokens for out in outs] == [4, 4]
    assert _widest(runner) == 2


async def test_a_smaller_max_waiting_refuses_new_requests() -> None:
    gate = threading.Event()
    config = EngineConfig(max_running=1, max_waiting=4)
    async with serving(ScriptedRunner(gate=gate), config) as engine:
        streams = [engine.submit(request(f"p{i}", max_tokens=2)) for i in range(3)]
        await engine_reaches(engine, lambda s: s.running == 1 and s.waiting == 2)
        engine.reconfigure(dataclasses.replace(config, max_waiting=2))
        with pytest.raises(EngineBusy):
            engine.submit(request("one more", max_tokens=2))
        gate.set()
        for stream in streams:  # the queued ones are kept
            assert (await collect(stream)).finished[0].completion_tokens == 2


async def test_a_queued_request_wider_than_a_lowered_max_running_runs_alone() -> None:
    gate = threading.Event()
    runner = ScriptedRunner(gate=gate)
    config = EngineConfig(max_running=3, max_step_tokens=64)
    async with serving(runner, config) as engine:
        first = engine.submit(request("first", max_tokens=2))
        wide = engine.submit(request("wide", max_tokens=2, n=3, seed=1))
        await engine_reaches(engine, lambda s: s.running == 1 and s.waiting == 1)
        engine.reconfigure(dataclasses.replace(config, max_running=2))
        gate.set()
        assert (await collect(first)).finished[0].completion_tokens == 2
        out = await collect(wide)
    assert sorted(out.finished) == [0, 1, 2]


async def test_a_request_keeps_the_backlog_limit_it_was_submitted_with() -> None:
    """Streams nobody reads: a request accepted before the change (the old default) and one
    with its own limit pause after a few tokens; one accepted after it gets the new
    default and runs to its end."""
    small = 3 * TOKEN_BYTES
    config = EngineConfig(max_response_bytes=small)
    async with serving(ScriptedRunner(), config) as engine:
        early = engine.submit(request("early", max_tokens=30))
        engine.reconfigure(dataclasses.replace(config, max_response_bytes=1 << 20))
        params = request("own", max_tokens=30).params
        own = engine.submit(GenerationRequest(encode("own"), params, max_response_bytes=small))
        later = engine.submit(request("later", max_tokens=30))
        await engine_reaches(engine, lambda s: s.requests_paused == 2, "two pauses")
        assert (await collect(later)).finished[0].completion_tokens == 30
        stats = engine.statistics()
        assert stats.requests_paused == 2 and stats.pauses_total == 2
        for stream in (early, own):
            assert (await collect(stream)).finished[0].completion_tokens == 30


async def test_settings_fixed_for_the_engines_life_are_refused() -> None:
    config = EngineConfig()
    async with serving(ScriptedRunner(), config) as engine:
        with pytest.raises(ValueError, match="prefix_cache"):
            engine.reconfigure(dataclasses.replace(config, prefix_cache=False, max_waiting=3))
        assert engine.config == config  # nothing changed


async def test_session_limits_change() -> None:
    config = EngineConfig()
    async with serving(ScriptedRunner(), config) as engine:
        engine.reconfigure(
            dataclasses.replace(config, session_ttl_s=5.0, max_sessions=3, session_max_blocks=7)
        )
        store = engine.sessions
        assert (store.ttl_s, store.max_sessions, store.max_blocks) == (5.0, 3, 7)
