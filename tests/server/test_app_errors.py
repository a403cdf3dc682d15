"""Bad input, auth, limits and engine errors over a real socket: never a 500, never a hang."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio

from furnace_trio.engine import EngineConfig

from .. import scripted
from ..http_server import ANSWERS, MODEL_NAME, Served, default_script, serve_scripted
from .waiting import engine_reaches, wait_until

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with serve_scripted(max_body_bytes=64 * 1024) as s:
        yield s


def check_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if status == 400:
        assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    return error  # type: ignore[no-any-return]


BAD_CHAT_BODIES: list[tuple[bytes | dict[str, Any], str | None]] = [
    (b"{not json", None),
    (b"\xff\xfe\x00", None),
    (b"", None),
    (b"[1,2]", None),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": MESSAGES, "max_tokens": True}, "max_tokens"),
    ({"messages": MESSAGES, "temperature": 9}, "temperature"),
    ({"messages": MESSAGES, "n": "2"}, "n"),
    ({"messages": MESSAGES, "logit_bias": {"1": 500}}, "logit_bias"),
    ({"messages": MESSAGES, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"messages": MESSAGES, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, "messages"),
    ({"messages": MESSAGES, "stop": [1]}, "stop"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT_BODIES)
async def test_bad_chat_bodies(
    served: Served, body: bytes | dict[str, Any], param: str | None
) -> None:
    async with httpx.AsyncClient(base_url=served.url) as http:
        if isinstance(body, bytes):
            response = await http.post(
                "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
        else:
            response = await http.post("/v1/chat/completions", json=body)
        check_error(response, 400, param)
        # The server keeps serving.
        ok = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert ok.status_code == 200


async def test_bad_completion_bodies(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as http:
        for body, param in [
            ({"prompt": [1, 2**40]}, "prompt"),
            ({"prompt": ""}, "prompt"),
            ({"prompt": "x", "logprobs": 9}, "logprobs"),
            ({"prompt": [5] * 1100}, "prompt"),
        ]:
            check_error(await http.post("/v1/completions", json=body), 400, param)


async def test_unknown_model_routes_and_methods(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as http:
        error = check_error(
            await http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES}),
            404,
            "model",
        )
        assert error["code"] == "model_not_found"
        check_error(await http.get("/v1/nothing"), 404)
        response = await http.get("/v1/chat/completions")
        check_error(response, 405)
        assert "POST" in response.headers["allow"]


async def test_body_over_limit_is_413(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as http:
        body = {"messages": [{"role": "user", "content": "x" * (65 * 1024)}]}
        check_error(await http.post("/v1/chat/completions", json=body), 413)
        assert (await http.get("/health")).status_code == 200


async def test_api_key() -> None:
    async with serve_scripted(api_key="sesame") as served:
        for key, expected in (("sesame", 200), ("wrong", 401)):
            async with openai.AsyncOpenAI(
                base_url=served.url + "/v1", api_key=key, max_retries=0
            ) as c:
                if expected == 200:
                    result = await c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)  # type: ignore[arg-type]
                    assert result.choices[0].message.content == ANSWERS[0]
                else:
                    with pytest.raises(openai.AuthenticationError):
                        await c.models.list()
        async with httpx.AsyncClient(base_url=served.url) as http:
            check_error(await http.get("/v1/models"), 401)
            assert (await http.get("/health")).status_code == 200  # open without a key


async def test_busy_is_503_with_retry_after() -> None:
    gate = threading.Event()
    runner = scripted.ScriptedRunner(default_script, gate=gate)
    config = EngineConfig(max_running=1, max_waiting=1)
    async with (
        serve_scripted(runner, engine_config=config) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
        trio.open_nursery() as nursery,
    ):
        results: list[int] = []

        async def post() -> None:
            response = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
            results.append(response.status_code)

        nursery.start_soon(post)  # runs (its first step blocks on the gate)
        await engine_reaches(served.engine, lambda s: s.running == 1, "one running")
        nursery.start_soon(post)  # waits
        await engine_reaches(served.engine, lambda s: s.waiting == 1, "one waiting")
        busy = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
        error = check_error(busy, 503)
        assert busy.headers["retry-after"] == "1"
        assert error["code"] == "server_busy"
        gate.set()
    assert results == [200, 200]
    await served.wait_idle()


async def test_request_too_large_is_503_without_retry() -> None:
    runner = scripted.ScriptedRunner(default_script, num_blocks=4)
    async with serve_scripted(runner) as served, httpx.AsyncClient(base_url=served.url) as http:
        response = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 100})
        check_error(response, 503)
        assert response.headers["x-should-retry"] == "false"


async def test_model_failure_mid_stream_is_an_sse_error_event() -> None:
    runner = scripted.ScriptedRunner(lambda p, i: [], fail_on={3})
    async with serve_scripted(runner) as served:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="k", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model=MODEL_NAME,
                messages=MESSAGES,
                stream=True,
                max_tokens=50,  # type: ignore[arg-type]
            )
            with pytest.raises(openai.APIError, match="model failed"):
                async for _ in stream:
                    pass
            # Non-streaming failure: 500 error object; the server keeps serving.
            runner.fail_on = {len(runner.plans) + 1}
            with pytest.raises(openai.InternalServerError):
                await c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)  # type: ignore[arg-type]
            ok = await c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
            assert ok.choices[0].message.content == "xx"
        await served.wait_idle()


async def test_dead_engine_gives_503_and_health_503() -> None:
    async with serve_scripted(scripted.EngineKillingRunner(default_script)) as served:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="k", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model=MODEL_NAME,
                messages=MESSAGES,
                stream=True,  # type: ignore[arg-type]
            )
            with pytest.raises(openai.APIError, match="engine failed"):
                async for _ in stream:
                    pass
            await engine_reaches(served.engine, lambda s: not s.alive, "the engine stopped")
            with pytest.raises(openai.InternalServerError) as info:
                await c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)  # type: ignore[arg-type]
            assert info.value.status_code == 503
        async with httpx.AsyncClient(base_url=served.url) as http:
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "unavailable"
            assert "furnace_engine_up 0" in (await http.get("/metrics")).text


async def _read_response(
    stream: trio.SocketStream, buffer: bytearray
) -> tuple[int, dict[str, str]]:
    """One HTTP/1.1 response with a Content-Length body, read off a kept-alive connection
    (``buffer`` carries bytes past it over to the next call). Status and headers."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        assert data, "the server closed the connection"
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    length = int(headers["content-length"])
    while len(rest) < length:
        data = await stream.receive_some(65536)
        assert data, "the server closed the connection mid-body"
        rest += data
    buffer[:] = rest[length:]
    return int(lines[0].split()[1]), headers


