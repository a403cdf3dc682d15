"""API keys with names: which key a request presented, its concurrency limit, its metrics.

A server has no key (open), the single key of ``FURNACE_API_KEY`` (named
:data:`UNNAMED_KEY`), the named keys of its config file (``[[api_keys]]``, see
:mod:`furnace_trio.server.config_file`), or both. A request that presents one of them is
served under that key's *name*: the name, never the key, is what the request log line,
``/status`` and ``/metrics`` show. A key with ``max_concurrent`` has at most that many
requests in flight at once; one more is a 429 ``rate_limit_error`` with ``Retry-After``.

Keys are compared in constant time, every one of them whatever matched, through their
SHA-256 digests (so keys of different lengths take the same time too).

:class:`KeyUsage` is the server's running account per key name (requests in flight,
responses by status, which engine requests belong to which name), touched only on the
Trio thread.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from furnace_trio.server.errors import APIError

__all__ = [
    "UNNAMED_KEY",
    "APIKey",
    "KeyUsage",
    "accepted_keys",
    "match_key",
    "parse_api_keys",
    "render_key_metrics",
]

#: The name of ``FURNACE_API_KEY`` (or the file's ``api_key``): the key without a name.
UNNAMED_KEY = "default"
#: Key names: safe in a log line and a Prometheus label as they are.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: Seconds a client refused by its key's ``max_concurrent`` is told to wait.
RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class APIKey:
    """One accepted key: its ``name`` (what logs, ``/status`` and ``/metrics`` show), the
    secret ``key`` (never in a repr), and at most ``max_concurrent`` requests in flight
    (``None``: no limit of its own)."""

    name: str
    key: str = field(repr=False)
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        if not NAME_PATTERN.fullmatch(self.name):
            raise ValueError(
                f"API key name {self.name!r}: 1 to 64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        if not self.key or self.key != self.key.strip():
            raise ValueError(f"API key {self.name!r}: the key is empty or has spaces around it")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"API key {self.name!r}: max_concurrent must be at least 1")


def accepted_keys(api_key: str | None, api_keys: Iterable[APIKey]) -> tuple[APIKey, ...]:
    """Every key the server accepts: ``api_key`` as :data:`UNNAMED_KEY`, then the named
    ones. Raises ``ValueError`` when two share a name or a key."""
    unnamed = (APIKey(UNNAMED_KEY, api_key),) if api_key is not None else ()
    keys = (*unnamed, *api_keys)
    names: set[str] = set()
    digests: dict[bytes, str] = {}
    for entry in keys:
        if entry.name in names:
            hint = " (the name of FURNACE_API_KEY)" if entry.name == UNNAMED_KEY else ""
            raise ValueError(f"two API keys are named {entry.name!r}{hint}")
        names.add(entry.name)
        digest = _digest(entry.key)
        if digest in digests:
            raise ValueError(f"the API keys {digests[digest]!r} and {entry.name!r} are the same")
        digests[digest] = entry.name
    return keys


def match_key(keys: Iterable[APIKey], token: str) -> APIKey | None:
    """The key ``token`` is, or ``None``; every key is compared, in constant time."""
    given = _digest(token)
    found = None
    for entry in keys:
        if hmac.compare_digest(given, _digest(entry.key)) and found is None:
            found = entry
    return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_api_keys(entries: object, where: str = "api_keys") -> tuple[APIKey, ...]:
    """The ``[[api_keys]]`` tables of a config file: ``name``, ``key`` and optionally
    ``max_concurrent`` each. ``ValueError`` names the entry and what is wrong with it."""
    if not isinstance(entries, list):
        raise ValueError(f"{where} must be an array of tables ([[api_keys]])")
    keys = []
    for index, entry in enumerate(entries):
        at = f"{where}[{index}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at} must be a table with name and key")
        unknown = sorted(set(entry) - {"name", "key", "max_concurrent"})
        if unknown:
            raise ValueError(f"{at}: unknown field {unknown[0]!r} (name, key, max_concurrent)")
        name, key, limit = entry.get("name"), entry.get("key"), entry.get("max_concurrent")
        if not isinstance(name, str) or not isinstance(key, str):
            raise ValueError(f"{at}: name and key must both be strings")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
            raise ValueError(f"{at}: max_concurrent must be an integer")
        try:
            keys.append(APIKey(name, key, limit))
        except ValueError as exc:
            raise ValueError(f"{at}: {exc}") from None
    return tuple(keys)


@dataclass(slots=True)
class KeyUsage:
    """Requests per key name: in flight now, answered by status, and the engine request
    ids each HTTP request submitted (for ``/status``)."""

    in_flight: Counter[str] = field(default_factory=Counter)
    responses: Counter[tuple[str, int]] = field(default_factory=Counter)
    request_names: dict[str, str] = field(default_factory=dict)

    def enter(self, key: APIKey) -> None:
        """Count a request of ``key`` in flight, or raise the 429 of its ``max_concurrent``."""
        if key.max_concurrent is not None and self.in_flight[key.name] >= key.max_concurrent:
            raise APIError(
                429,
                f"The API key {key.name!r} has {self.in_flight[key.name]} requests in "
                f"flight, its limit ({key.max_concurrent}). Retry when one has finished.",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.in_flight[key.name] += 1

    def leave(self, name: str) -> None:
        self.in_flight[name] -= 1
        if self.in_flight[name] <= 0:
            del self.in_flight[name]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_key_metrics(usage: KeyUsage, names: Iterable[str] = ()) -> str:
    """``/metrics`` lines per key name: responses by status (counter) and requests in flight
    (gauge, 0 for every configured key in ``names`` that has none)."""
    lines = [
        "# HELP furnace_api_key_responses_total HTTP responses by API key name and status.",
        "# TYPE furnace_api_key_responses_total counter",
    ]
    for (name, status), count in sorted(usage.responses.items()):
        lines.append(
            f'furnace_api_key_responses_total{{key="{_label(name)}",status="{status}"}} {count}'
        )
    lines.append("# HELP furnace_api_key_requests_in_flight Requests in flight by API key name.")
    lines.append("# TYPE furnace_api_key_requests_in_flight gauge")
    counts: Mapping[str, int] = {**dict.fromkeys(names, 0), **usage.in_flight}
    for name, count in sorted(counts.items()):
        lines.append(f'furnace_api_key_requests_in_flight{{key="{_label(name)}"}} {count}')
    return "\n".join(lines) + "\n"
