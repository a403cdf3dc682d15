"""``POST /admin/reload`` over a real socket: requests keep the settings they arrived
with, later ones get the new ones; an invalid file changes nothing and says why; settings
that need a restart are reported, not applied.

The scripted runner's gate holds the engine's step, so "before" and "after" the reload
are states the test sets up, not timing. The server reads ``FURNACE_CONFIG`` from the
process environment on reload, as it does when it starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import trio

from furnace_trio.engine import EngineConfig
from furnace_trio.server.config import ServerConfig
from furnace_trio.server.config_file import load_config
from furnace_trio.server.reload import RELOAD_SCHEMA

from .. import scripted
from ..http_server import MODEL_NAME, serve_scripted
from .waiting import engine_reaches

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _write(path: Path, text: str) -> None:
    path.write_text(text)


def _settings(config: ServerConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "furnace.toml"
    monkeypatch.setenv("FURNACE_CONFIG", str(path))
    return path


async def _reload(http: httpx.AsyncClient, **headers: str) -> httpx.Response:
    return await http.post("/admin/reload", json={}, headers=headers)


async def test_requests_keep_the_limits_they_arrived_with(config_file: Path) -> None:
    _write(config_file, "max_output_tokens = 4\nmax_running = 1\nmax_body_bytes = 4000\n")
    gate = threading.Event()
    runner = scripted.ScriptedRunner(gate=gate, num_blocks=1024)  # filler tokens, no EOS
    padded = json.dumps(CHAT) + " " * 5000  # a body past 4000 bytes, a prompt of two words
    before: list[httpx.Response] = []
    after: list[httpx.Response] = []
    async with (
        serve_scripted(
            runner,
            engine_config=EngineConfig(max_running=1, max_step_tokens=64),
            **_settings(load_config().config),
        ) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
        trio.open_nursery() as nursery,
    ):

        async def post(into: list[httpx.Response], body: str = json.dumps(CHAT)) -> None:
            headers = {"Content-Type": "application/json"}
            into.append(await http.post("/v1/chat/completions", content=body, headers=headers))

        try:
            for _ in range(3):  # one running (its step held), two queued
                nursery.start_soon(post, before)
            await engine_reaches(served.engine, lambda s: s.running == 1 and s.waiting == 2)
            refused = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8})
            assert refused.status_code == 400, refused.text
            too_big = await http.post(
                "/v1/chat/completions",
                content=padded,
                headers={"Content-Type": "application/json"},
            )
            assert too_big.status_code == 413

            _write(config_file, "max_output_tokens = 8\nmax_running = 3\nmax_body_bytes = 100000\n")
            reloaded = await _reload(http)
            assert reloaded.status_code == 200, reloaded.text
            jsonschema.Draft202012Validator(RELOAD_SCHEMA).validate(reloaded.json())
            assert reloaded.json() == {
                "object": "config.reload",
                "config_generation": 2,
                "config_file": str(config_file),
                "changed": ["max_running", "max_output_tokens", "max_body_bytes"],
                "needs_restart": [],
                "shadowed_by_environment": [],
            }
            for _ in range(2):
                nursery.start_soon(post, after)
            nursery.start_soon(post, after, padded)
            await engine_reaches(served.engine, lambda s: s.waiting == 5)
            status = (await http.get("/status")).json()
            assert status["config_generation"] == 2
        finally:
            gate.set()
    assert [r.status_code for r in before + after] == [200] * 6, [r.text for r in before + after]
    assert [r.json()["usage"]["completion_tokens"] for r in before] == [4, 4, 4]
    assert [r.json()["usage"]["completion_tokens"] for r in after] == [8, 8, 8]
    # max_running 3 from the reload on: three sequences stepped together
    assert max(len({c.seq_id for c in plan.chunks}) for plan in runner.plans) == 3


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("max_output_tokens = 'many'\n", "max_output_tokens (FURNACE_MAX_OUTPUT_TOKENS) must be"),
        ("max_output_tokens = 8\nmax_step_tokens = 2\nmax_running = 8\n", "max_step_tokens"),
        ("max_output_tokens = 8\nmax_outpt_tokens = 9\n", "unknown setting 'max_outpt_tokens'"),
        ("max_output_tokens = 8\n[[api_keys]]\nname = 'x'\n", "api_keys[0]"),
    ],
)
async def test_an_invalid_file_changes_nothing_and_says_why(
    config_file: Path, caplog: pytest.LogCaptureFixture, text: str, why: str
) -> None:
    caplog.set_level(logging.INFO, logger="furnace_trio")
    _write(config_file, "max_output_tokens = 4\n")
    async with (
        serve_scripted(**_settings(load_config().config)) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
    ):
        config = served.state.config
        engine_config = served.engine.config
        _write(config_file, text)
        refused = await _reload(http)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_config"
        assert error["message"].startswith("The configuration was not reloaded, nothing changed")
        assert str(config_file) in error["message"] and why in error["message"]
        logged = [r for r in caplog.records if "not reloaded" in r.getMessage()]
        assert logged and logged[0].levelno == logging.ERROR and why in logged[0].getMessage()
        assert served.state.config is config and served.engine.config is engine_config
        assert (await http.get("/status")).json()["config_generation"] == 1
        still = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8})
        assert still.status_code == 400  # the cap of 4 holds


async def test_settings_that_need_a_restart_are_reported_not_applied(
    config_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="furnace_trio")
    monkeypatch.setenv("FURNACE_MAX_SESSIONS", "3")
    _write(config_file, "max_waiting = 10\nmax_sessions = 5\n")
    async with (
        serve_scripted(**_settings(load_config().config)) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
    ):
        _write(
            config_file,
            "max_waiting = 20\nmax_sessions = 5\nkv_cache_mb = 64\nmodel_name = 'other'\n",
        )
        reloaded = (await _reload(http)).json()
        assert reloaded["changed"] == ["max_waiting"]
        assert reloaded["needs_restart"] == ["model_name", "kv_cache_mb"]
        assert reloaded["shadowed_by_environment"] == ["max_sessions"]
        config = served.state.config
        assert config is not None
        assert (config.max_waiting, config.kv_cache_mb, config.model_name) == (20, None, None)
        assert served.engine.config.max_waiting == 20
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == MODEL_NAME
    line = next(r.getMessage() for r in caplog.records if "reloaded" in r.getMessage())
    assert "generation 2" in line and "needs a restart to change: model_name, kv_cache_mb" in line


async def test_the_admin_key_guards_reload(config_file: Path) -> None:
    _write(config_file, "api_key = 'sk-user'\nadmin_key = 'sk-admin'\n")
    async with (
        serve_scripted(**_settings(load_config().config)) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
    ):
        assert (await _reload(http)).status_code == 401
        refused = await _reload(http, Authorization="Bearer sk-user")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert (await _reload(http, Authorization="Bearer sk-admin")).status_code == 200
        # a reload that drops the admin key: the API key opens the admin routes again
        _write(config_file, "api_key = 'sk-user'\n")
        assert (await _reload(http, Authorization="Bearer sk-admin")).status_code == 200
        assert (await _reload(http, Authorization="Bearer sk-user")).status_code == 200
        assert (await _reload(http, Authorization="Bearer sk-admin")).status_code == 401


async def test_keys_change_for_new_requests_and_a_stream_in_flight_goes_on(
    config_file: Path,
) -> None:
    _write(config_file, "[[api_keys]]\nname = 'alice'\nkey = 'sk-alice'\n")
    gate = threading.Event()
    runner = scripted.ScriptedRunner(gate=gate)
    alice = {"Authorization": "Bearer sk-alice"}
    bob = {"Authorization": "Bearer sk-bob"}
    async with (
        serve_scripted(runner, **_settings(load_config().config)) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
    ):
        try:
            body = {**CHAT, "stream": True, "max_tokens": 5}
            async with http.stream(
                "POST", "/v1/chat/completions", json=body, headers=alice
            ) as stream:
                assert stream.status_code == 200
                await engine_reaches(served.engine, lambda s: s.running == 1)
                _write(config_file, "[[api_keys]]\nname = 'bob'\nkey = 'sk-bob'\n")
                reloaded = await _reload(http, **alice)  # no admin key: an API key opens it
                assert reloaded.json()["changed"] == ["api_keys"]
                assert "sk-" not in reloaded.text
                assert (await http.get("/v1/models", headers=alice)).status_code == 401
                assert (await http.get("/v1/models", headers=bob)).status_code == 200
                gate.set()
                text = (await stream.aread()).decode()
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        finally:
            gate.set()
