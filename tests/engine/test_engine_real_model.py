"""The engine over the real default model: continuous batching with real numerics."""

from __future__ import annotations

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
