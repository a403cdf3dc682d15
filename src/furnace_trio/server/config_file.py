"""The config file: ``FURNACE_CONFIG`` names a TOML file of the same settings as the
``FURNACE_*`` environment variables, plus named API keys.

A setting's key in the file is its variable's name without ``FURNACE_``, in lower case
(``FURNACE_MAX_WAITING`` -> ``max_waiting``, ``FURNACE_QUANT`` -> ``quant``)::

    max_waiting = 64
    max_output_tokens = 1024
    session_ttl_s = 600.0
    cors_origins = ["https://app.example"]      # a list, or "a,b" as in the variable

    [[api_keys]]
    name = "alice"
    key = "sk-alice-..."
    max_concurrent = 2

The file and the environment merge as **defaults < file < environment**: a variable that
is set (not empty) wins over the file, the way a deployment overrides a shared file for one
instance, and as the server behaves without a file. The price is that a reload cannot change
a setting the environment pins; :func:`load_config` reports those keys as shadowed.
Each value is turned into the text of its variable and parsed by
:meth:`ServerConfig.from_env <furnace_trio.server.config.ServerConfig.from_env>`, so the file
accepts exactly what the variables accept and is checked the same way; an error names the
file and the key. The set of keys is whatever ``from_env`` reads (found by running it once on
a mapping that records the names it asks for), so a new setting is a key of the file as soon
as it is a variable.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from furnace_trio.server.api_keys import APIKey, parse_api_keys
from furnace_trio.server.config import ConfigError, ServerConfig

__all__ = ["FileSettings", "LoadedConfig", "load_config", "read_config_file", "setting_names"]

PREFIX = "FURNACE_"
#: The variable that names the file (not a key of the file itself).
CONFIG_VARIABLE = "FURNACE_CONFIG"
#: Keys whose list form joins as shell words rather than with commas.
_SHELL_WORDS = frozenset({"FURNACE_NATIVE_FLAGS"})


class _Recording(Mapping[str, str]):
    """An empty mapping that remembers every key it was asked for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __getitem__(self, key: str) -> str:
        self.asked.append(key)
        raise KeyError(key)

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        self.asked.append(key)
        return default

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.asked.append(key)
        return False

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


@functools.cache
def setting_names() -> dict[str, str]:
    """File key -> variable, for every ``FURNACE_*`` variable the server reads."""
    recording = _Recording()
    ServerConfig.from_env(recording)
    return {
        name.removeprefix(PREFIX).lower(): name
        for name in recording.asked
        if name.startswith(PREFIX) and name != CONFIG_VARIABLE
    }


@dataclass(frozen=True, slots=True)
class FileSettings:
    """What a config file says: its settings as variables' text, and its named keys."""

    variables: Mapping[str, str]
    api_keys: tuple[APIKey, ...]


def _as_text(variable: str, value: object) -> str:
    """A TOML value as the text of its variable."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return shlex.join(value) if variable in _SHELL_WORDS else ",".join(value)
    raise ValueError("must be a string, a number, a boolean or a list of strings")


def read_config_file(path: Path) -> FileSettings:
    """Read and check the file's keys (not yet their values: :func:`load_config` does).

    Raises :class:`ConfigError` naming the file (unreadable, not TOML, an unknown key, a
    value of the wrong shape, a bad ``[[api_keys]]`` entry)."""
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    names = setting_names()
    variables: dict[str, str] = {}
    api_keys: tuple[APIKey, ...] = ()
    for key, value in data.items():
        if key == "api_keys":
            try:
                api_keys = parse_api_keys(value)
            except ValueError as exc:
                raise ConfigError(f"{path}: {exc}") from None
            continue
        variable = names.get(key)
        if variable is None:
            raise ConfigError(
                f"{path}: unknown setting {key!r} (a key is a FURNACE_ variable's name without "
                "FURNACE_, in lower case, e.g. max_waiting)"
            )
        try:
            variables[variable] = _as_text(variable, value)
        except ValueError as exc:
            raise ConfigError(f"{path}: {key} {exc}") from None
    return FileSettings(variables, api_keys)


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """A configuration and where it came from: the file's keys that the environment
    overrides (``shadowed``, file key names)."""

    config: ServerConfig
    shadowed: tuple[str, ...] = ()


def load_config(environ: Mapping[str, str] | None = None) -> LoadedConfig:
    """The server's configuration: defaults < the ``FURNACE_CONFIG`` file < the environment.

    Raises :class:`ConfigError`; for a value from the file the message names the file and
    its key. Reads the file each time (a reload calls this again)."""
    environ = os.environ if environ is None else environ
    path_text = environ.get(CONFIG_VARIABLE, "").strip()
    if not path_text:
        return LoadedConfig(ServerConfig.from_env(environ))
    path = Path(path_text)
    settings = read_config_file(path)
    set_in_env = {name for name, value in environ.items() if value.strip()}
    merged = {**settings.variables, **{name: environ[name] for name in set_in_env}}
    by_variable = {variable: key for key, variable in setting_names().items()}
    try:
        config = ServerConfig.from_env(merged)
        config = dataclasses.replace(config, api_keys=settings.api_keys)
    except ConfigError as exc:
        message = str(exc)
        for variable in sorted(settings.variables, key=len, reverse=True):
            if variable in message and variable not in set_in_env:
                message = message.replace(variable, f"{by_variable[variable]} ({variable})")
                break
        raise ConfigError(f"{path}: {message}") from None
    shadowed = tuple(sorted(by_variable[v] for v in settings.variables if v in set_in_env))
    return LoadedConfig(config, shadowed)
