"""How the server's settings become the engine's, and the engine the server builds over
the default model's tokenizer (with a scripted runner: no model step runs)."""

from __future__ import annotations

from pathlib import Path

import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine import Delta, GenerationRequest
from furnace_trio.engine.model_thread import ModelThread
from furnace_trio.loading.tokenizer import Tokenizer
from furnace_trio.runtime.native.config import NativeConfig
from furnace_trio.server.backend import DEFAULT_LIMITS, build_engine, engine_config, runner_config
from furnace_trio.server.config import ServerConfig
from furnace_trio.text.detokenizer import ByteDetokenizer

from .. import scripted


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
        target_itl_ms=50.0,
    )
    engine = engine_config(config, "cpu")
    assert engine.target_itl_ms == 50.0
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
        assert engine.target_itl_ms is None
    # a max_running above the device's step budget raises the budget with it
    assert engine_config(ServerConfig(max_running=600), "cpu").max_step_tokens == 600


def test_runner_config_takes_the_native_kernel_settings(tmp_path: Path) -> None:
    """``FURNACE_NATIVE``, ``FURNACE_NATIVE_FLAGS``, ``FURNACE_CACHE_DIR`` and ``CC`` reach the
    runner through the configs; the runtime reads no environment."""
    environ = {
        "FURNACE_NATIVE": "0",
        "FURNACE_NATIVE_FLAGS": "-mno-avx512f -DNAME='a b'",
        "FURNACE_CACHE_DIR": str(tmp_path),
        "CC": "clang",
        "FURNACE_KV_CACHE_MB": "8",
    }
    settings = runner_config(ServerConfig.from_env(environ), "cpu", "cpu")
    assert settings.native is False
    build = settings.native_build
    assert build == NativeConfig(("-mno-avx512f", "-DNAME=a b"), tmp_path, "clang")
    assert build.directory == tmp_path
    defaults = runner_config(ServerConfig.from_env({"XDG_CACHE_HOME": str(tmp_path)}), "cpu", "cpu")
    assert defaults.native is True
    assert defaults.native_build.directory == tmp_path / "furnace-trio"
    assert defaults.native_build.flags == () and defaults.native_build.compiler == "cc"


async def test_the_servers_engine_streams_through_the_decode_table(tokenizer: Tokenizer) -> None:
    """build_engine (the server's, and the benchmarks') gives the engine the tokenizer's
    decode table, so that streams detokenize without calling decode, and the server's
    settings for the device."""
    thread = ModelThread()
    reply = tokenizer.encode("Paris, ça va 😀", add_special_tokens=False)
    runner = scripted.ScriptedRunner(lambda prompt, index: reply)
    engine = build_engine(runner, tokenizer, ServerConfig(max_running=3), "cpu", thread)
    assert engine.config == engine_config(ServerConfig(max_running=3), "cpu")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            params = SamplingParams(max_tokens=len(reply), ignore_eos=True)
            text = ""
            async with engine.submit(GenerationRequest((1, 2, 3), params)) as stream:
                assert isinstance(stream._samples[0].detokenizer, ByteDetokenizer)
                async for event in stream:
                    if isinstance(event, Delta):
                        text += event.text
            engine.shutdown()
            nursery.cancel_scope.cancel()
    finally:
        thread.close()
    assert text == "Paris, ça va 😀"
