"""How the server's log lines look: a timestamped line for a person, or one JSON object a
line for a log collector (``FURNACE_LOG_FORMAT=json``).

:func:`configure_logging` runs at startup. It installs one handler on the root logger,
unless the process already has one (an application embedding the app, or pytest, keeps
its own). Hypercorn's error logger, which says "Running on ...", propagates to that
handler: ``hypercorn.toml`` takes hypercorn's own handler off it, and
``python -m furnace_trio.server.serve`` hands hypercorn the logger itself, so each line is
written once and in one format. Hypercorn's access lines (``127.0.0.1:5000 - - [...]``)
are not written: each generation request has its own line, with its token counts
(:mod:`furnace_trio.server.request_log`).

A record may carry ``fields`` (``logger.info(..., extra={"fields": {...}})``): the JSON
format writes them as keys of the line's object, so a collector reads numbers, not text.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

#: The attribute of a :class:`logging.LogRecord` that holds its structured fields.
FIELDS = "fields"


def timestamp(record: logging.LogRecord) -> str:
    """The record's time in UTC, ISO 8601 with milliseconds (sorts as text, no time zone
    to guess)."""
    moment = datetime.fromtimestamp(record.created, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class TextFormatter(logging.Formatter):
    """``2026-12-05T12:42:47.123Z INFO furnace_trio.server.request_log: request ...``"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return timestamp(record)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time``, ``level``, ``logger``, ``message``, the record's
    ``fields``, and ``exception`` (the traceback as text) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):
            line.update((key, value) for key, value in fields.items() if key not in line)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = record.stack_info
        return json.dumps(line, ensure_ascii=False, default=str)


def formatter(log_format: str) -> logging.Formatter:
    """The formatter of ``FURNACE_LOG_FORMAT`` (``text`` or ``json``)."""
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return TextFormatter()
    raise ValueError(f"unknown log format {log_format!r}")


def configure_logging(level: str, log_format: str) -> None:
    """Set the package's level; give the root logger a handler on stderr in ``log_format``
    unless it has one (an embedding application's or pytest's handlers are left alone)."""
    logging.getLogger("furnace_trio").setLevel(level)
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    root.addHandler(handler)
    root.setLevel(level)
