"""The ASGI app users serve: ``hypercorn -c hypercorn.toml furnace_trio.app:app``.

The app itself lives in :mod:`furnace_trio.server.app`; this module is the stable name.
Importing it (what each hypercorn worker does before serving) patches hypercorn's Trio
worker to drain on SIGTERM and SIGINT and to bound writes at shutdown
(:mod:`furnace_trio.server.hypercorn_patch`; only for the hypercorn version it was
written against).
"""

from furnace_trio.server.app import app
from furnace_trio.server.hypercorn_patch import install

install()

__all__ = ["app"]
