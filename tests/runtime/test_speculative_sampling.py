"""Verifying drafts keeps the output distribution: a draft is kept with the model's
probability of it, and the first rejection draws from the rest (the standard rejection
rule for a deterministic proposal). Checked by counting many verifications of one scripted
distribution against the distribution plain sampling draws from."""

from __future__ import annotations

import torch

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import ChunkPlan, SampleSpec, StepPlan
from furnace_trio.runtime.sampling import sample
from furnace_trio.runtime.step_inputs import build_inputs
from furnace_trio.runtime.verification import accept_drafts, draft_specs

TRIALS = 40_000
#: The scripted model: logits at the last real token and at each of two drafts.
LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, 0.0, -1.0],
        [0.0, 1.5, 1.0, 0.2, 0.1],
        [1.0, 1.0, 0.0, 2.0, -3.0],
    ]
)
DRAFTS = (1, 3)


def _plain(params: SamplingParams, row: torch.Tensor) -> torch.Tensor:
    """What plain sampling draws from at one position: temperature, then top-k."""
    logits = row / params.temperature
    if params.top_k is not None:
        cut = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < cut, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _verify_many(params: SamplingParams) -> list[tuple[int, ...]]:
    chunks = tuple(
        ChunkPlan(i, (4, *DRAFTS), 1, (0,), (SampleSpec(i, params, (7,), (4,)),), num_drafts=2)
        for i in range(TRIALS)
    )
    specs = [s for chunk in chunks for s in draft_specs(chunk)]
    assert draft_specs(chunks[0])[2].output_token_ids == (4, 1, 3)
    torch.manual_seed(1234)
    logits = LOGITS.repeat(TRIALS, 1)
    sampled = sample(logits, specs, [None] * len(specs))
    kept = accept_drafts(StepPlan(chunks), sampled)
    out: dict[int, list[int]] = {}
    for token in kept:
        out.setdefault(token.seq_id, []).append(token.token_id)
    return [tuple(tokens) for tokens in out.values()]


def _check(params: SamplingParams) -> None:
    runs = _verify_many(params)
    p = [_plain(params, row) for row in LOGITS]
    first = torch.zeros(5)
    second = torch.zeros(5)
    third = torch.zeros(5)
    for tokens in runs:
        assert 1 <= len(tokens) <= 3
        # every token but the last is the draft at its position
        assert tokens[:-1] == DRAFTS[: len(tokens) - 1]
        first[tokens[0]] += 1
        if tokens[0] == DRAFTS[0]:
            second[tokens[1]] += 1
            if tokens[1] == DRAFTS[1]:
                third[tokens[2]] += 1
    # Plain decoding: the first token from p0; after the first draft, the next from p1;
    # after both, from p2. Same seed, so this is deterministic; each bound is 5 sigma of
    # a frequency over that many counts.
    for counts, expected in ((first, p[0]), (second, p[1]), (third, p[2])):
        total = float(counts.sum())
        assert total > 500
        assert torch.allclose(counts / total, expected, atol=5 * (0.25 / total) ** 0.5)


def test_sampled_verification_keeps_the_distribution() -> None:
    _check(SamplingParams(temperature=1.0))


def test_sampled_verification_keeps_a_filtered_distribution() -> None:
    _check(SamplingParams(temperature=0.7, top_k=3))


def test_greedy_verification_keeps_the_argmax_prefix() -> None:
    params = SamplingParams(temperature=0)
    chunk = ChunkPlan(0, (4, 0, 1, 2), 1, (0,), (SampleSpec(0, params),), num_drafts=3)
    logits = torch.tensor([[5.0, 0, 0], [0, 5.0, 0], [0, 0, 0.5], [1.0, 0, 0]])
    logits = torch.cat([logits, torch.zeros(4, 2)], dim=1)
    sampled = sample(logits, draft_specs(chunk), [None] * 4)
    # each row's argmax is the draft after it, then row 3 adds its own token
    assert [t.token_id for t in accept_drafts(StepPlan((chunk,)), sampled)] == [0, 1, 2, 0]
    wrong = ChunkPlan(0, (4, 0, 2, 2), 1, (0,), (SampleSpec(0, params),), num_drafts=3)
    assert [t.token_id for t in accept_drafts(StepPlan((wrong,)), sampled)] == [0, 1]


def test_a_drafted_chunk_asks_for_the_logits_of_its_last_positions() -> None:
    spec = SampleSpec(0, SamplingParams(temperature=0))
    plain = ChunkPlan(1, (9,), 3, (0,), (spec,))
    drafted = ChunkPlan(0, (4, 5, 6), 1, (1,), (spec,), num_drafts=2)
    inputs = build_inputs(StepPlan((plain, drafted)), 4, torch.device("cpu"), split_upto=64)
    assert inputs.logit_rows.tolist() == [0, 1, 2, 3]
    inputs = build_inputs(StepPlan((drafted, plain)), 4, torch.device("cpu"))  # chunk path
    assert inputs.logit_rows.tolist() == [0, 1, 2, 3]


class _Prefix:
    """A constraint that allows only the tokens of ``text`` in order (token ids are
    values; a mask of one word each), recording what it was asked."""

    def __init__(self, text: tuple[int, ...]) -> None:
        self.text = text
        self.asked: list[tuple[int, ...]] = []

    def allowed(self, seq_id: int, output_token_ids: object) -> torch.Tensor:
        out = tuple(output_token_ids)  # type: ignore[call-overload]
        self.asked.append(out)
        return torch.tensor([1 << self.text[len(out)]], dtype=torch.int32)

    def valid_drafts(self, seq_id: int, output_token_ids: object, drafts: object) -> int:
        start = len(output_token_ids)  # type: ignore[arg-type]
        held = 0
        for i, token in enumerate(drafts):  # type: ignore[attr-defined]
            if self.text[start + i] != token:
                break
            held += 1
        return held


def test_a_grammar_refuses_drafts_it_does_not_allow() -> None:
    """Drafts checked against a constraint: its masks are asked for the positions up to
    the first draft it refuses, which that position's draw then replaces; the positions
    after it draw unconstrained and are never kept."""
    grammar = _Prefix((4, 1, 2, 3, 0))
    params = SamplingParams(temperature=0, constraint=grammar)
    spec = SampleSpec(0, params, (7,), (4,))
    chunk = ChunkPlan(0, (4, 1, 3, 3), 1, (0,), (spec,), num_drafts=3)  # 1 holds, 3 does not
    specs = draft_specs(chunk)
    assert [s.params.constraint is grammar for s in specs] == [True, True, False, False]
    logits = torch.zeros(4, 5)
    logits[:, 3] = 10.0  # the model would draw 3 everywhere
    sampled = sample(logits, specs, [None] * 4)
    kept = accept_drafts(StepPlan((chunk,)), sampled)
    assert [t.token_id for t in kept] == [1, 2]  # the draft 1 held; the grammar's 2, not 3
    assert grammar.asked == [(4,), (4, 1)]
