"""The HTTP layer: an OpenAI-compatible quart-trio app over the engine.

What users import: :func:`create_app` (an app over a :class:`ServerConfig`, or over the
``FURNACE_*`` environment when given none) and :class:`ServerConfig`. ``create_app`` is
imported on first use, so that importing a light module of this package (the config, the
request validators) does not import Quart and build the served app.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from furnace_trio.server.config import ServerConfig

if TYPE_CHECKING:
    from furnace_trio.server.app import create_app

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from furnace_trio.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
