"""The sampling defaults a model ships: ``generation_config.json`` beside a Hugging Face
directory, or the ``general.sampling.*`` keys of a GGUF file.

The server applies them to every field a request leaves unset (the request's own values
win), as vLLM does with ``--generation-config auto``: a model whose authors recommend
temperature 0.6 should not be sampled at OpenAI's 1.0 by a client that never thought about
it. Only the samplers this server implements are read (temperature, top-p, top-k, min-p and
the repetition penalty); HF's ``do_sample`` is not consulted, as in vLLM. A value of the
wrong type or out of range is logged and ignored: a model file's slip should not stop the
server, nor reach the sampler.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

__all__ = [
    "GGUF_SAMPLING_KEYS",
    "NO_GENERATION_DEFAULTS",
    "GenerationDefaults",
    "from_generation_config",
    "from_gguf_metadata",
    "read_generation_config",
]

logger = logging.getLogger(__name__)

#: ``GenerationDefaults`` field -> ``generation_config.json`` key.
HF_KEYS: Mapping[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
#: ``GenerationDefaults`` field -> GGUF metadata key, as llama.cpp's ``gguf`` package
#: names them (``gguf.Keys.General.SAMPLING_*``, written by ``convert_hf_to_gguf.py``).
GGUF_SAMPLING_KEYS: Mapping[str, str] = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling defaults from the model; ``None`` means the model has no opinion (the
    server then uses OpenAI's default). ``source`` says where they came from, for the
    startup log and ``/v1/models``. ``top_k`` 0 means "no top-k filter"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str | None = None

    def as_dict(self) -> dict[str, float | int]:
        """The fields that are set, by name (``source`` left out)."""
        return {
            f.name: value
            for f in fields(self)
            if f.name != "source" and (value := getattr(self, f.name)) is not None
        }


#: A model that ships none: every knob falls back to OpenAI's default.
NO_GENERATION_DEFAULTS = GenerationDefaults()


def _number(value: object, check: Callable[[float], bool]) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and check(number) else None


def _integer(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value) if value >= 0 else None


_CHECKS: Mapping[str, Callable[[object], float | int | None]] = {
    "temperature": lambda v: _number(v, lambda x: 0 <= x <= 2),
    "top_p": lambda v: _number(v, lambda x: 0 < x <= 1),
    "top_k": _integer,
    "min_p": lambda v: _number(v, lambda x: 0 <= x <= 1),
    "repetition_penalty": lambda v: _number(v, lambda x: x > 0),
}


def _read(values: Mapping[str, object], keys: Mapping[str, str], source: str) -> GenerationDefaults:
    found: dict[str, float | int] = {}
    for name, key in keys.items():
        if key not in values:
            continue
        value = _CHECKS[name](values[key])
        if value is None:
            logger.warning("%s: ignoring %s = %r (not a valid %s)", source, key, values[key], name)
            continue
        found[name] = value
    return GenerationDefaults(**found, source=source if found else None)  # type: ignore[arg-type]


def from_generation_config(config: Mapping[str, object], source: str) -> GenerationDefaults:
    """The defaults in a decoded ``generation_config.json``."""
    return _read(config, HF_KEYS, source)


def read_generation_config(directory: Path) -> GenerationDefaults:
    """The defaults in ``directory/generation_config.json``; none when it is absent or not
    a JSON object (logged: many models ship one that only names token ids)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        logger.warning("%s: unreadable (%s); no generation defaults", path, exc)
        return GenerationDefaults()
    if not isinstance(config, dict):
        logger.warning("%s: not a JSON object; no generation defaults", path)
        return GenerationDefaults()
    return from_generation_config(config, str(path.name))


def from_gguf_metadata(metadata: Mapping[str, object]) -> GenerationDefaults:
    """The defaults in a GGUF file's ``general.sampling.*`` metadata."""
    return _read(metadata, GGUF_SAMPLING_KEYS, "GGUF general.sampling")
