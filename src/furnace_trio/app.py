"""The ASGI app users serve: ``hypercorn -c hypercorn.toml furnace_trio.app:app``.

The app itself lives in :mod:`furnace_trio.server.app`; this module is the stable name.
"""

from furnace_trio.server.app import app

__all__ = ["app"]
