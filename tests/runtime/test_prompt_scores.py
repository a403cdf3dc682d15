"""Prompt scores (``prompt_logprobs``): the model's log-probability of each next prompt
token, across chunks, releases and re-runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampleSpec, StepPlan
from furnace_trio.runtime import runner as runner_module
from furnace_trio.runtime.runner import ModelRunner

from .._model_fixtures import write_tiny_model
from .model_helpers import (
    block_table,
    make_runner,
    reference_logits,
)


def test_prompt_scores_are_the_models_logprobs_of_each_next_prompt_token(
    tiny: tuple[ModelRunner, torch.nn.Module, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scored prompt in two chunks (40 tokens on the chunk path, scored 16 rows at a
    time, then 10 as one-token rows where the native kernels run), beside another
    sequence's prefill: its first sampled token carries the logprob of every prompt token
    after the first, and the top alternatives, as transformers computes them; later
    tokens carry none."""
    monkeypatch.setattr(runner_module, "SCORE_ROWS", 16)
    runner, ref, vocab = tiny
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (50,), generator=gen).tolist()
    other = torch.randint(0, vocab, (5,), generator=gen).tolist()
    expected = torch.log_softmax(reference_logits(ref, ids), dim=-1)
    scored = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)

    def spec(seq_id: int, prompt: list[int], params: SamplingParams) -> SampleSpec:
        return SampleSpec(seq_id, params, tuple(prompt), ())

    table = block_table(0)
    first = runner.step(
        StepPlan(
            (
                ChunkPlan(1, tuple(ids[:40]), 0, table, score_ids=tuple(ids[1:41]), score_top=2),
                ChunkPlan(
                    2,
                    tuple(other),
                    0,
                    block_table(20, 2),
                    samples=(spec(2, other, SamplingParams(temperature=0)),),
                ),
            )
        )
    )
    assert [t.seq_id for t in first] == [2] and first[0].prompt_logprobs is None
    last = ChunkPlan(
        1,
        tuple(ids[40:]),
        40,
        table,
        samples=(spec(1, ids, scored),),
        score_ids=tuple(ids[41:]),
        score_top=2,
    )
    (token,) = runner.step(StepPlan((last,)))
    scores = token.prompt_logprobs
    assert scores is not None
    assert [s.token_id for s in scores] == ids[1:]
    got = torch.tensor([s.logprob for s in scores])
    want = expected[torch.arange(49), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for pos, s in enumerate(scores):
        top_ids = [t.token_id for t in s.top_logprobs]
        top_values = torch.tensor([t.logprob for t in s.top_logprobs])
        torch.testing.assert_close(top_values, expected[pos].topk(2).values, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(expected[pos][top_ids], top_values, atol=1e-4, rtol=1e-4)
    assert token.token_id == int(expected[49].argmax())
    follow = ChunkPlan(
        1,
        (token.token_id,),
        50,
        table,
        samples=(SampleSpec(1, scored, tuple(ids), (token.token_id,)),),
    )
    (after,) = runner.step(StepPlan((follow,)))
    assert after.prompt_logprobs is None


def test_a_prompt_released_between_its_chunks_leaves_no_scores(tmp_path: Path) -> None:
    """An abort between a scored prompt's chunks releases its sequence: the runner drops
    the scores it kept for it."""
    runner = make_runner(write_tiny_model(tmp_path, "llama", tied=False))
    ids = tuple(range(1, 11))
    runner.step(StepPlan((ChunkPlan(3, ids[:6], 0, block_table(0), score_ids=ids[1:7]),)))
    assert runner._prompt_scores.keys() == {3}
    runner.step(StepPlan((), released=(3,)))
    assert runner._prompt_scores == {}


def test_a_scored_chunk_run_again_keeps_one_score_per_position(tmp_path: Path) -> None:
    """The engine runs a failed step's chunks again (engine/isolation.py): a scored
    prompt's chunk run twice leaves the scores of one run, not two."""
    runner = make_runner(write_tiny_model(tmp_path, "llama", tied=False))
    ids = tuple(range(1, 11))
    first = ChunkPlan(3, ids[:6], 0, block_table(0), score_ids=ids[1:7], score_top=1)
    runner.step(StepPlan((first,)))
    runner.step(StepPlan((first,)))  # the step failed after scoring; it runs again
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    last = ChunkPlan(
        3,
        ids[6:],
        6,
        block_table(0),
        samples=(SampleSpec(3, params, ids, ()),),
        score_ids=ids[7:],
        score_top=1,
    )
    (token,) = runner.step(StepPlan((last,)))
    assert token.prompt_logprobs is not None
    assert [s.token_id for s in token.prompt_logprobs] == list(ids[1:])
