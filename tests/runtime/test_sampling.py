"""Batched sampling on random logits: exact expectations, no model."""

from __future__ import annotations

import pytest
import torch

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import SampleSpec
from furnace_trio.runtime import native
from furnace_trio.runtime.sampling import GeneratorStore, _draw, _process, sample

VOCAB = 50


def logits_for(batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, VOCAB, generator=g) * 3


def specs_for(batch: int, **params: object) -> list[SampleSpec]:
    p = SamplingParams(**params)  # type: ignore[arg-type]
    return [SampleSpec(seq_id=i, params=p) for i in range(batch)]


def tokens(logits: torch.Tensor, specs: list[SampleSpec], gens: list | None = None) -> list[int]:
    gens = gens if gens is not None else [None] * len(specs)
    return [t.token_id for t in sample(logits, specs, gens)]


def test_greedy_is_argmax() -> None:
    logits = logits_for(8)
    out = sample(logits, specs_for(8, temperature=0), [None] * 8)
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    assert [t.seq_id for t in out] == list(range(8))
    assert all(t.logprob is None and t.top_logprobs == () for t in out)


def test_greedy_with_native_kernels_is_torchs_argmax() -> None:
    """The native argmax (the runner's on the CPU): first maximum, NaN wins, as torch's."""
    kernels = native.load()
    assert kernels is not None
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(2))
    logits[1, 7] = logits[1, 9000] = logits[1].max() + 1  # a tie: the first one
    logits[2, 300] = float("nan")
    logits[3, 11] = float("inf")
    logits[4] = float("-inf")
    for specs in (specs_for(6, temperature=0), specs_for(6, temperature=0, logprobs=0)):
        got = [t.token_id for t in sample(logits, specs, [None] * 6, kernels)]
        assert got == logits.argmax(-1).tolist() == [got[0], 7, 300, 11, 0, got[5]]


def test_seeded_generators_reproduce_and_different_seeds_differ() -> None:
    logits = logits_for(1).repeat(32, 1) / 3  # a flat-ish distribution

    def run(seed: int) -> list[int]:
        store = GeneratorStore()
        specs = specs_for(1, seed=seed)
        return [tokens(logits[:1], specs, [store.get(0, seed)])[0] for _ in range(32)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_generator_store_keeps_and_releases() -> None:
    store = GeneratorStore()
    assert store.get(1, None) is None
    g = store.get(1, 5)
    assert store.get(1, 5) is g and len(store) == 1
    store.release(1)
    store.release(1)
    assert len(store) == 0 and store.get(1, 5) is not g


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (VOCAB - 3)]))
    torch.manual_seed(0)
    draws = tokens(logits.repeat(3000, 1), specs_for(3000))
    freq = [draws.count(t) / 3000 for t in range(3)]
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.04)


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = logits_for(16, seed=3)
    argmax = logits.argmax(-1).tolist()
    assert tokens(logits, specs_for(16, top_k=1, temperature=1.5)) == argmax
    assert tokens(logits, specs_for(16, top_p=1e-6, temperature=1.5)) == argmax


def test_top_k_only_draws_from_the_k_best() -> None:
    logits = logits_for(1, seed=4).repeat(500, 1)
    best = set(logits[0].topk(3).indices.tolist())
    assert set(tokens(logits, specs_for(500, top_k=3, temperature=5.0))) <= best


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4)])
    logits = torch.log(probs.clamp(min=1e-12)).repeat(800, 1)
    drawn = set(tokens(logits, specs_for(800, top_p=0.75)))
    assert drawn == {0, 1}  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75


def test_min_p_drops_unlikely_tokens() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4)])
    logits = torch.log(probs.clamp(min=1e-12)).repeat(800, 1)
    drawn = set(tokens(logits, specs_for(800, min_p=0.5)))  # threshold 0.25
    assert drawn == {0, 1}


def test_penalties_change_exactly_the_expected_logits() -> None:
    logits = logits_for(1, seed=5)
    prompt, output = (1, 2, 3), (3, 4, 4)
    # capture the processed logits through the logprobs of a greedy sample
    params = SamplingParams(
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=2.0,
        logprobs=VOCAB,
    )
    spec = SampleSpec(0, params, prompt, output)
    out = sample(logits, [spec], [None])[0]
    got = torch.full((VOCAB,), float("nan"))
    for t in out.top_logprobs:
        got[t.token_id] = t.logprob
    expected = logits[0].clone()
    for token in {1, 2, 3, 4}:  # repetition: prompt + output
        x = expected[token]
        expected[token] = x / 2.0 if x > 0 else x * 2.0
    expected[3] -= 0.25 * 1 + 0.5
    expected[4] -= 0.25 * 2 + 0.5
    assert torch.allclose(got, torch.log_softmax(expected, -1), atol=1e-5)
    assert out.token_id == int(expected.argmax())


