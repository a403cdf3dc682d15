"""Browser defences over a real socket: JSON content types only, loopback Host names on
loopback (DNS rebinding), CORS for configured origins only. Refusals are OpenAI error
objects and the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from furnace_trio.server.config import ConfigError, ServerConfig
from furnace_trio.server.request_guard import (
    host_allowed,
    is_json_content_type,
    is_loopback_address,
)

from ..http_server import MODEL_NAME, serve_scripted

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BODY = httpx.Request("POST", "/", json=CHAT).content


def _error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


async def test_a_json_body_sent_as_anything_but_json_is_415() -> None:
    """``text/plain`` and form bodies are what a page may POST cross-origin without a
    preflight; they are refused before the body is read."""
    async with serve_scripted() as served, httpx.AsyncClient(base_url=served.url) as http:
        for content_type in (
            "text/plain",
            "text/plain;charset=UTF-8",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            None,
        ):
            headers = {} if content_type is None else {"Content-Type": content_type}
            for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
                response = await http.post(path, content=BODY, headers=headers)
                error = _error(response, 415, "unsupported_media_type")
                assert error["type"] == "invalid_request_error"
        for content_type in ("application/json", "Application/JSON; charset=utf-8"):
            ok = await http.post(
                "/v1/chat/completions", content=BODY, headers={"Content-Type": content_type}
            )
            assert ok.status_code == 200, ok.text
        # Not a JSON endpoint for that method or path: 405 and 404, as without the guard.
        assert (await http.put("/v1/chat/completions", content=BODY)).status_code == 405
        assert (await http.post("/v1/nothing", content=BODY)).status_code == 404
    assert served.state.http_responses[415] == 15


async def test_a_foreign_host_on_loopback_is_refused() -> None:
    """DNS rebinding: the page's requests reach 127.0.0.1 but name its own host."""
    async with serve_scripted() as served, httpx.AsyncClient(base_url=served.url) as http:
        port = served.url.rsplit(":", 1)[1]
        for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example", "0.0.0.0"):
            refused = await http.post("/v1/chat/completions", json=CHAT, headers={"Host": host})
            assert _error(refused, 403, "host_not_allowed")["type"] == "permission_error"
            health = await http.get("/health", headers={"Host": host})
            assert health.status_code == 403
        for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            ok = await http.post("/v1/chat/completions", json=CHAT, headers={"Host": host})
            assert ok.status_code == 200, (host, ok.text)
    # The official client, by a loopback name.
    async with (
        serve_scripted() as served,
        openai.AsyncOpenAI(
            base_url=served.url.replace("127.0.0.1", "localhost") + "/v1",
            api_key="x",
            max_retries=0,
        ) as client,
    ):
        reply = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert reply.choices[0].message.content


async def test_allowed_hosts_and_the_api_key() -> None:
    async with (
        serve_scripted(allowed_hosts=("api.example",), api_key="k") as served,
        httpx.AsyncClient(base_url=served.url) as http,
    ):
        auth = {"Authorization": "Bearer k"}
        named = await http.post(
            "/v1/chat/completions", json=CHAT, headers={**auth, "Host": "API.example:443"}
        )
        assert named.status_code == 200, named.text
        # The host is checked before the key: a rebinding page learns nothing more.
        other = await http.post("/v1/chat/completions", json=CHAT, headers={"Host": "x.example"})
        _error(other, 403, "host_not_allowed")
    async with (
        serve_scripted(allowed_hosts=("*",)) as served,
        httpx.AsyncClient(base_url=served.url) as http,
    ):
        anyhost = await http.post("/v1/chat/completions", json=CHAT, headers={"Host": "x.example"})
        assert anyhost.status_code == 200


async def test_cors_only_for_configured_origins() -> None:
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    async with serve_scripted() as served, httpx.AsyncClient(base_url=served.url) as http:
        refused = await http.options("/v1/chat/completions", headers=preflight)
        _error(refused, 403, "origin_not_allowed")
        assert "access-control-allow-origin" not in refused.headers
        plain = await http.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": "https://app.example"}
        )
        assert plain.status_code == 200
        assert "access-control-allow-origin" not in plain.headers
    async with (
        serve_scripted(cors_origins=("https://app.example",)) as served,
        httpx.AsyncClient(base_url=served.url) as http,
    ):
        answered = await http.options("/v1/chat/completions", headers=preflight)
        assert answered.status_code == 204
        assert answered.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in answered.headers["access-control-allow-methods"]
        assert "x-stainless-os" in answered.headers["access-control-allow-headers"]
        allowed = await http.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": "https://app.example"}
        )
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert "Origin" in allowed.headers["vary"]
        other = await http.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": "https://evil.example"}
        )
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
        other_preflight = await http.options(
            "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
        )
        _error(other_preflight, 403, "origin_not_allowed")


def test_host_and_content_type_rules() -> None:
    assert is_json_content_type("application/json")
    assert is_json_content_type(" application/json ; charset=utf-8")
    assert not is_json_content_type("application/jsonx")
    assert not is_json_content_type("text/json")
    assert not is_json_content_type(None)
    for address in ("127.0.0.1", "127.8.9.1", "::1", "::ffff:127.0.0.1"):
        assert is_loopback_address(address)
    for address in ("10.0.0.5", "0.0.0.0", "::", "localhost", "/run/furnace.sock"):
        assert not is_loopback_address(address)
    # Off loopback (a public bind), any host unless names are configured.
    assert host_allowed("evil.example", "10.0.0.5", ())
    assert not host_allowed("evil.example", "10.0.0.5", ("api.example",))
    assert host_allowed("api.example:8000", "10.0.0.5", ("api.example",))
    assert host_allowed("localhost:8000", "10.0.0.5", ("api.example",))
    assert not host_allowed("evil.example", "127.0.0.1", ())
    assert not host_allowed("[::2]:80", "::1", ())
    assert host_allowed("[::1]", "::1", ())
    assert host_allowed(None, "127.0.0.1", ())  # HTTP/1.0 without Host: not a browser


def test_settings() -> None:
    cfg = ServerConfig.from_env(
        {
            "FURNACE_ALLOWED_HOSTS": " API.example , [::2]:80,",
            "FURNACE_CORS_ORIGINS": "https://App.example/, http://localhost:3000",
        }
    )
    assert cfg.allowed_hosts == ("api.example", "[::2]:80")
    assert cfg.cors_origins == ("https://app.example", "http://localhost:3000")
    assert host_allowed("[::2]", "::1", cfg.allowed_hosts)
    with pytest.raises(ConfigError, match="FURNACE_CORS_ORIGINS"):
        ServerConfig.from_env({"FURNACE_CORS_ORIGINS": "app.example"})
    with pytest.raises(ConfigError, match="FURNACE_CORS_ORIGINS"):
        ServerConfig.from_env({"FURNACE_CORS_ORIGINS": "https://app.example/path"})
