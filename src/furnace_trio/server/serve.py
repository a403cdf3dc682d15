"""``python -m furnace_trio.server.serve``: hypercorn with a graceful drain on SIGTERM/SIGINT.

Hypercorn calls the app's ``after_serving`` only after its own graceful period, once every
connection is closed, and cancels the connections still open when that period ends: a
stream cut that way ends without an error event. Here the signal first runs the app's
drain (:func:`furnace_trio.server.app.drain`: 503 for new requests, requests in flight finish or
end with an error), and only then tells hypercorn to stop. Keep hypercorn's
``graceful_timeout`` a few seconds, for the last bytes of responses already finished.

One process (no hypercorn worker processes), so the signals reach it and
``FURNACE_EXIT_ON_ENGINE_FAILURE`` exits with the status a supervisor sees.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Sequence

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from furnace_trio.server.app import app, drain_then
from furnace_trio.server.lifecycle import signalled


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m furnace_trio.server.serve", description=__doc__
    )
    parser.add_argument("-c", "--config", help="a hypercorn TOML file (hypercorn.toml)")
    parser.add_argument("-b", "--bind", action="append", help="address to bind (repeatable)")
    args = parser.parse_args(argv)
    config = Config.from_toml(args.config) if args.config else Config()
    if args.bind:
        config.bind = args.bind
    if config.errorlog == "-":
        # hypercorn's records ("Running on ...") go to the app's handler, once and in its
        # format (furnace_trio.server.log_setup), rather than to a handler of hypercorn's own
        config.errorlog = logging.getLogger("hypercorn.error")
    trigger = drain_then(app, signalled)
    trio.run(functools.partial(serve, app, config, shutdown_trigger=trigger))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
