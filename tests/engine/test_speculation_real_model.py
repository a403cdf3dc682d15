"""Speculative decoding over the real default model: greedy tokens bitwise those of plain
decoding (the native CPU path runs a drafted chunk as one-token rows of the decode kernel,
so each position's logits do not depend on the drafts around it)."""

from __future__ import annotations

import pytest
import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine import Delta, Engine, EngineConfig, GenerationRequest, SpeculationConfig

from ..real_model import default_model, default_runner

pytestmark = pytest.mark.model

CODE = '''def area(radius):
    """Return the area of a circle."""
    return 3.14159 * radius * radius


def circumference(radius):
    """Return the circumference of a circle."""
    return 2 * 3.14159 * radius
'''
EDIT = "Rewrite this code, replacing 3.14159 with math.pi. Output only the code.\n\n" + CODE
CHAT = ("What is the capital of France?", "Write a haiku about the sea.")


def _chat_ids(text: str) -> tuple[int, ...]:
    tok = default_model().tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": text}])
    return tuple(tok.encode(rendered, add_special_tokens=False))


async def _generate(method: str, prompts: list[tuple[int, ...]]) -> tuple[list[list[int]], int]:
    """Every prompt's greedy tokens, all submitted at once; and the drafts accepted."""
    tok = default_model().tokenizer
    config = EngineConfig(speculation=SpeculationConfig(method=method))
    engine = Engine(
        default_runner(), decode=tok.decode, eos_token_ids=tok.eos_token_ids, config=config
    )
    outs: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=64, temperature=0)
        async with engine.submit(GenerationRequest(prompts[i], params)) as stream:
            async for event in stream:
                if isinstance(event, Delta):
                    outs[i].extend(event.token_ids)

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with trio.open_nursery() as requests:
            for i in range(len(prompts)):
                requests.start_soon(one, i)
        stats = await engine.wait_statistics(lambda s: s.idle)
        nursery.cancel_scope.cancel()
    assert stats.leaks() == []
    return outs, stats.spec_accepted_tokens_total


async def test_greedy_tokens_are_those_of_plain_decoding() -> None:
    default_model()  # skips without the default model
    prompts = [_chat_ids(EDIT), *(_chat_ids(q) for q in CHAT)]
    plain, _ = await _generate("off", prompts)
    alone, accepted = await _generate("ngram", prompts[:1])
    assert alone[0] == plain[0]
    assert accepted > 0
    together, _ = await _generate("ngram", prompts)  # drafted next to other sequences
    assert together == plain
