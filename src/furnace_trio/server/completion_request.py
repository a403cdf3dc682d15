"""``/v1/completions`` bodies validated into :class:`CompletionRequest`: one prompt or a
batch of them (text or token ids, OpenAI's four forms), the sampling fields, ``echo`` and
``logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass

from furnace_trio.server.errors import invalid_request
from furnace_trio.server.protocol import (
    MISSING,
    FieldBody,
    check_sequences,
    parse_json_body,
    parse_stream,
    parse_token_ids,
    too_long,
)
from furnace_trio.server.sampling_options import SamplingOptions, parse_sampling
from furnace_trio.server.schemas import COMPLETION_FIELDS, MAX_PROMPTS


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated ``/v1/completions`` body: ``prompts`` holds one or more prompts (up to
    ``MAX_PROMPTS``), each text or token ids, never an empty list of ids."""

    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False


def parse_completion_request(
    body: bytes,
    *,
    vocab_size: int,
    max_prompt_chars: int | None = None,
    max_sequences: int | None = None,
) -> CompletionRequest:
    """Validate a (legacy) completions body; raise a 400 :class:`APIError` naming the field.

    ``max_sequences`` bounds prompts x ``n`` (``FURNACE_MAX_SEQUENCES_PER_REQUEST``).
    """
    data = FieldBody(parse_json_body(body), COMPLETION_FIELDS)
    prompts = _prompts(data.raw("prompt"), vocab_size)
    check_sequences(data.get("n"), len(prompts), max_sequences)
    for prompt in prompts:
        if (
            isinstance(prompt, str)
            and max_prompt_chars is not None
            and len(prompt) > max_prompt_chars
        ):
            raise too_long("prompt", len(prompt), max_prompt_chars)
    logprobs = data.get("logprobs")
    echo = data.get("echo")
    if data.get("max_tokens") == 0 and not echo:
        raise invalid_request(
            "max_tokens 0 generates nothing: it is for echo, which returns the prompt alone",
            "max_tokens",
        )
    best_of = data.get("best_of")
    if best_of is not None and best_of != data.get("n"):
        raise invalid_request("best_of is not supported (it must equal n)", "best_of")
    if data.raw("suffix") not in (None, ""):
        raise invalid_request("suffix is not supported", "suffix")
    stream, include_usage = parse_stream(data)
    return CompletionRequest(
        model=data.get("model") or None,
        prompts=prompts,
        sampling=parse_sampling(
            data,
            max_tokens=data.get("max_tokens"),
            logprobs=logprobs,
            vocab_size=vocab_size,
        ),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        echo=echo,
    )


def _prompts(value: object, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    """The prompts of a completions body: a string, a list of strings, token ids, or a list
    of lists of token ids (OpenAI's four forms)."""
    if value is MISSING or value is None:
        raise invalid_request("prompt is required", "prompt")
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise invalid_request(
            "prompt must be a string, a list of strings, a non-empty list of token ids, or "
            "a list of such lists",
            "prompt",
        )
    strings = all(isinstance(item, str) for item in value)
    lists = not strings and all(isinstance(item, list) for item in value)
    if not (strings or lists):
        return (parse_token_ids(value, vocab_size, "prompt"),)
    if len(value) > MAX_PROMPTS:
        raise invalid_request(
            f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS} per request", "prompt"
        )
    if strings:
        return tuple(value)
    return tuple(parse_token_ids(item, vocab_size, f"prompt[{i}]") for i, item in enumerate(value))
