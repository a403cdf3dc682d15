"""The config file (``FURNACE_CONFIG``): key names, the merge with the environment, the
named API keys, and errors that name the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from furnace_trio.server.api_keys import UNNAMED_KEY, APIKey, accepted_keys, match_key
from furnace_trio.server.config import ConfigError, ServerConfig
from furnace_trio.server.config_file import load_config, setting_names


def _file(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "furnace.toml"
    path.write_text(text)
    return {"FURNACE_CONFIG": str(path)}


def test_every_variable_is_a_key_without_its_prefix_in_lower_case() -> None:
    names = setting_names()
    assert names["max_waiting"] == "FURNACE_MAX_WAITING"
    assert names["quant"] == "FURNACE_QUANT"
    assert names["session_ttl_s"] == "FURNACE_SESSION_TTL_S"
    assert "config" not in names  # the file does not name itself
    assert all(variable.startswith("FURNACE_") for variable in names.values())


def test_file_values_are_read_as_their_variables(tmp_path: Path) -> None:
    env = _file(
        tmp_path,
        """
max_waiting = 64
max_output_tokens = 1024
session_ttl_s = 90.5
prefix_cache = false
quant = "int8"
cors_origins = ["https://a.example", "https://b.example"]
native_flags = ["-mno-avx512f", "-DX=a b"]
""",
    )
    config = load_config(env).config
    assert config.max_waiting == 64 and config.max_output_tokens == 1024
    assert config.session_ttl_s == 90.5 and config.prefix_cache is False
    assert config.quantization == "int8"
    assert config.cors_origins == ("https://a.example", "https://b.example")
    assert config.native_build.flags == ("-mno-avx512f", "-DX=a b")
    assert config.config_file == env["FURNACE_CONFIG"]


def test_defaults_then_file_then_environment(tmp_path: Path) -> None:
    env = _file(tmp_path, "max_waiting = 64\nmax_sessions = 5\n")
    env |= {"FURNACE_MAX_WAITING": "7", "FURNACE_MAX_SESSIONS": "  "}  # empty: unset
    loaded = load_config(env)
    assert loaded.config.max_waiting == 7  # the environment wins
    assert loaded.config.max_sessions == 5  # an empty variable does not
    assert loaded.config.max_running is None  # neither sets it: the default
    assert loaded.shadowed == ("max_waiting",)


def test_without_a_file_the_environment_alone() -> None:
    loaded = load_config({"FURNACE_MAX_WAITING": "9"})
    assert loaded.config == ServerConfig.from_env({"FURNACE_MAX_WAITING": "9"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_waitin = 3\n", "unknown setting 'max_waitin'"),
        ("max_waiting = 'lots'\n", "max_waiting (FURNACE_MAX_WAITING) must be an integer"),
        ("max_waiting = 0\n", "max_waiting (FURNACE_MAX_WAITING) must be at least 1"),
        ("device = 'tpu'\n", "device (FURNACE_DEVICE) must be one of"),
        ("max_waiting = [1, 2]\n", "max_waiting must be a string, a number"),
        ("[server]\nport = 1\n", "unknown setting 'server'"),
        ("[max_waiting]\nvalue = 1\n", "max_waiting must be a string, a number"),
        ("max_waiting = \n", "not valid TOML"),
        ("config = 'other.toml'\n", "unknown setting 'config'"),
        ("[[api_keys]]\nname = 'a b'\nkey = 'k'\n", "api_keys[0]: API key name 'a b'"),
        ("[[api_keys]]\nname = 'a'\n", "api_keys[0]: name and key must both be strings"),
        ("[[api_keys]]\nname = 'a'\nkey = 'k'\nlimit = 2\n", "unknown field 'limit'"),
        ("[[api_keys]]\nname = 'a'\nkey = 'k'\nmax_concurrent = 0\n", "at least 1"),
        (
            "[[api_keys]]\nname = 'a'\nkey = 'k'\n[[api_keys]]\nname = 'a'\nkey = 'j'\n",
            "two API keys are named 'a'",
        ),
        (
            "[[api_keys]]\nname = 'a'\nkey = 'k'\n[[api_keys]]\nname = 'b'\nkey = 'k'\n",
            "the API keys 'a' and 'b' are the same",
        ),
        (
            "api_key = 'k0'\n[[api_keys]]\nname = 'default'\nkey = 'k'\n",
            "two API keys are named 'default'",
        ),
    ],
)
def test_an_invalid_file_names_the_file_and_what_is_wrong(
    tmp_path: Path, text: str, message: str
) -> None:
    env = _file(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_config(env)
    assert str(error.value).startswith(env["FURNACE_CONFIG"] + ": ")
    assert message in str(error.value)


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config({"FURNACE_CONFIG": str(tmp_path / "nowhere.toml")})


def test_named_keys_and_the_unnamed_one(tmp_path: Path) -> None:
    env = _file(
        tmp_path,
        """
[[api_keys]]
name = "alice"
key = "sk-alice"
max_concurrent = 2

[[api_keys]]
name = "bob"
key = "sk-bob"
""",
    )
    config = load_config(env | {"FURNACE_API_KEY": "sk-env"}).config
    keys = accepted_keys(config.api_key, config.api_keys)
    assert [(k.name, k.max_concurrent) for k in keys] == [
        (UNNAMED_KEY, None),
        ("alice", 2),
        ("bob", None),
    ]
    assert match_key(keys, "sk-bob") == APIKey("bob", "sk-bob")
    assert match_key(keys, "sk-env") is not None and match_key(keys, "sk-env").name == "default"  # type: ignore[union-attr]
    assert match_key(keys, "sk-bo") is None and match_key(keys, "") is None
    for text in (repr(config), repr(keys)):  # keys never show in a repr (a log line)
        assert "sk-" not in text


def test_the_file_alone_can_set_the_unnamed_key(tmp_path: Path) -> None:
    config = load_config(_file(tmp_path, "api_key = 'sk-file'\nadmin_key = 'sk-admin'\n")).config
    assert (config.api_key, config.admin_key) == ("sk-file", "sk-admin")
