"""Hostile input: each is a clear 400 (or 413) naming its parameter, in bounded time, and
the server serves a normal request afterwards. No timing assertions: a request that were
unbounded would hang the test instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from furnace_trio.server.app import create_app
from furnace_trio.server.config import ServerConfig
from furnace_trio.server.schemas import (
    MAX_CHARS_PER_TOKEN,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
)

from ..http_server import MODEL_NAME, Served, serve_app, serve_scripted

USER = {"role": "user", "content": "hi"}
CONTEXT = 1024  # the scripted runner's context


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


CASES: list[tuple[str, str, dict[str, Any] | bytes, str | None, str | None]] = [
    (
        "/v1/chat/completions",
        "many messages",
        {"messages": [USER] * (MAX_MESSAGES + 1)},
        "messages",
        None,
    ),
    (
        "/v1/chat/completions",
        "text beyond any context",
        {"messages": [{"role": "user", "content": "x" * (CONTEXT * MAX_CHARS_PER_TOKEN + 1)}]},
        "messages",
        "context_length_exceeded",
    ),
    (
        "/v1/completions",
        "prompt beyond any context",
        {"prompt": "x" * (CONTEXT * MAX_CHARS_PER_TOKEN + 1)},
        "prompt",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        "deeply nested tool schema",
        {
            "messages": [USER],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(400)}}],
        },
        None,
        None,
    ),
    ("/v1/chat/completions", "deeply nested body", b"[" * 200_000, None, None),
    (
        "/v1/chat/completions",
        "enormous stop list",
        {"messages": [USER], "stop": ["a"] * 10_000},
        "stop",
        None,
    ),
    (
        "/v1/chat/completions",
        "stop list just over the cap",
        {"messages": [USER], "stop": ["a"] * (MAX_STOP_SEQUENCES + 1)},
        "stop",
        None,
    ),
    (
        "/v1/chat/completions",
        "huge stop string",
        {"messages": [USER], "stop": "s" * (MAX_STOP_LENGTH + 1)},
        "stop",
        None,
    ),
    (
        "/v1/chat/completions",
        "logit_bias with thousands of entries",
        {"messages": [USER], "logit_bias": {str(i): 1 for i in range(5000)}},
        "logit_bias",
        None,
    ),
    (
        "/v1/chat/completions",
        "logit_bias just over the cap",
        {"messages": [USER], "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}},
        "logit_bias",
        None,
    ),
    (
        "/v1/chat/completions",
        "max_tokens far beyond the context",
        {"messages": [USER], "max_tokens": 10**9},
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        "max_completion_tokens beyond the context",
        {"messages": [USER], "max_completion_tokens": CONTEXT},
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    (
        "/v1/completions",
        "completion max_tokens beyond the context",
        {"prompt": "hello", "max_tokens": 10**12},
        "max_tokens",
        "context_length_exceeded",
    ),
    ("/v1/chat/completions", "n too large", {"messages": [USER], "n": 10_000}, "n", None),
    (
        "/v1/chat/completions",
        "temperature beyond any float",
        {"messages": [USER], "temperature": 10**400},
        "temperature",
        None,
    ),
    (
        "/v1/chat/completions",
        "NaN",
        b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}',
        None,
        None,
    ),
    ("/v1/completions", "list of one list of strings", {"prompt": [["a"]]}, "prompt", None),
    # Lone UTF-16 surrogates: valid JSON escapes that are not Unicode characters.
    (
        "/v1/chat/completions",
        "lone surrogate in chat content",
        b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
        "messages",
        None,
    ),
    (
        "/v1/chat/completions",
        "lone low surrogate in a content part",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\uDC00 x"}]}]}',
        "messages",
        None,
    ),
    (
        "/v1/completions",
        "lone surrogate in a prompt",
        b'{"prompt": "hi \\ud800"}',
        "prompt",
        None,
    ),
    (
        "/v1/completions",
        "high surrogate before a plain character",
        b'{"prompt": ["ok", "\\ud83dx"]}',
        "prompt",
        None,
    ),
    ("/tokenize", "lone surrogate to tokenize", b'{"prompt": "hi \\ud800"}', "prompt", None),
    (
        "/tokenize",
        "lone surrogate in messages to tokenize",
        b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}',
        "messages",
        None,
    ),
    # Number literals of thousands of digits (past the interpreter's int digit limit).
    (
        "/v1/chat/completions",
        "temperature of 5,001 digits",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1' + b"0" * 5000 + b"}",
        None,
        None,
    ),
    (
        "/v1/chat/completions",
        "seed of 100,000 digits",
        b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1' + b"0" * 99_999 + b"}",
        None,
        None,
    ),
    (
        "/v1/completions",
        "completion seed of 100,000 digits",
        b'{"prompt": "hi", "seed": ' + b"9" * 100_000 + b"}",
        None,
        None,
    ),
    (
        "/tokenize",
        "an ignored field of 5,001 digits",
        b'{"prompt": "hi", "x": 1' + b"0" * 5000 + b"}",
        None,
        None,
    ),
]


async def _still_serves(http: httpx.AsyncClient) -> None:
    ok = await http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [USER]})
    assert ok.status_code == 200, ok.text
    assert (await http.get("/health")).status_code == 200


@pytest.fixture
async def served() -> Any:
    async with serve_scripted() as served:
        yield served


@pytest.mark.parametrize(
    ("path", "what", "body", "param", "code"), CASES, ids=[case[1] for case in CASES]
)
async def test_hostile_request_is_a_clear_400(
    served: Served,
    path: str,
    what: str,
    body: dict[str, Any] | bytes,
    param: str | None,
    code: str | None,
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        response = await http.post(
            path, content=content, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400, (what, response.text[:500])
        error = response.json()["error"]
        assert error["param"] == param, (what, error)
        assert error["code"] == code, (what, error)
        await _still_serves(http)
    await served.wait_idle()


async def test_surrogate_pairs_are_characters(served: Served) -> None:
    """An escaped pair (how ``json.dumps`` writes an emoji) is one character, not an error."""
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        chat = b'{"messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}'
        response = await http.post(
            "/v1/chat/completions", content=chat, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 200, response.text
        tokens = await http.post(
            "/tokenize",
            content=b'{"prompt": "\\ud83d\\ude00", "return_token_strs": true}',
            headers={"Content-Type": "application/json"},
        )
        assert tokens.status_code == 200, tokens.text
        direct = await http.post("/tokenize", json={"prompt": "\U0001f600"})
        assert tokens.json()["tokens"] == direct.json()["tokens"]
    await served.wait_idle()


async def test_huge_body_is_413_and_the_server_goes_on(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        big = {"messages": [{"role": "user", "content": "x" * (8 * 1024 * 1024)}]}
        response = await http.post("/v1/chat/completions", json=big)
        assert response.status_code == 413
    # a fresh connection: the one the unread body came on is not reused
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        await _still_serves(http)


HOSTILE_TEMPLATE = (
    "{% for m in messages %}{{ m.content.__class__.__mro__[1].__subclasses__() }}{% endfor %}"
)


@pytest.mark.model
async def test_hostile_chat_template_inside_a_model_file(tmp_path: Path) -> None:
    """A model directory whose chat template reaches for Python internals loads, rendering
    it is a 400 naming the messages, and the server keeps serving."""
    from .._model_fixtures import write_tiny_model

    directory = write_tiny_model(tmp_path, "llama", tied=True)
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = HOSTILE_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config))
    app = create_app(ServerConfig(model=str(directory), device="cpu"))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        response = await http.post("/v1/chat/completions", json={"messages": [USER]})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages"
        assert "chat template" in error["message"]
        ok = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert (await http.get("/health")).status_code == 200
