"""SIGHUP to the server as a user runs it (``python -m furnace_trio.server.serve``, the
default model): the config file is read again, its live settings apply, and an invalid
file is logged and changes nothing while the server goes on serving."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from ..served_process import SERVE, serve_process

KEY = "sk-signal"
ADMIN = {"Authorization": "Bearer sk-admin"}


def _models(url: str, key: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_sighup_reloads_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "furnace.toml"
    config.write_text(
        "max_output_tokens = 3\nadmin_key = 'sk-admin'\n"
        f"[[api_keys]]\nname = 'first'\nkey = '{KEY}'\n"
    )
    with serve_process(SERVE, tmp_path / "logs", {"FURNACE_CONFIG": str(config)}) as served:
        assert _models(served.url, KEY).json()["data"][0]["max_output_tokens"] == 3

        config.write_text(
            "max_output_tokens = 7\nadmin_key = 'sk-admin'\nkv_cache_mb = 64\n"
            f"[[api_keys]]\nname = 'second'\nkey = '{KEY}-2'\n"
        )
        os.kill(served.process.pid, signal.SIGHUP)
        served.wait_for_log("configuration reloaded (generation 2)")
        assert _models(served.url, KEY).status_code == 401
        assert _models(served.url, f"{KEY}-2").json()["data"][0]["max_output_tokens"] == 7
        status = httpx.get(f"{served.url}/status", headers=ADMIN, timeout=30).json()
        assert status["config_generation"] == 2

        config.write_text("max_output_tokens = 'seven'\n")
        os.kill(served.process.pid, signal.SIGHUP)
        served.wait_for_log("SIGHUP: the configuration was not reloaded, nothing changed")
        assert _models(served.url, f"{KEY}-2").json()["data"][0]["max_output_tokens"] == 7
        status = httpx.get(f"{served.url}/status", headers=ADMIN, timeout=30).json()
        assert status["config_generation"] == 2
        assert served.process.poll() is None
    logs = served.logs()
    assert f"settings from {config}" in logs
    # FURNACE_KV_CACHE_MB is set in the environment by serve_process: the file's is shadowed
    assert "needs a restart to change: nothing; set in the environment" in logs
    assert "max_output_tokens (FURNACE_MAX_OUTPUT_TOKENS) must be an integer" in logs
    assert KEY not in logs


def test_an_invalid_file_stops_the_server_at_startup(tmp_path: Path) -> None:
    config = tmp_path / "furnace.toml"
    config.write_text("max_waitin = 3\n")
    env = {"FURNACE_CONFIG": str(config)}
    with (
        pytest.raises(AssertionError, match="unknown setting 'max_waitin'"),
        serve_process(SERVE, tmp_path / "logs", env, start_timeout_s=60),
    ):
        pass
