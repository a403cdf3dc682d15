"""Shared by the engine's tests: an engine serving a scripted runner, and a stream's
events collected into an :class:`Outcome`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import StepPlan
from furnace_trio.engine import (
    Delta,
    Engine,
    EngineConfig,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    RequestStream,
)
from furnace_trio.engine.pacing import StepPacer

from ..scripted import EOS, ScriptedRunner, decode, encode, token_bytes


@dataclass(slots=True)
class Outcome:
    events: list[Event] = field(default_factory=list)
    text: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)
    failed: Failed | None = None


async def collect(stream: RequestStream) -> Outcome:
    out = Outcome()
    async with stream:
        async for event in stream:
            out.events.append(event)
            if isinstance(event, Delta):
                out.text[event.index] = out.text.get(event.index, "") + event.text
                out.token_ids.setdefault(event.index, []).extend(event.token_ids)
            elif isinstance(event, Finished):
                assert event.index not in out.finished
                out.finished[event.index] = event
            elif isinstance(event, Failed):
                out.failed = event
        # a session turn's consumer commits the reply it delivered (here: its text)
        stream.commit_turn({"role": "assistant", "content": out.text.get(0, "")})
    return out


@asynccontextmanager
async def serving(
    runner: ScriptedRunner,
    config: EngineConfig | None = None,
    decode: Callable[[list[int]], str] = decode,
    pacer: StepPacer | None = None,
) -> AsyncIterator[Engine]:
    engine = Engine(
        runner,
        decode=decode,
        eos_token_ids=frozenset({EOS}),
        token_bytes=token_bytes,
        config=config or EngineConfig(),
        pacer=pacer,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        yield engine
        nursery.cancel_scope.cancel()


def request(prompt: str, **params: object) -> GenerationRequest:
    return GenerationRequest(encode(prompt), SamplingParams(**params))  # type: ignore[arg-type]


def chunks_of(plan: StepPlan, seq_ids: set[int]) -> list[int]:
    return [len(c.token_ids) for c in plan.chunks if c.seq_id in seq_ids]


def seq_ids_of(runner: ScriptedRunner, prompt: tuple[int, ...]) -> set[int]:
    """Seq ids that ran or sampled for a prompt (first-chunk match on the prompt's start)."""
    ids: set[int] = set()
    for plan in runner.plans:
        for chunk in plan.chunks:
            if chunk.start_pos == 0 and chunk.token_ids == prompt[: len(chunk.token_ids)]:
                ids.add(chunk.seq_id)
            for spec in chunk.samples:
                if spec.prompt_token_ids == prompt:
                    ids.add(spec.seq_id)
                    ids.add(chunk.seq_id)
    return ids


async def collect_all(streams: list[RequestStream]) -> list[Outcome]:
    results: list[Outcome] = [Outcome()] * len(streams)

    async def one(i: int) -> None:
        results[i] = await collect(streams[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(streams)):
            nursery.start_soon(one, i)
    return results


def delta_sizes(out: Outcome, index: int = 0) -> list[int]:
    return [len(e.token_ids) for e in out.events if isinstance(e, Delta) and e.index == index]
