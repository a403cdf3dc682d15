"""I/O-free request validation: every bad input is a 400 naming its parameter."""

from __future__ import annotations

import json
from typing import Any

import pytest

from furnace_trio.server.chat_request import parse_chat_request
from furnace_trio.server.completion_request import parse_completion_request
from furnace_trio.server.config import ConfigError, ServerConfig
from furnace_trio.server.errors import APIError
from furnace_trio.server.protocol import json_values_bound, parse_json_body, resolve_max_tokens
from furnace_trio.server.schemas import MAX_JSON_VALUES, MAX_PROMPTS

VOCAB = 1000
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode()


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def chat_error(body: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat_request(body, vocab_size=VOCAB)
    assert info.value.status == 400
    assert info.value.error_type == "invalid_request_error"
    return info.value


def completion_error(body: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_completion_request(body, vocab_size=VOCAB)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"\xff\xfe", b"[1, 2]", b'"text"', b"null", b"[" * 100_000],
)
def test_malformed_bodies_are_400_without_param(body: bytes) -> None:
    assert chat_error(body).param is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": None}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [1]}, "messages[0]"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        ({"model": 3}, "model"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"temperature": False}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"n": 100}, "n"),
        ({"n": True}, "n"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": []}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": True}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": 1}, "stream_options"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"tools": {"a": 1}}, "tools"),
    ],
)
def test_chat_bad_fields_name_their_param(fields: dict[str, Any], param: str) -> None:
    assert chat_error(chat(**fields)).param == param


def test_chat_full_request_parses() -> None:
    parsed = parse_chat_request(
        chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None, "tool_calls": []},
            ],
            max_tokens=5,
            max_completion_tokens=7,
            temperature=0,
            top_p=0.5,
            top_k=-1,
            min_p=0.1,
            presence_penalty=1,
            frequency_penalty=-1,
            repetition_penalty=1.1,
            logit_bias={"3": -100, "4": 50.5},
            seed=42,
            n=2,
            stop="x",
            logprobs=True,
            top_logprobs=3,
            ignore_eos=True,
            stream=True,
            stream_options={"include_usage": True},
            unknown_field={"ignored": True},
        ),
        vocab_size=VOCAB,
    )
    assert parsed.messages[0]["role"] == "system"
    assert parsed.messages[1]["content"] == "ab"
    assert parsed.messages[2]["content"] is None
    assert parsed.stream and parsed.include_usage
    assert parsed.logprobs and parsed.top_logprobs == 3
    params = parsed.sampling.to_params(7)
    assert parsed.sampling.max_tokens == 7  # max_completion_tokens wins
    assert params.temperature == 0 and params.top_p == 0.5 and params.top_k is None
    assert params.logit_bias == {3: -100.0, 4: 50.5}
    assert params.stop == ("x",) and params.n == 2 and params.seed == 42
    assert params.logprobs == 3 and params.ignore_eos


def test_chat_logprobs_without_top_is_zero_alternatives() -> None:
    parsed = parse_chat_request(chat(logprobs=True), vocab_size=VOCAB)
    assert parsed.sampling.logprobs == 0
    assert parse_chat_request(chat(), vocab_size=VOCAB).sampling.logprobs is None


def test_include_usage_needs_stream() -> None:
    parsed = parse_chat_request(chat(stream_options={"include_usage": True}), vocab_size=VOCAB)
    assert not parsed.include_usage


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ("hello",)),
        (["hello"], ("hello",)),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[4, 5]], ((4, 5),)),
        (["a", "", "c"], ("a", "", "c")),
        ([[4, 5], [6]], ((4, 5), (6,))),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: Any) -> None:
    parsed = parse_completion_request(completion(prompt=prompt), vocab_size=VOCAB)
    assert parsed.prompts == expected


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([[4], []], "prompt[1] must be a non-empty list of token ids"),
        ([[4], [5, "x"]], "prompt[1]: token ids must be integers, not a string"),
        ([[4], [VOCAB]], f"prompt[1]: token id {VOCAB} is outside the vocabulary"),
        (["a", 1], "prompt: token ids must be integers, not a string"),
        ([[1], "a"], "prompt: token ids must be integers, not an array"),
        (["a"] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS} per request"),
        ([[1]] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS} per request"),
    ],
)
def test_a_bad_batch_of_prompts_names_the_prompt(prompt: Any, message: str) -> None:
    error = completion_error(completion(prompt=prompt))
    assert error.param == "prompt" and message in error.message


def test_every_prompt_of_a_batch_is_held_to_the_character_limit() -> None:
    body = completion(prompt=["short", "x" * 101])
    with pytest.raises(APIError) as info:
        parse_completion_request(body, vocab_size=VOCAB, max_prompt_chars=100)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    parsed = parse_completion_request(body, vocab_size=VOCAB, max_prompt_chars=101)
    assert parsed.prompts == ("short", "x" * 101)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": None}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [1, VOCAB]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_completion_bad_fields_name_their_param(fields: dict[str, Any], param: str) -> None:
    assert completion_error(completion(**fields)).param == param


