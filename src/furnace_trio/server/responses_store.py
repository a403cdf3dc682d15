"""Stored responses (``store: true``): what ``GET /v1/responses/{id}`` and its
``input_items`` return, and where a ``previous_response_id`` continues.

Plain Python, touched only on the Trio thread; the caller passes the time in. A record
keeps the finished response object, its input items, and its place in the conversation
the engine keeps as a session (:mod:`~furnace_trio.server.responses_sessions`): the
session's id, and how many turns and messages the session held once this response was
committed to it. Records are bounded like sessions: idle ones expire after the sessions'
TTL, and beyond ``max_records`` the least recently used goes. A record is seen only by
the owner (API key digest) that created it; for anyone else it does not exist.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ResponseNotFound(Exception):
    """Unknown, expired, deleted, or another owner's: HTTP 404."""


@dataclass(slots=True, eq=False)
class StoredResponse:
    """A finished response and where its conversation stands.

    ``session_id`` is ``None`` when the response cannot be continued (it failed, or its
    turn was not committed); ``turns`` and ``messages`` are the session's counts right
    after this response joined it; ``calls`` are the call ids of every function call in
    its conversation (a ``function_call_output`` must answer one of them).
    """

    response_id: str
    owner: str
    body: Mapping[str, Any]
    input_items: tuple[Mapping[str, Any], ...]
    session_id: str | None
    turns: int
    messages: int
    calls: frozenset[str]
    last_used: float


class ResponseStore:
    """Every stored response by id, least recently used first."""

    def __init__(self, *, ttl_s: float, max_records: int) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        if max_records < 1:
            raise ValueError("max_records must be at least 1")
        self.ttl_s = ttl_s
        self.max_records = max_records
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def put(self, record: StoredResponse, now: float) -> None:
        self.expire(now)
        record.last_used = now
        self._records[record.response_id] = record
        self._records.move_to_end(record.response_id)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)

    def get(self, response_id: str, owner: str, now: float) -> StoredResponse:
        """The record (now the most recently used), or :class:`ResponseNotFound`."""
        self.expire(now)
        record = self._records.get(response_id)
        if record is None or record.owner != owner:
            raise ResponseNotFound(response_id)
        record.last_used = now
        self._records.move_to_end(response_id)
        return record

    def delete(self, response_id: str, owner: str, now: float) -> StoredResponse:
        record = self.get(response_id, owner, now)
        del self._records[response_id]
        return record

    def references(self, session_id: str) -> bool:
        """Whether any record continues in ``session_id``."""
        return any(r.session_id == session_id for r in self._records.values())

    def expire(self, now: float) -> int:
        """Drop records idle for longer than the TTL; how many."""
        gone = 0
        while self._records:
            oldest = next(iter(self._records.values()))  # least recently used first
            if now - oldest.last_used <= self.ttl_s:
                break
            del self._records[oldest.response_id]
            gone += 1
        return gone
