"""How the server's settings become the engine's (no model is loaded)."""

from __future__ import annotations

from furnace_trio.backend import DEFAULT_LIMITS, engine_config
from furnace_trio.config import ServerConfig


def test_engine_config_takes_the_server_settings() -> None:
    config = ServerConfig(
        max_running=4,
        max_waiting=9,
        max_step_tokens=64,
        session_ttl_s=5.0,
        session_max_blocks=7,
        max_sessions=3,
        prefix_cache=False,
        step_timeout_s=2.5,
        stream_interval=4,
    )
    engine = engine_config(config, "cpu")
    assert (engine.max_running, engine.max_waiting, engine.max_step_tokens) == (4, 9, 64)
    assert (engine.session_ttl_s, engine.session_max_blocks, engine.max_sessions) == (5.0, 7, 3)
    assert engine.prefix_cache is False
    assert engine.step_timeout_s == 2.5
    assert engine.stream_interval == 4


def test_engine_config_fills_in_the_device_defaults() -> None:
    for device, (running, step_tokens) in DEFAULT_LIMITS.items():
        engine = engine_config(ServerConfig(), device)
        assert (engine.max_running, engine.max_step_tokens) == (running, step_tokens)
        assert engine.stream_interval == 1
    # a max_running above the device's step budget raises the budget with it
    assert engine_config(ServerConfig(max_running=600), "cpu").max_step_tokens == 600