def test_resolve_max_tokens() -> None:
    assert resolve_max_tokens(None, prompt_tokens=10, max_context=100, default=None) == 90
    assert resolve_max_tokens(None, prompt_tokens=10, max_context=100, default=16) == 16
    assert resolve_max_tokens(None, prompt_tokens=90, max_context=100, default=16) == 10
    assert resolve_max_tokens(90, prompt_tokens=10, max_context=100, default=16) == 90
    with pytest.raises(APIError) as info:
        resolve_max_tokens(5, prompt_tokens=100, max_context=100, default=None)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert info.value.param == "messages"


def test_max_tokens_beyond_the_context_is_400_naming_it() -> None:
    with pytest.raises(APIError) as info:
        resolve_max_tokens(
            91,
            prompt_tokens=10,
            max_context=100,
            default=None,
            max_tokens_param="max_completion_tokens",
        )
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert info.value.param == "max_completion_tokens"
    assert "at most 90" in info.value.message


def test_server_config_from_env() -> None:
    config = ServerConfig.from_env(
        {
            "FURNACE_MODEL": "/models/x.gguf",
            "FURNACE_DEVICE": "CPU",
            "FURNACE_MAX_RUNNING": "4",
            "FURNACE_MAX_BODY_BYTES": "1024",
            "FURNACE_API_KEY": "secret",
            "FURNACE_LOG_LEVEL": "debug",
            "FURNACE_KV_CACHE_MB": "",
            "FURNACE_QUANT": "q4",
            "FURNACE_STREAM_INTERVAL": "4",
            "FURNACE_KV_CACHE_DTYPE": "INT8",
            "FURNACE_MAX_SEQUENCES_PER_REQUEST": "32",
            "FURNACE_MAX_SCHEMA_NODES": "500",
            "FURNACE_TARGET_ITL_MS": "42.5",
        }
    )
    assert config.target_itl_ms == 42.5
    assert config.max_sequences_per_request == 32 and config.max_schema_nodes == 500
    assert config.quantization == "q4" and config.kv_cache_dtype == "int8"
    assert config.stream_interval == 4
    assert config.model == "/models/x.gguf" and config.device == "cpu"
    assert config.max_running == 4 and config.max_body_bytes == 1024
    assert config.api_key == "secret" and config.log_level == "DEBUG"
    assert config.kv_cache_mb is None and config.max_waiting == 256
    assert ServerConfig.from_env({}) == ServerConfig()
    assert ServerConfig().target_itl_ms is None  # no pacing unless asked for
    assert ServerConfig.from_env({"FURNACE_TARGET_ITL_MS": "0"}).target_itl_ms is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FURNACE_DEVICE", "tpu"),
        ("FURNACE_MAX_RUNNING", "many"),
        ("FURNACE_MAX_WAITING", "0"),
        ("FURNACE_MAX_BODY_BYTES", "-5"),
        ("FURNACE_DTYPE", "int3"),
        ("FURNACE_LOG_LEVEL", "loud"),
        ("FURNACE_MAX_CONTEXT", "1.5"),
        ("FURNACE_QUANT", "int4"),
        ("FURNACE_STREAM_INTERVAL", "0"),
        ("FURNACE_KV_CACHE_DTYPE", "fp8"),
        ("FURNACE_NATIVE", "perhaps"),
        ("FURNACE_NATIVE_FLAGS", "-DX='unclosed"),
        ("FURNACE_MAX_SEQUENCES_PER_REQUEST", "0"),
        ("FURNACE_MAX_SCHEMA_NODES", "lots"),
        ("FURNACE_TARGET_ITL_MS", "-3"),
        ("FURNACE_TARGET_ITL_MS", "fast"),
        ("FURNACE_TARGET_ITL_MS", "inf"),
    ],
)
def test_server_config_rejects_invalid_values(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        ServerConfig.from_env({name: value})


def test_a_request_never_asks_for_more_sequences_than_the_queue_holds() -> None:
    assert ServerConfig().sequences_per_request == 128
    assert ServerConfig(max_waiting=20).sequences_per_request == 20


def test_json_values_bound_is_an_upper_bound() -> None:
    for value in [{}, [], [1, 2, 3], {"a": [1, {"b": None}], "c": "x"}, [[[]]], "s", 7]:
        text = json.dumps(value).encode()
        decoded = json.loads(text)
        pending, count = [decoded], 0
        while pending:
            item = pending.pop()
            count += 1
            if isinstance(item, dict):
                count += len(item)  # keys
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
        assert json_values_bound(text) >= count, value


def test_a_body_past_the_value_budget_is_refused_before_decoding() -> None:
    body = b"[" + b"0," * MAX_JSON_VALUES + b"0]"
    with pytest.raises(APIError) as info:
        parse_json_body(body)
    assert info.value.status == 400 and str(MAX_JSON_VALUES) in info.value.message
    assert parse_json_body(b'{"x": [' + b"0," * (MAX_JSON_VALUES - 100) + b"0]}")
