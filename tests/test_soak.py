"""A short soak over a scripted runner: ~100 mixed requests from 16 clients with early
disconnects, stop strings, n > 1 and session turns, and a hostile client beside them
(oversized schemas, fan-out, broken Unicode and numbers); nothing lost, nothing leaked,
every hostile request answered as expected, the event loop never stalled.

The full soak against the real model is ``nox -s soak`` (``benchmarks/soak.py``); this
runs the same workload and the same checks in a few seconds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from furnace_trio.engine import EngineConfig
from furnace_trio.server.state import STATE_KEY
from furnace_trio.tools.grammar import GrammarCompiler

from . import scripted
from .http_server import scripted_app, smollm2_tokenizer

SOAK_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def _soak_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("furnace_soak", SOAK_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["furnace_soak"] = module  # dataclasses resolve their module
    spec.loader.exec_module(module)
    return module


def _script(prompt: tuple[int, ...], index: int) -> list[int]:
    words = b"The sea and the sky. Blue and green.\nMore text follows here."
    return [*words[: 10 + len(prompt) % 40], scripted.EOS]


async def test_short_soak_loses_and_leaks_nothing() -> None:
    soak = _soak_module()
    runner = scripted.ScriptedRunner(_script, num_blocks=2048, sleep=0.002)
    app, engines = scripted_app(
        runner, engine_config=EngineConfig(max_running=8, max_step_tokens=256)
    )
    # as load_backend does for a real model: the llguidance tokenizer, built before serving
    grammar = GrammarCompiler(smollm2_tokenizer())
    grammar.warm()
    app.extensions[STATE_KEY].grammar = grammar
    report = await soak.run_soak(
        app,
        lambda: engines[0],
        clients=16,
        duration_s=25.0,
        max_requests=100,
        max_tokens=24,
        seed=1,
        request_timeout=20.0,
        idle_timeout=10.0,
    )
    print(report.summary())
    assert report.requests == 100
    assert not report.lost, report.lost
    assert not report.leaks, report.leaks
    assert sum(report.outcomes.values()) == 100
    assert report.outcomes["complete"] > 50
    assert report.outcomes["disconnected"] > 0
    assert not any(status >= 500 for status in report.statuses)
    hostile = report.hostile
    assert hostile is not None and not hostile.unexpected, hostile.unexpected
    assert set(hostile.statuses) == {case.name for case in soak.hostile_cases()}
    assert set(hostile.statuses["schema-44k"]) == {400}
    assert set(hostile.statuses["fan-out"]) == {400}
    assert hostile.statuses["schema-compiles"][200] >= 1
