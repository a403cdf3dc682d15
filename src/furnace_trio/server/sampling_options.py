"""The sampling fields both generation endpoints share, validated into
:class:`SamplingOptions`: temperature and the other samplers' knobs, penalties,
``logit_bias``, ``seed``, ``n``, ``stop`` and ``ignore_eos``.

The samplers' knobs that a model may recommend (temperature, top-p, top-k, min-p, the
repetition penalty) stay ``None`` when the request leaves them unset, so that
:meth:`SamplingOptions.to_params` can fill them from the model's
:class:`~furnace_trio.loading.generation_defaults.GenerationDefaults`, then from OpenAI's
defaults.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from furnace_trio.core.params import SamplingParams
from furnace_trio.loading.generation_defaults import NO_GENERATION_DEFAULTS, GenerationDefaults
from furnace_trio.server.errors import invalid_request
from furnace_trio.server.protocol import FieldBody, kind_of
from furnace_trio.server.schemas import MAX_LOGIT_BIAS, MAX_STOP_LENGTH, MAX_STOP_SEQUENCES

_TOKEN_ID_KEY = re.compile(r"^[0-9]{1,10}$")


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Sampling fields common to both endpoints; ``max_tokens`` is resolved later.

    ``max_tokens is None`` means the client gave none: the handler picks a default once
    the prompt length is known (see :func:`~furnace_trio.server.protocol.resolve_max_tokens`).
    ``None`` in ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty``
    means the client gave none; ``top_k`` 0 means the client turned top-k off.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    #: The field ``max_tokens`` came from, named by a ``context_length_exceeded`` error.
    max_tokens_param: str = "max_tokens"

    def to_params(
        self, max_tokens: int, defaults: GenerationDefaults = NO_GENERATION_DEFAULTS
    ) -> SamplingParams:
        """The engine's parameters with ``max_tokens`` resolved; each sampler knob the
        request left unset comes from ``defaults`` (the model's), else OpenAI's default."""

        def pick(mine: float | None, model: float | None, openai: float) -> float:
            return mine if mine is not None else model if model is not None else openai

        top_k = self.top_k if self.top_k is not None else defaults.top_k
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(self.temperature, defaults.temperature, 1.0),
            top_p=pick(self.top_p, defaults.top_p, 1.0),
            top_k=top_k or None,
            min_p=pick(self.min_p, defaults.min_p, 0.0),
            repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty, 1.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            seed=self.seed,
            logprobs=self.logprobs,
            n=self.n,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
        )


def parse_sampling(
    data: FieldBody, *, max_tokens: int | None, logprobs: int | None, vocab_size: int
) -> SamplingOptions:
    top_k = data.get("top_k")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=data.get("temperature"),
        top_p=data.get("top_p"),
        top_k=None if top_k is None else max(top_k, 0),
        min_p=data.get("min_p"),
        presence_penalty=data.get("presence_penalty"),
        frequency_penalty=data.get("frequency_penalty"),
        repetition_penalty=data.get("repetition_penalty"),
        logit_bias=_logit_bias(data.raw("logit_bias"), vocab_size),
        seed=data.get("seed"),
        logprobs=logprobs,
        n=data.get("n"),
        stop=_stop(data.raw("stop")),
        ignore_eos=data.get("ignore_eos"),
    )


def _logit_bias(value: object, vocab_size: int) -> Mapping[int, float]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, dict):
        raise invalid_request(f"logit_bias must be an object, not {kind_of(value)}", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid_request(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}",
            "logit_bias",
        )
    bias: dict[int, float] = {}
    for key, amount in value.items():
        if not _TOKEN_ID_KEY.match(key):
            raise invalid_request(
                f"logit_bias keys must be token ids as strings, got {key[:32]!r}", "logit_bias"
            )
        token_id = int(key)
        if not 0 <= token_id < vocab_size:
            raise invalid_request(
                f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1})",
                "logit_bias",
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise invalid_request(
                f"logit_bias values must be numbers, not {kind_of(amount)}", "logit_bias"
            )
        if not -100 <= amount <= 100:
            raise invalid_request(
                f"logit_bias values must be between -100 and 100, got {amount}", "logit_bias"
            )
        bias[token_id] = float(amount)
    return MappingProxyType(bias)


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise invalid_request(
            f"stop must be a string or a list of strings, not {kind_of(value)}", "stop"
        )
    if len(value) > MAX_STOP_SEQUENCES:
        raise invalid_request(f"stop may hold at most {MAX_STOP_SEQUENCES} sequences", "stop")
    stops: list[str] = []
    for item in value:
        if not isinstance(item, str):
            raise invalid_request(f"stop sequences must be strings, not {kind_of(item)}", "stop")
        if len(item) > MAX_STOP_LENGTH:
            raise invalid_request(
                f"stop sequences may have at most {MAX_STOP_LENGTH} characters, got {len(item)}",
                "stop",
            )
        if item and item not in stops:
            stops.append(item)
    return tuple(stops)
