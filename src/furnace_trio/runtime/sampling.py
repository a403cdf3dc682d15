"""Batched sampling on next-token logits: one row per :class:`~furnace_trio.core.plan.SampleSpec`.

The pipeline, every stage batched over the rows that need it (no Python loop over the
vocabulary)::

    logits (float32) -> repetition penalty (HF: prompt + output tokens)
                     -> frequency / presence penalties (OpenAI: output tokens)
                     -> logit_bias
                     =: processed   -- logprobs are log_softmax(processed)
                     -> greedy rows: argmax
                     -> other rows: / temperature -> top_k -> top_p -> min_p
                                    -> draw with the row's generator

Logprobs describe the model's distribution after the request's penalties, bias and
grammar mask but before temperature and the top-k/top-p/min-p filters, as OpenAI reports
them: they do not depend on how the token was drawn, and with plain parameters they are
exactly ``log_softmax(logits)``. Under a grammar that is the masked distribution, so the
top alternatives are tokens the grammar allows (fewer than asked where it allows fewer);
a masked token's ``-inf`` is never reported (it is not a JSON number).

Drawing uses the exponential race (``argmax(p / q)`` with ``q ~ Exp(1)``), which is an exact
sample of ``p`` and needs no cumulative sums or host syncs. Rows with a generator (a seeded
request) draw their noise from it, so the same seed yields the same tokens; rows without
one share the device's default generator in one batched draw.

When the whole batch is greedy with no penalties, bias or logprobs, sampling is one argmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from furnace_trio.core.plan import SampledToken, SampleSpec, TokenLogprob
from furnace_trio.runtime import native

__all__ = ["GeneratorStore", "sample"]


class GeneratorStore:
    """One ``torch.Generator`` per seeded sequence, kept until the sequence is released.

    Unseeded sequences get ``None``: they share the device's default generator, which lets
    :func:`sample` draw all of them in one batched call. Used on the runner's thread only.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._generators: dict[int, torch.Generator] = {}

    def get(self, seq_id: int, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self._generators.get(seq_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
            self._generators[seq_id] = generator
        return generator

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._generators)


def _argmax(logits: torch.Tensor, kernels: native.Kernels | None) -> torch.Tensor:
    """Per row, the first index of the maximum (NaN counts as the maximum), as torch's."""
    if kernels is not None and logits.device.type == "cpu" and logits.is_contiguous():
        return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    specs: Sequence[SampleSpec],
    generators: Sequence[torch.Generator | None],
    kernels: native.Kernels | None = None,
) -> list[SampledToken]:
    """One token per row of ``logits`` (``[B, vocab]``) for ``specs[row]``. ``kernels``: the
    native CPU kernels, for the argmax (about a third of torch's time on a vocabulary row;
    docs/history.md)."""
    if logits.dim() != 2 or logits.shape[0] != len(specs):
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(specs)} samples")
    if len(generators) != len(specs):
        raise ValueError("one generator (or None) per sample is needed")
    if not specs:
        return []
    logits = logits.float()
    params = [s.params for s in specs]
    plain = all(
        p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and not p.logit_bias
        and p.constraint is None
        for p in params
    )
    if plain and all(p.greedy and p.logprobs is None for p in params):
        tokens = _argmax(logits, kernels).tolist()
        return [SampledToken(s.seq_id, t) for s, t in zip(specs, tokens, strict=True)]

    processed = logits if plain else _process(logits.clone(), specs)
    chosen = _argmax(processed, kernels)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        chosen[random_rows] = _draw(processed[random_rows], specs, generators, random_rows)
    chosen_list = chosen.tolist()

    logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    logprob_of: dict[int, tuple[float, tuple[TokenLogprob, ...]]] = {}
    if logprob_rows:
        scores = token_logprobs(
            processed[logprob_rows],
            chosen[logprob_rows],
            [params[i].logprobs or 0 for i in logprob_rows],
        )
        logprob_of = dict(zip(logprob_rows, scores, strict=True))

    out: list[SampledToken] = []
    for i, spec in enumerate(specs):
        if i in logprob_of:
            value, top = logprob_of[i]
            out.append(SampledToken(spec.seq_id, chosen_list[i], value, top))
        else:
            out.append(SampledToken(spec.seq_id, chosen_list[i]))
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, tops: Sequence[int]
) -> list[tuple[float, tuple[TokenLogprob, ...]]]:
    """For each row of ``logits`` (float32 ``[R, vocab]``): the logprob of ``token_ids[row]``
    under ``log_softmax`` of the row, and up to ``tops[row]`` of the likeliest tokens with
    theirs, leaving out tokens at ``-inf`` (masked by a grammar). Sampled tokens' logprobs,
    and a scored prompt's in the runner."""
    logprobs = torch.log_softmax(logits, dim=-1)
    picked = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    k = min(max(tops, default=0), logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in tops]
    top_ids: list[list[int]] = [[] for _ in tops]
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    out = []
    for j, want in enumerate(tops):
        alternatives = zip(top_ids[j][:want], top_values[j][:want], strict=True)
        top = tuple(TokenLogprob(t, v) for t, v in alternatives if v != -math.inf)
        out.append((picked[j], top))
    return out