@pytest.mark.parametrize("body_size", [10, 5000])
async def test_an_error_answered_before_the_body_leaves_the_connection_usable(
    served: Served, body_size: int
) -> None:
    """A 405 decided from the headers while the client is still sending the body (as
    http.client does for a str body: headers and body in two writes): the next request on
    the same connection is answered. Without the wait for the body, hypercorn's HTTP/1.1
    protocol leaves it unanswered."""
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    buffer = bytearray()
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        with trio.fail_after(10):
            await stream.send_all(
                f"POST /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: {body_size}\r\n\r\n".encode()
            )
            # the response starts (and waits for the body) before the body is sent
            await wait_until(lambda: served.state.http_responses[405] == 1, "the 405 started")
            await stream.send_all(b"y" * body_size)
            status, headers = await _read_response(stream, buffer)
            assert status == 405
            assert headers.get("connection") != "close"
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            status, _ = await _read_response(stream, buffer)
            assert status == 200


async def test_an_error_whose_body_never_comes_says_connection_close(
    served: Served,
) -> None:
    """A body announced but not sent within the wait: the error is answered with
    ``connection: close`` (the client must not send another request on it), and the
    server serves new connections."""
    served.app.asgi_app.body_wait_s = 0.2
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    buffer = bytearray()
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        with trio.fail_after(10):
            await stream.send_all(
                b"POST /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n"
            )
            status, headers = await _read_response(stream, buffer)
            assert status == 405
            assert headers["connection"] == "close"
    async with httpx.AsyncClient(base_url=served.url) as http:
        assert (await http.get("/health")).status_code == 200
