"""The cache of built libraries: each file sealed by its build and checked before loading.

Loading a truncated shared library (a full disk, a crash before the data reached the
disk) dies of SIGBUS inside ``dlopen``, with no log line, on every start. So each build
ends its file with a trailer (:func:`seal`: a magic string, the length of what precedes
and its blake2b digest; the dynamic loader ignores bytes past what the ELF headers name,
as it does for signed kernel modules), fsynced before the file is renamed into place,
and :func:`cache_problem` checks it before the library is loaded. Temporary files that a
killed build left behind are removed once they are older than any build can take
(:func:`remove_stale_temporaries`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from pathlib import Path

__all__ = [
    "BUILD_TIMEOUT_S",
    "MAGIC",
    "STALE_TEMPORARY_S",
    "TEMPORARY_SUFFIX",
    "cache_problem",
    "remove_stale_temporaries",
    "seal",
]

logger = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 300
#: A temporary build file older than this was left by a build that did not finish.
STALE_TEMPORARY_S = 2 * BUILD_TIMEOUT_S
#: How a build's temporary file ends (``tmp*.so`` are an older version's).
TEMPORARY_SUFFIX = ".so.tmp"
#: Starts the trailer; part of the build key too, so unsealed files of older versions
#: are never looked at.
MAGIC = b"furnace-kernels1"
# magic, the length of what precedes the trailer, its digest
_TRAILER = struct.Struct("<16sQ16s")


def seal(path: Path) -> None:
    """Append the trailer that :func:`cache_problem` checks, and flush it to the disk."""
    body = path.read_bytes()
    digest = hashlib.blake2b(body, digest_size=16).digest()
    with path.open("ab") as file:
        file.write(_TRAILER.pack(MAGIC, len(body), digest))
        file.flush()
        os.fsync(file.fileno())


def cache_problem(path: Path) -> str | None:
    """Why the cached library at ``path`` must not be loaded; ``None`` when it is whole."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"unreadable ({exc})"
    if len(data) < _TRAILER.size:
        return f"truncated ({len(data)} bytes)"
    magic, length, digest = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
    if magic != MAGIC or length != len(data) - _TRAILER.size:
        return f"truncated or not written by a finished build ({len(data)} bytes, no trailer)"
    if hashlib.blake2b(data[:length], digest_size=16).digest() != digest:
        return "corrupt (its digest does not match)"
    return None


def remove_stale_temporaries(directory: Path) -> None:
    """Remove what builds killed midway left (``tmp*.so`` from older versions too)."""
    now = time.time()
    for pattern in (f"*{TEMPORARY_SUFFIX}", "tmp*.so"):
        for path in directory.glob(pattern):
            try:
                if now - path.stat().st_mtime > STALE_TEMPORARY_S:
                    path.unlink()
                    logger.info("native kernels: removed %s, left by an unfinished build", path)
            except OSError:
                pass  # another process removed it first