def _process(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    """Penalties and bias, in place on a copy of the logits."""
    vocab = logits.shape[1]
    device = logits.device
    params = [s.params for s in specs]

    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        seen = (
            _occurrences(
                [(*specs[i].prompt_token_ids, *specs[i].output_token_ids) for i in rep_rows],
                vocab,
                device,
            )
            > 0
        )
        penalty = torch.tensor(
            [params[i].repetition_penalty for i in rep_rows], device=device
        ).unsqueeze(1)
        rows = logits[rep_rows]
        penalized = torch.where(rows > 0, rows / penalty, rows * penalty)
        logits[rep_rows] = torch.where(seen, penalized, rows)

    pen_rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if pen_rows:
        counts = _occurrences([specs[i].output_token_ids for i in pen_rows], vocab, device)
        freq = torch.tensor([params[i].frequency_penalty for i in pen_rows], device=device)
        pres = torch.tensor([params[i].presence_penalty for i in pen_rows], device=device)
        logits[pen_rows] -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0)

    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_values: list[float] = []
    for i, p in enumerate(params):
        for token, value in p.logit_bias.items():
            if 0 <= token < vocab:
                bias_rows.append(i)
                bias_cols.append(token)
                bias_values.append(value)
    if bias_rows:
        logits.index_put_(
            (torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device)),
            torch.tensor(bias_values, device=device),
            accumulate=True,
        )

    for i, spec in enumerate(specs):
        constraint = spec.params.constraint
        if constraint is None:
            continue
        words = constraint.allowed(spec.seq_id, spec.output_token_ids)
        if words is not None:
            allowed = _unpack_bitmask(torch.as_tensor(words, dtype=torch.int32), vocab)
            logits[i].masked_fill_(~allowed.to(device), float("-inf"))
    return logits


_BITS = torch.arange(32, dtype=torch.int32)


def _unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[vocab]`` bools from int32 words; tokens past the mask's end are disallowed."""
    bits = ((words.reshape(-1, 1) >> _BITS) & 1).reshape(-1).bool()
    if bits.numel() >= vocab:
        return bits[:vocab]
    return torch.cat([bits, torch.zeros(vocab - bits.numel(), dtype=torch.bool)])


def _occurrences(
    token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """``[len(token_lists), vocab]`` float counts of each token id in each list."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width == 0:
        return counts[:, :vocab]
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        if tokens:
            padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long).clamp_(0, vocab)
    padded = padded.to(device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _draw(
    logits: torch.Tensor,
    specs: Sequence[SampleSpec],
    generators: Sequence[torch.Generator | None],
    rows: Sequence[int],
) -> torch.Tensor:
    """Sample one token per row of ``logits`` (the non-greedy rows ``rows`` of the batch)."""
    device = logits.device
    params = [specs[i].params for i in rows]
    vocab = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temperature

    if any(p.top_k is not None and p.top_k < vocab for p in params) or any(
        p.top_p < 1.0 for p in params
    ):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= k.unsqueeze(1)
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # drop a token when the more likely ones already reach top_p; the first always stays
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))

    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))

    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs)
    shared = [j for j, i in enumerate(rows) if generators[i] is None]
    if shared:
        noise[shared] = torch.empty(len(shared), vocab, device=device).exponential_()
    for j, i in enumerate(rows):
        generator = generators[i]
        if generator is not None:
            noise[j].exponential_(generator=generator)
    # exponential_ can return exactly 0; 0/0 would be NaN, which argmax would pick
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)
