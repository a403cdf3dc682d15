"""The engine over the real default model: continuous batching with real numerics."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, StepPlan
from furnace_trio.engine import (
    Admitted,
    Delta,
    Engine,
    EngineConfig,
    Failed,
    Finished,
    GenerationRequest,
)

from ..real_model import default_model, default_runner

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Explain photosynthesis briefly.",
    "What is 2 + 2?",
    "Name a color of the rainbow.",
    "Say hello in Spanish.",
]


def _chat_ids(text: str) -> tuple[int, ...]:
    tok = default_model().tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": text}])
    return tuple(tok.encode(rendered, add_special_tokens=False))


def test_shared_step_logits_match_each_sequence_alone() -> None:
    """Prefills and decodes of several sequences in one step give each its solo logits."""
    runner = default_runner(kv_cache_mb=256)
    prompts = [_chat_ids(p) for p in PROMPTS[:4]]
    alone = []
    for i, ids in enumerate(prompts):
        table = tuple(range(16 * i, 16 * i + 16))
        first = runner.logits(StepPlan((ChunkPlan(i, ids, 0, table),)))
        token = int(first[0].argmax())
        second = runner.logits(StepPlan((ChunkPlan(i, (token,), len(ids), table),)))
        alone.append((first[0], token, second[0]))
    # Now together: all prefills in one step, then all decodes in one step (other blocks).
    tables = [tuple(range(100 + 16 * i, 116 + 16 * i)) for i in range(len(prompts))]
    together = runner.logits(
        StepPlan(tuple(ChunkPlan(i, ids, 0, tables[i]) for i, ids in enumerate(prompts)))
    )
    decodes = runner.logits(
        StepPlan(
            tuple(
                ChunkPlan(i, (alone[i][1],), len(ids), tables[i]) for i, ids in enumerate(prompts)
            )
        )
    )
    for i in range(len(prompts)):
        torch.testing.assert_close(together[i], alone[i][0], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(decodes[i], alone[i][2], atol=1e-3, rtol=1e-3)


async def _collect(engine: Engine, prompt: tuple[int, ...], params: SamplingParams) -> dict:
    out: dict = {"text": "", "tokens": [], "finish": None, "admitted": None}
    async with engine.submit(GenerationRequest(prompt, params)) as stream:
        async for event in stream:
            if isinstance(event, Admitted):
                out["admitted"] = event
            elif isinstance(event, Delta):
                out["text"] += event.text
                out["tokens"].extend(event.token_ids)
            elif isinstance(event, Finished):
                out["finish"] = event
    return out


async def test_32_concurrent_requests_all_complete() -> None:
    model = default_model()
    runner = default_runner()
    engine = Engine(
        runner,
        decode=model.tokenizer.decode,
        eos_token_ids=model.tokenizer.eos_token_ids,
        config=EngineConfig(max_running=16, max_step_tokens=256),
    )
    params = SamplingParams(temperature=0, max_tokens=6)
    results: list[dict] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)

        async def one(i: int) -> None:
            results.append(await _collect(engine, _chat_ids(PROMPTS[i % len(PROMPTS)]), params))

        async with trio.open_nursery() as clients:
            for i in range(32):
                clients.start_soon(one, i)
        stats = engine.statistics()
        engine.shutdown()
        nursery.cancel_scope.cancel()
    assert len(results) == 32
    for r in results:
        assert r["admitted"] is not None
        assert r["finish"] is not None and r["finish"].reason in ("stop", "length")
        assert 1 <= len(r["tokens"]) <= 6
        assert r["text"].strip()
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0


@pytest.mark.parametrize("table", [False, True], ids=["decode", "decode-table"])
async def test_greedy_answer_through_the_engine_says_paris(table: bool) -> None:
    """With and without the tokenizer's decode table (the server uses it): the streamed
    text is decode's text of the streamed tokens."""
    model = default_model()
    engine = Engine(
        default_runner(),
        decode=model.tokenizer.decode,
        eos_token_ids=model.tokenizer.eos_token_ids,
        decode_table=model.tokenizer.decode_table() if table else None,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        prompt = _chat_ids("What is the capital of France? Answer in one sentence.")
        out = await _collect(engine, prompt, SamplingParams(temperature=0, max_tokens=40))
        engine.shutdown()
        nursery.cancel_scope.cancel()
    assert "Paris" in out["text"]
    assert out["text"] == model.tokenizer.decode(out["tokens"])
    assert out["finish"].reason == "stop"


class _BrokenGrammar:
    """A grammar constraint whose matcher fails at the request's third token, in the
    sampler, as a broken grammar library would (no request the HTTP API accepts makes
    the real sampler raise: out-of-vocabulary ids, grammar dead ends and degenerate
    temperatures are refused, lifted or sampled)."""

    def allowed(self, seq_id: int, output_token_ids: Sequence[int]) -> None:
        if len(output_token_ids) >= 2:
            raise RuntimeError("the grammar matcher failed")


async def test_a_request_failing_in_sampling_fails_alone_with_the_others_unchanged() -> None:
    """Greedy, seeded and ``n = 2`` requests decode beside one whose sampling raises: it
    fails, and the others' tokens are those of a run without it (the real runner writes
    the failed step's keys and values again, and draws again from the seeded
    generators, which the failed step never reached)."""
    model = default_model()
    engine = Engine(
        default_runner(),
        decode=model.tokenizer.decode,
        eos_token_ids=model.tokenizer.eos_token_ids,
        config=EngineConfig(max_running=8, max_step_tokens=256, prefix_cache=False),
    )
    good = [
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=10)),
        (PROMPTS[1], SamplingParams(temperature=0.9, seed=7, max_tokens=10)),
        (PROMPTS[2], SamplingParams(temperature=0.9, seed=11, max_tokens=10, n=2)),
    ]
    bad = (PROMPTS[3], SamplingParams(temperature=0, max_tokens=10, constraint=_BrokenGrammar()))

    async def run_all(requests: list[tuple[str, SamplingParams]]) -> list[dict]:
        results: dict[int, dict] = {}

        async def one(i: int, text: str, params: SamplingParams) -> None:
            results[i] = await _collect_all(engine, _chat_ids(text), params)

        async with trio.open_nursery() as clients:
            for i, (text, params) in enumerate(requests):
                clients.start_soon(one, i, text, params)
        return [results[i] for i in range(len(requests))]

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        alone = await run_all(good)
        together = await run_all([good[0], bad, good[1], good[2]])
        stats = engine.statistics()
        assert engine.alive
        engine.shutdown()
        nursery.cancel_scope.cancel()
    failed = together.pop(1)
    assert failed["failed"] is not None and "grammar matcher failed" in failed["failed"].message
    assert len(failed["tokens"][0]) == 2  # what it drew before its third token failed
    assert together == alone
    assert all(r["failed"] is None and len(r["finish"]) == len(r["tokens"]) for r in alone)
    assert stats.requests["failed"] == 1 and stats.kv_blocks_used == 0


async def _collect_all(engine: Engine, prompt: tuple[int, ...], params: SamplingParams) -> dict:
    """Every sample's tokens, finish reasons and a failure, without timings."""
    out: dict = {"tokens": {}, "finish": {}, "failed": None}
    async with engine.submit(GenerationRequest(prompt, params)) as stream:
        async for event in stream:
            if isinstance(event, Delta):
                out["tokens"].setdefault(event.index, []).extend(event.token_ids)
            elif isinstance(event, Finished):
                out["finish"][event.index] = event.reason
            elif isinstance(event, Failed):
                out["failed"] = event
    return out