def test_logit_bias_forces_a_token() -> None:
    logits = logits_for(4, seed=6)
    for temperature in (0.0, 1.0):
        specs = specs_for(4, temperature=temperature, logit_bias={7: 100.0})
        assert tokens(logits, specs) == [7] * 4


def test_logprobs_are_log_softmax_and_top_logprobs_sorted() -> None:
    logits = logits_for(4, seed=7)
    specs = specs_for(4, logprobs=5, temperature=0.8)
    out = sample(logits, specs, [None] * 4)
    expected = torch.log_softmax(logits, -1)
    for row, token in enumerate(out):
        assert token.logprob == pytest.approx(float(expected[row, token.token_id]), abs=1e-5)
        values = [t.logprob for t in token.top_logprobs]
        assert values == sorted(values, reverse=True) and len(values) == 5
        top = expected[row].topk(5)
        assert [t.token_id for t in token.top_logprobs] == top.indices.tolist()
        assert values == pytest.approx(top.values.tolist(), abs=1e-5)


def test_logprobs_zero_gives_only_the_chosen_token() -> None:
    logits = logits_for(2, seed=8)
    out = sample(logits, specs_for(2, logprobs=0, temperature=0), [None, None])
    assert [t.top_logprobs for t in out] == [(), ()]
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-5)


def test_mixed_batch_rows_are_independent() -> None:
    logits = logits_for(3, seed=9)
    specs = [
        SampleSpec(0, SamplingParams(temperature=0)),
        SampleSpec(1, SamplingParams(logit_bias={5: 50.0})),
        SampleSpec(2, SamplingParams(top_k=1, logprobs=1)),
    ]
    out = sample(logits, specs, [None, torch.Generator().manual_seed(1), None])
    assert out[0].token_id == int(logits[0].argmax())
    assert out[1].token_id == 5
    assert out[2].token_id == int(logits[2].argmax()) and out[2].logprob is not None
    assert out[0].logprob is None


def test_bad_shapes_raise_value_error() -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(2, VOCAB), specs_for(1), [None])
    with pytest.raises(ValueError):
        sample(torch.zeros(1, VOCAB), specs_for(1), [])


def test_sampling_keeps_its_tensors_on_the_logits_device() -> None:
    """The CUDA path, checked without a GPU: on the ``meta`` device an op given a CPU tensor
    raises, so penalties, bias, top-k/top-p/min-p and the draw, everything before the one
    read of the chosen ids, run on the device of the logits."""
    params = SamplingParams(
        temperature=0.8,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        logit_bias={3: 2.0},
    )
    specs = [SampleSpec(i, params, (1, 2, 3), (4, 4)) for i in range(3)]
    processed = _process(torch.empty(3, VOCAB, device="meta"), specs)
    drawn = _draw(processed, specs, [None] * 3, [0, 1, 2])
    assert processed.device.type == drawn.device.type == "meta"
    assert drawn.shape == (3,)


class _OnlyTokens:
    """A constraint that allows exactly ``tokens``."""

    def __init__(self, *tokens: int) -> None:
        self.tokens = tokens

    def allowed(self, seq_id: int, output_token_ids: object) -> torch.Tensor:
        words = torch.zeros((VOCAB + 31) // 32, dtype=torch.int64)
        for t in self.tokens:
            words[t // 32] |= 1 << (t % 32)
        return words.to(torch.int32)


def test_logprobs_under_a_grammar_are_the_masked_distribution_without_masked_tokens() -> None:
    logits = logits_for(1, seed=10)
    spec = SampleSpec(seq_id=0, params=SamplingParams(logprobs=5, constraint=_OnlyTokens(3, 17)))
    (token,) = sample(logits, [spec], [None])
    masked = torch.full((VOCAB,), float("-inf"))
    masked[[3, 17]] = logits[0, [3, 17]]
    expected = torch.log_softmax(masked, -1)
    assert token.token_id in (3, 17)
    assert token.logprob == pytest.approx(float(expected[token.token_id]), abs=1e-5)
    assert sorted(t.token_id for t in token.top_logprobs) == [3, 17]
    assert all(
        t.logprob == pytest.approx(float(expected[t.token_id]), abs=1e-5)
        for t in token.top_logprobs
    )
