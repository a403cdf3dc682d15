"""What a setting of :class:`~furnace_trio.server.config.ServerConfig` is to a person: its
``FURNACE_*`` variable, what it does, and how its default reads.

Each field of ``ServerConfig`` carries its :class:`Setting` records as dataclass field
metadata, next to its type and default, and ``docs/configuration.md`` is rendered from them
(:mod:`furnace_trio.server.reference_docs`), so the manual lists exactly the settings the
code reads. A field read from several variables (the native kernels' build) carries one
record per variable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The metadata key under which a field keeps its settings.
METADATA_KEY = "furnace_settings"


@dataclass(frozen=True, slots=True)
class Setting:
    """One environment variable. ``default`` is how the default reads in the manual;
    ``None``: rendered from the field's default value."""

    env: str
    doc: str
    default: str | None = None
    #: Only the config file (``FURNACE_CONFIG``) sets it; ``env`` is then its key there.
    file_only: bool = False


def setting(
    env: str, doc: str, *, shown: str | None = None, file_only: bool = False
) -> Mapping[str, Any]:
    """The metadata of a field read from the variable ``env``, for
    ``dataclasses.field(default=..., metadata=setting(...))``; ``shown`` is how the manual
    states the default where the value alone would mislead (``None`` fields that the backend
    fills in by device). ``file_only``: no variable sets it, only the config file, where
    ``env`` is its key."""
    return {METADATA_KEY: (Setting(env, doc, shown, file_only),)}


def settings(*records: Setting) -> Mapping[str, Any]:
    """The metadata of a field built from several variables, one :class:`Setting` each."""
    return {METADATA_KEY: records}


def settings_of(field: dataclasses.Field[Any]) -> tuple[Setting, ...]:
    """The settings a field is read from; ``()`` for a field without any (an omission that
    ``tests/server/test_reference_docs.py`` reports)."""
    return tuple(field.metadata.get(METADATA_KEY, ()))
