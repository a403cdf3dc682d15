"""Per-request generation parameters: plain data shared by the HTTP layer, engine and sampler."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol


class TokenConstraint(Protocol):
    """Which tokens a sequence may sample next (grammar-constrained decoding).

    ``allowed(seq_id, output_token_ids)`` returns a bitmask (int32 words, bit ``t % 32`` of
    word ``t // 32`` set when token ``t`` is allowed) or ``None`` for "no restriction". It is
    called only on the runner's thread, once per sampled position, with every token the
    sequence has produced so far, so the constraint advances its own state from those. With
    speculative decoding a sampled position may follow drafts that the next call's tokens
    no longer hold: the constraint goes back to where they part.

    ``valid_drafts(seq_id, output_token_ids, drafts)``: how many of ``drafts`` the
    constraint allows in a row after ``output_token_ids`` (on the runner's thread, before
    the drafts' positions are sampled).
    """

    def allowed(self, seq_id: int, output_token_ids: Sequence[int]) -> Any: ...

    def valid_drafts(
        self, seq_id: int, output_token_ids: Sequence[int], drafts: Sequence[int]
    ) -> int: ...


def _empty_bias() -> Mapping[int, float]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy. ``top_k is None`` and ``top_p == 1`` and
    ``min_p == 0`` disable those filters. ``logprobs is None`` means no logprobs; ``0`` means
    the chosen token's logprob only; ``k > 0`` adds the ``k`` most likely alternatives.
    ``n`` samples share one prefill of the prompt. ``seed`` gives the request its own
    generator, so the same request with the same seed yields the same tokens.
    ``prompt_logprobs`` (as ``logprobs``) scores every prompt token after the first: the
    prompt is then computed whole, without the prefix cache.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=_empty_bias)
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    constraint: TokenConstraint | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("top_k must be >= 1")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.n < 1:
            raise ValueError("n must be at least 1")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
