"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (vLLM's bodies) over a real socket.

The server's tokenizer is SmolLM2's own, so each answer is checked against the same
tokenizer called directly. These are what lm-evaluation-harness's remote tokenizer calls
(``/tokenizer_info`` with an ``eos_token`` key, ``/tokenize`` with ``prompt`` and
``add_special_tokens``, ``/detokenize`` with ``tokens``).
"""

from __future__ import annotations

from typing import Any

import httpx

from ..http_server import MODEL_NAME, serve_scripted, smollm2_tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, café ☕?"},
]


async def test_tokenize_a_prompt_and_detokenize_it_back() -> None:
    tokenizer = smollm2_tokenizer()
    text = "Hello, café ☕ <|im_start|>user"
    async with serve_scripted() as served, httpx.AsyncClient(base_url=served.url) as http:
        info = (await http.get("/tokenizer_info")).json()
        plain = (await http.post("/tokenize", json={"prompt": text})).json()
        raw = await http.post(
            "/tokenize",
            json={
                "model": MODEL_NAME,
                "prompt": text,
                "add_special_tokens": False,
                "return_token_strs": True,
            },
        )
        back = (await http.post("/detokenize", json={"tokens": raw.json()["tokens"]})).json()
        empty = (await http.post("/detokenize", json={"tokens": []})).json()
    assert plain["tokens"] == tokenizer.encode(text)
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == 1024
    assert "token_strs" not in plain
    body = raw.json()
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert body["token_strs"] == [tokenizer.id_to_token(t) for t in body["tokens"]]
    assert tokenizer.token_to_id("<|im_start|>") in body["tokens"]  # a special token parsed
    assert back == {"prompt": text} and empty == {"prompt": ""}
    assert info["eos_token"] == tokenizer.eos_token == "<|im_end|>"
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 1024


async def test_tokenize_a_conversation_as_the_chat_template_renders_it() -> None:
    tokenizer = smollm2_tokenizer()
    async with serve_scripted() as served, httpx.AsyncClient(base_url=served.url) as http:
        turn = (await http.post("/tokenize", json={"messages": MESSAGES})).json()
        bare = (
            await http.post(
                "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
            )
        ).json()
    assert turn["tokens"] == tokenizer.render_and_encode_chat(MESSAGES)
    opening = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert turn["tokens"] == bare["tokens"] + opening


async def test_bad_tokenizer_requests_are_400s_naming_the_field() -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [1, True]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ]
    async with serve_scripted() as served, httpx.AsyncClient(base_url=served.url) as http:
        for path, body, param in cases:
            response = await http.post(path, json=body)
            assert response.status_code == 400, (path, body, response.text)
            assert response.json()["error"]["param"] == param, (path, body)
        wrong = await http.post("/tokenize", json={"model": "gpt-4", "prompt": "a"})
        assert wrong.status_code == 404
        assert (await http.post("/tokenize", json={"prompt": "a"})).status_code == 200


async def test_the_tokenizer_endpoints_want_the_api_key() -> None:
    async with (
        serve_scripted(api_key="sekret") as served,
        httpx.AsyncClient(base_url=served.url) as http,
    ):
        calls = [
            ("GET", "/tokenizer_info", None),
            ("POST", "/tokenize", {"prompt": "a"}),
            ("POST", "/detokenize", {"tokens": [1]}),
        ]
        for method, path, body in calls:
            refused = await http.request(method, path, json=body)
            assert refused.status_code == 401, path
            allowed = await http.request(
                method, path, json=body, headers={"Authorization": "Bearer sekret"}
            )
            assert allowed.status_code == 200, path
