"""Constrained decoding: llguidance masks on the SmolLM2 vocabulary, the sampler applying
them, and the default model producing schema-valid JSON and valid calls over HTTP."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import openai
import pytest
import torch

from furnace_trio.core.params import SamplingParams
from furnace_trio.core.plan import SampleSpec
from furnace_trio.runtime.sampling import sample
from furnace_trio.tools.grammar import GrammarCompiler, GrammarError

from ..http_server import smollm2_tokenizer
from ..real_model import NAME, serve_real

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}


def _allowed(words: Any, token: int) -> bool:
    return bool((int(words[token // 32]) >> (token % 32)) & 1)


def test_mask_follows_the_schema_per_sequence() -> None:
    tokenizer = smollm2_tokenizer()
    constraint = GrammarCompiler(tokenizer).json_schema(PERSON)
    text = '{"name":"Ann","age":7}'
    tokens = tokenizer.encode(text, add_special_tokens=False)
    for k, token in enumerate(tokens):
        assert _allowed(constraint.allowed(1, tokens[:k]), token)
    final = constraint.allowed(1, tokens)
    assert [t for t in tokenizer.eos_token_ids if _allowed(final, t)]
    assert not _allowed(final, tokens[0])
    # another sequence of the same request starts from the beginning
    first = constraint.allowed(2, [])
    assert _allowed(first, tokens[0])
    assert not _allowed(first, tokenizer.encode("hello", add_special_tokens=False)[0])


def test_drafts_are_checked_and_rolled_back() -> None:
    """Speculative decoding: ``valid_drafts`` counts the drafts the grammar takes in a
    row; masks asked after drafts that the next output does not keep are those of a
    constraint that never saw them."""
    tokenizer = smollm2_tokenizer()
    compiler = GrammarCompiler(tokenizer)
    constraint = compiler.json_schema(PERSON)
    good = tokenizer.encode('{"name":"Ann","age":7}', add_special_tokens=False)
    bad = tokenizer.encode('{"name":"Ann","height":7}', add_special_tokens=False)
    at = next(i for i, (g, b) in enumerate(zip(good, bad, strict=False)) if g != b)
    assert constraint.valid_drafts(1, good[:2], good[2:]) == len(good) - 2
    assert constraint.valid_drafts(1, good[:2], bad[2:]) == at - 2
    # the masks of draft positions, as the sampler asks for them: the drafts consumed
    for k in range(2, len(good)):
        constraint.allowed(1, good[:k])
    # the output kept the first three tokens and then parted: rolled back to there
    for tokens in (good[:3], bad[:at], good[:5], bad[: at + 1]):
        fresh = compiler.json_schema(PERSON)
        mine, theirs = constraint.allowed(1, tokens), fresh.allowed(7, tokens)
        if theirs is None:
            assert mine is None
        else:
            assert mine is not None and (mine == theirs).all()


def test_sampler_applies_the_mask() -> None:
    tokenizer = smollm2_tokenizer()
    constraint = GrammarCompiler(tokenizer).json_schema(None)
    vocab = tokenizer.vocab_size
    logits = torch.zeros(2, vocab)
    hello = tokenizer.encode("hello", add_special_tokens=False)[0]
    logits[:, hello] = 100.0  # what the "model" prefers
    specs = [
        SampleSpec(0, SamplingParams(temperature=0, constraint=constraint)),
        SampleSpec(1, SamplingParams(temperature=0)),
    ]
    out = sample(logits, specs, [None, None])
    assert out[1].token_id == hello
    assert out[0].token_id != hello
    assert _allowed(constraint.allowed(5, []), out[0].token_id)


def test_bad_schema_is_a_grammar_error() -> None:
    compiler = GrammarCompiler(smollm2_tokenizer())
    with pytest.raises(GrammarError):
        compiler.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})


async def test_default_model_json_schema_and_forced_call() -> None:
    async with (
        serve_real() as (url, _),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client,
    ):
        response_format: Any = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        }
        messages: Any = [{"role": "user", "content": "Describe a person as JSON."}]
        answer = await client.chat.completions.create(
            model=NAME,
            messages=messages,
            response_format=response_format,
            temperature=0,
            max_tokens=60,
        )
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), PERSON)

        stream = await client.chat.completions.create(
            model=NAME,
            messages=messages,
            response_format=response_format,
            temperature=0,
            max_tokens=60,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == answer.choices[0].message.content

        for stream_it in (False, True):
            call_request: Any = {
                "model": NAME,
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "temperature": 0,
                "max_tokens": 60,
            }
            if not stream_it:
                called = await client.chat.completions.create(**call_request)
                choice = called.choices[0]
                assert choice.finish_reason == "tool_calls"
                calls = choice.message.tool_calls or []
                name, arguments = calls[0].function.name, calls[0].function.arguments
            else:
                chunks = [
                    c
                    async for c in await client.chat.completions.create(**call_request, stream=True)
                ]
                entries = [
                    e for c in chunks if c.choices for e in (c.choices[0].delta.tool_calls or [])
                ]
                name = entries[0].function.name if entries[0].function else None
                arguments = "".join((e.function and e.function.arguments) or "" for e in entries)
                assert chunks[-1].choices[0].finish_reason == "tool_calls"
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_a_repeated_forced_call_can_only_end() -> None:
    """After a complete call the output may end (a newline after it too); when the call
    repeats an earlier one, the end is all that is allowed."""
    tokenizer = smollm2_tokenizer()
    constraint = GrammarCompiler(tokenizer).tool_calls(
        {"get_weather": WEATHER["function"]["parameters"]}, parallel=True
    )
    eos = sorted(tokenizer.eos_token_ids)

    def call(city: str) -> str:
        return (
            f'<tool_call>\n{{"name":"get_weather","arguments":{{"city":"{city}"}}}}\n</tool_call>'
        )

    seq_ids = itertools.count()

    def mask_after(text: str) -> Any:  # each text as its own sequence
        return constraint.allowed(next(seq_ids), tokenizer.encode(text, add_special_tokens=False))

    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    first = mask_after(call("Paris"))
    assert any(_allowed(first, t) for t in eos) and _allowed(first, newline)
    assert any(_allowed(mask_after(call("Paris") + "\n"), t) for t in eos)
    other = mask_after(call("Paris") + "\n" + call("Rome"))
    assert _allowed(other, newline)
    repeated = mask_after(call("Paris") + "\n" + call("Rome") + "\n" + call("Paris"))
    allowed = [t for t in range(tokenizer.vocab_size) if _allowed(repeated, t)]
    assert allowed and set(allowed) <= set(eos)


@pytest.mark.parametrize(
    ("schema", "text"),
    [
        (PERSON, '{"name":"Ann","age":' + "1" * 30),
        (None, '{"population":' + "1" * 30),
        (None, '{"ratio":0.' + "1" * 30),
        ({"type": "object", "properties": {"x": {"type": "number"}}}, '{"x":1' + "0" * 30),
        (None, '{"a": 1}'),  # compact: no whitespace run to grow
    ],
)
def test_schema_grammars_bound_numbers_and_whitespace(schema: Any, text: str) -> None:
    """Numbers the schema leaves unbounded (integers to 64 bits, numbers to 10^15 and six
    decimals), and whitespace, cannot run on: the grammar rejects the text (and lifts)."""
    tokenizer = smollm2_tokenizer()
    constraint = GrammarCompiler(tokenizer).json_schema(schema)
    assert constraint.allowed(1, tokenizer.encode(text, add_special_tokens=False)) is None


def test_bounded_numbers_still_take_what_the_schema_allows() -> None:
    tokenizer = smollm2_tokenizer()
    schema = {
        "type": "object",
        "properties": {"big": {"type": "integer"}, "x": {"type": "number", "maximum": 1e17}},
    }
    constraint = GrammarCompiler(tokenizer).json_schema(schema)
    text = '{"big":-9223372036854774784,"x":99999999999999999.5}'
    tokens = tokenizer.encode(text, add_special_tokens=False)
    final = constraint.allowed(1, tokens)
    assert final is not None and [t for t in tokenizer.eos_token_ids if _allowed(final, t)]


def test_forced_call_arguments_are_bounded() -> None:
    tokenizer = smollm2_tokenizer()
    tool = {"type": "object", "properties": {"n": {"type": "integer"}}}
    constraint = GrammarCompiler(tokenizer).tool_calls({"count": tool}, parallel=False)
    text = '<tool_call>\n{"name":"count","arguments":{"n":' + "9" * 30
    assert constraint.allowed(1, tokenizer.encode(text, add_special_tokens=False)) is None
