"""Speculative decoding with a draft model (``draft``), over the real default model: the
default model as its own draft gives plain decoding's greedy tokens and has every draft
inside an answer accepted; a scripted draft whose proposals are wrong still gives the same
tokens; the draft's KV cache is given back when sequences end or are cancelled."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import pytest
import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import SampledToken, StepPlan
from furnace_trio.engine import Delta, Engine, EngineConfig, GenerationRequest, SpeculationConfig
from furnace_trio.runtime.draft import DraftModel
from furnace_trio.runtime.runner import ModelRunner

from ..real_model import default_model, default_runner
from .test_speculation_real_model import CHAT, EDIT, _chat_ids

pytestmark = pytest.mark.model

MAX_TOKENS = 48


class ScriptedDrafter:
    """Proposes ``propose(context, k)`` for each drafted chunk (``context``: the
    sequence's tokens), as a draft model would, and records what it proposed."""

    def __init__(self, propose: Callable[[tuple[int, ...], int], Sequence[int]]) -> None:
        self.propose = propose
        self.proposed = 0

    def fill(self, plan: StepPlan) -> StepPlan:
        proposals = {}
        for chunk in plan.chunks:
            if chunk.num_drafts:
                spec = chunk.samples[0]
                context = spec.prompt_token_ids + spec.output_token_ids
                proposals[chunk.seq_id] = tuple(self.propose(context, chunk.num_drafts))
                self.proposed += chunk.num_drafts
        return plan.with_drafts(proposals)

    def release(self, seq_ids: Iterable[int]) -> None:
        pass

    def observe(self, plan: StepPlan, tokens: Sequence[SampledToken]) -> None:
        pass


class RecordingDraft(DraftModel):
    """The draft model, recording each drafted sequence's tokens and its proposals."""

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        super().__init__(runner, vocab_size)
        self.log: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def fill(self, plan: StepPlan) -> StepPlan:
        plan = super().fill(plan)
        for chunk in plan.chunks:
            if chunk.num_drafts:
                spec = chunk.samples[0]
                context = spec.prompt_token_ids + spec.output_token_ids
                self.log.append((context, chunk.draft_token_ids))
        return plan


def _engine(runner: ModelRunner, method: str) -> Engine:
    tok = default_model().tokenizer
    config = EngineConfig(speculation=SpeculationConfig(method=method))
    return Engine(runner, decode=tok.decode, eos_token_ids=tok.eos_token_ids, config=config)


async def _generate(
    engine: Engine, prompts: list[tuple[int, ...]], *, then: Callable[[], object] | None = None
) -> tuple[list[list[int]], int, int]:
    """Every prompt's greedy tokens, all submitted at once; the drafts run and accepted.
    ``then`` runs after they finished, with the engine still serving."""
    outs: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
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
        if then is not None:
            await then()  # type: ignore[misc]
        nursery.cancel_scope.cancel()
    assert stats.leaks() == []
    return outs, stats.spec_drafted_tokens_total, stats.spec_accepted_tokens_total


def _prompts() -> list[tuple[int, ...]]:
    return [_chat_ids(EDIT), *(_chat_ids(q) for q in CHAT)]


async def _plain(prompts: list[tuple[int, ...]]) -> list[list[int]]:
    plain, _, _ = await _generate(_engine(default_runner(), "off"), prompts)
    return plain


async def test_the_model_as_its_own_draft_gives_plain_tokens() -> None:
    model = default_model()  # skips without the default model
    prompts = _prompts()
    plain = await _plain(prompts)
    runner = default_runner()
    draft = RecordingDraft(default_runner(), model.config.vocab_size)
    runner.drafter = draft
    engine = _engine(runner, "draft")

    async def one_more() -> None:
        # the next step releases the finished sequences: the draft's cache empties
        params = SamplingParams(max_tokens=1, temperature=0)
        async with engine.submit(GenerationRequest(prompts[1], params)) as stream:
            async for _ in stream:
                pass

    out, drafted, accepted = await _generate(engine, prompts, then=one_more)
    assert out == plain
    # the same model proposes what it verifies: every draft is plain decoding's next token,
    # and all are accepted but those past a sample's end (its end token and what follows)
    within = 0
    for context, drafts in draft.log:
        i, prompt = next((i, p) for i, p in enumerate(prompts) if context[: len(p)] == p)
        done = len(context) - len(prompt)
        expected = plain[i][done : done + len(drafts)]
        assert drafts[: len(expected)] == tuple(expected)
        within += len(expected)
        if len(drafts) > len(expected) and len(plain[i]) < MAX_TOKENS:  # the end token
            assert drafts[len(expected)] in model.tokenizer.eos_token_ids
            within += 1
    assert drafted == sum(len(d) for _, d in draft.log) > 0
    assert accepted == within
    assert accepted > 0.8 * drafted
    assert draft.num_sequences == 0
    assert draft.num_free_blocks == draft.runner.num_blocks


async def test_wrong_proposals_give_plain_tokens() -> None:
    default_model()
    prompts = _prompts()
    plain = await _plain(prompts)
    outputs = {p: out for p, out in zip(prompts, plain, strict=True)}

    def prompt_of(context: tuple[int, ...]) -> tuple[int, ...]:
        return next(p for p in prompts if context[: len(p)] == p)

    def mostly_right(context: tuple[int, ...], k: int) -> list[int]:
        """Plain decoding's next tokens, every third one wrong."""
        prompt = prompt_of(context)
        done = len(context) - len(prompt)
        right = [*outputs[prompt], *[0] * k][done : done + k]
        return [t + 1 if (done + i) % 3 == 2 else t for i, t in enumerate(right)]

    for propose, some_accepted in (
        (lambda context, k: [17] * k, False),  # never what the model says
        (mostly_right, True),
    ):
        runner = default_runner()
        drafter = ScriptedDrafter(propose)
        runner.drafter = drafter
        out, drafted, accepted = await _generate(_engine(runner, "draft"), prompts)
        assert out == plain
        assert drafted == drafter.proposed > 0
        assert (0 < accepted < drafted) if some_accepted else accepted == 0


async def test_cancelled_and_sampled_sequences_give_back_the_drafts_cache() -> None:
    model = default_model()
    runner = default_runner()
    draft = DraftModel(default_runner(), model.config.vocab_size)
    runner.drafter = draft
    engine = _engine(runner, "draft")
    prompts = _prompts()
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        params = SamplingParams(max_tokens=200, temperature=0)
        for prompt in prompts:
            async with engine.submit(GenerationRequest(prompt, params)) as stream:
                async for event in stream:
                    if isinstance(event, Delta) and event.token_ids and draft.num_sequences:
                        break  # it has drafted: cancel it
        assert draft.num_sequences > 0
        # a sampled request drafts too (a greedy proposal is a one-hot q), and ends normally
        drafted = engine.statistics().spec_drafted_tokens_total
        params = SamplingParams(max_tokens=40, temperature=0.7)
        tokens = 0
        async with engine.submit(GenerationRequest(prompts[0], params)) as stream:
            async for event in stream:
                tokens += len(event.token_ids) if isinstance(event, Delta) else 0
        assert tokens > 0
        assert engine.statistics().spec_drafted_tokens_total > drafted
        params = SamplingParams(max_tokens=1, temperature=0)
        async with engine.submit(GenerationRequest(prompts[0], params)) as stream:
            async for _ in stream:
                pass
        stats = await engine.wait_statistics(lambda s: s.idle)
        nursery.cancel_scope.cancel()
    assert stats.leaks() == []
    assert stats.spec_drafted_tokens_total > 0
    assert draft.num_sequences == 0
    assert draft.num_free_blocks == draft.runner.num_blocks
