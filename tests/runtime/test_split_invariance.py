"""Greedy decoding of the default model at the server's settings gives bitwise the same
logits at every step whatever the schedule: the whole prompt in one chunk or in chunks of
any size, its first blocks taken from the prefix cache (written by another sequence), or
other sequences in the same steps. Near-ties of the first tokens are what a difference in
accumulation order turns into a different answer, so every step's logits are compared,
not only the tokens, over prompts short and long and long generations."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch

from furnace_trio.core.plan import ChunkPlan, StepPlan
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig
from tests.real_model import default_model

pytestmark = pytest.mark.model

STEPS = 24
QUESTIONS = (
    "What is the capital of France?",
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Give the keeper a name, describe the island, the storm that night, and what the "
    "message said, and end with what the keeper decided to do the next morning.",
)


def _prompts() -> list[list[int]]:
    tokenizer = default_model().tokenizer
    prompts = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    # a long one: several paragraphs of the second question as one user turn
    long_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": " ".join([QUESTIONS[1]] * 3)}], add_generation_prompt=True
    )
    prompts.append(tokenizer.encode(long_text, add_special_tokens=False))
    return prompts


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner.from_loaded(
        default_model(),
        RunnerConfig(device="cpu", kv_cache_bytes=64 << 20, quantization="auto"),
    )


@dataclass(slots=True)
class _Seq:
    """One greedy sequence of the test's hand-made schedule: its tokens, what is cached,
    and its block table."""

    tokens: list[int]
    table: tuple[int, ...]
    computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)


class _Blocks:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._next = itertools.count()

    def table(self, tokens: int, shared: tuple[int, ...] = ()) -> tuple[int, ...]:
        need = -(-tokens // self.block_size) - len(shared)
        return shared + tuple(next(self._next) for _ in range(need))


def _greedy(
    runner: ModelRunner,
    prompt: list[int],
    *,
    chunk: int | None = None,
    cached_blocks: int = 0,
    neighbours: int = 0,
) -> list[torch.Tensor]:
    """Next-token logits of ``prompt``'s ``STEPS`` greedy steps under one schedule.

    ``chunk``: prompt tokens per step (``None``: the whole rest at once);
    ``cached_blocks``: that many full blocks of the prompt are first written by another
    sequence, whose blocks this one then shares (a prefix-cache hit); ``neighbours``:
    other sequences (prompts of their own) prefilled and decoded in the same steps.
    """
    blocks = _Blocks(runner.block_size)
    total = len(prompt) + STEPS
    shared: tuple[int, ...] = ()
    if cached_blocks:
        cached = cached_blocks * runner.block_size
        assert cached < len(prompt)
        shared = blocks.table(cached)
        runner.logits(StepPlan((ChunkPlan(1000, tuple(prompt[:cached]), 0, shared),)))
    seqs = [
        _Seq(list(prompt), blocks.table(total, shared), computed=len(shared) * runner.block_size)
    ]
    for n in range(neighbours):
        other = prompt[: 7 + 13 * n][::-1] + prompt[:3]
        seqs.append(_Seq(other, blocks.table(len(other) + STEPS)))
    while len(seqs[0].logits) < STEPS:
        chunks = []
        for i, s in enumerate(seqs):
            left = len(s.tokens) - s.computed
            size = left if chunk is None or i > 0 else min(chunk, left)
            ids = tuple(s.tokens[s.computed : s.computed + size])
            chunks.append(ChunkPlan(i, ids, s.computed, s.table))
        logits = runner.logits(StepPlan(tuple(chunks)))
        for s, c, row in zip(seqs, chunks, logits, strict=True):
            s.computed += len(c.token_ids)
            if s.computed == len(s.tokens):  # the prompt is in: the row samples
                s.logits.append(row.clone())
                s.tokens.append(int(row.argmax()))
    return seqs[0].logits


SCHEDULES = {
    "chunks-of-7": {"chunk": 7},
    "chunks-of-64": {"chunk": 64},
    "one-block-cached": {"cached_blocks": 1},
    "blocks-cached-then-chunks-of-5": {"cached_blocks": 2, "chunk": 5},
    "with-neighbours": {"neighbours": 3},
}


@pytest.mark.parametrize("prompt_index", range(len(QUESTIONS) + 1), ids=["short", "medium", "long"])
def test_greedy_logits_do_not_depend_on_the_schedule(
    runner: ModelRunner, prompt_index: int
) -> None:
    prompt = _prompts()[prompt_index]
    base = _greedy(runner, prompt)
    for name, schedule in SCHEDULES.items():
        got = _greedy(runner, prompt, **schedule)
        for step, (want, have) in enumerate(zip(base, got, strict=True)):
            assert torch.equal(want, have), (
                f"{name}: step {step} of a {len(prompt)}-token prompt differs by "
                f"{float((want - have).abs().max()):.3g}"
            )
