"""Sessions' histories, their turn locks and stored responses in Redis (or Valkey), shared
by replicas (``FURNACE_SESSION_STORE=redis://...``).

Blocking calls through the ``redis`` client: every method here runs in a worker thread
(:class:`~furnace_trio.server.shared_sessions.SharedSessions` calls them with
``trio.to_thread.run_sync``); the client's connection pool is thread-safe. Keys::

    furnace:session:<id>    JSON: the session's SharedHistory and its revision; expires
                            after the sessions' TTL, renewed by every commit
    furnace:lock:<id>       a random token while a turn of the session runs somewhere;
                            SET NX PX, so a replica that dies frees it within the lock TTL
    furnace:response:<id>   JSON: a stored response of the Responses API; same TTL

The lock is released and renewed only by the token that took it (a compare-and-delete
script in Redis), so a turn whose lock expired cannot free a later turn's lock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import redis

from furnace_trio.engine.sessions import SharedHistory
from furnace_trio.server.responses_store import StoredResponse

__all__ = ["RedisStore", "StoreUnavailable"]

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""

StoreUnavailable = redis.RedisError  # any failure to reach or use the store


class RedisStore:
    """The shared store's operations, each one blocking call (run them in a thread)."""

    def __init__(self, url: str, *, ttl_s: float, prefix: str = "furnace:") -> None:
        self._client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._prefix = prefix
        self._release = self._client.register_script(_RELEASE)
        self._renew = self._client.register_script(_RENEW)

    def ping(self) -> None:
        self._client.ping()

    def close(self) -> None:
        self._client.close()

    # -- turn locks ---------------------------------------------------------------------------

    def lock(self, session_id: str, token: str, ttl_ms: int) -> bool:
        """Take the session's turn lock; false when another turn holds it."""
        return bool(self._client.set(self._key("lock", session_id), token, nx=True, px=ttl_ms))

    def unlock(self, session_id: str, token: str) -> None:
        self._release(keys=[self._key("lock", session_id)], args=[token])

    def renew(self, session_id: str, token: str, ttl_ms: int) -> bool:
        """Extend a lock this token holds; false when it was lost (expired)."""
        return bool(self._renew(keys=[self._key("lock", session_id)], args=[token, ttl_ms]))

    # -- histories ----------------------------------------------------------------------------

    def load_session(self, session_id: str) -> tuple[SharedHistory, str] | None:
        """The session's history and revision, or ``None`` (never kept, expired, deleted)."""
        raw = self._client.get(self._key("session", session_id))
        if raw is None:
            return None
        data = json.loads(raw)
        history = SharedHistory(
            session_id=data["session_id"],
            owner=data["owner"],
            messages=tuple(data["messages"]),
            prompt_messages=tuple(data["prompt_messages"]),
            history_text=data["history_text"],
            history_ids=tuple(data["history_ids"]),
            rng_state=data["rng_state"],
            turns=data["turns"],
        )
        return history, data["revision"]

    def save_session(self, history: SharedHistory, revision: str) -> None:
        data = {
            "session_id": history.session_id,
            "owner": history.owner,
            "messages": [dict(m) for m in history.messages],
            "prompt_messages": [dict(m) for m in history.prompt_messages],
            "history_text": history.history_text,
            "history_ids": list(history.history_ids),
            "rng_state": history.rng_state,
            "turns": history.turns,
            "revision": revision,
        }
        key = self._key("session", history.session_id)
        self._client.set(key, json.dumps(data, separators=(",", ":")), px=self._ttl_ms)

    def delete_session(self, session_id: str) -> None:
        self._client.delete(self._key("session", session_id))

    # -- stored responses ---------------------------------------------------------------------

    def load_response(self, response_id: str) -> StoredResponse | None:
        raw = self._client.get(self._key("response", response_id))
        if raw is None:
            return None
        data: Mapping[str, Any] = json.loads(raw)
        return StoredResponse(
            response_id=data["response_id"],
            owner=data["owner"],
            body=data["body"],
            input_items=tuple(data["input_items"]),
            session_id=data["session_id"],
            turns=data["turns"],
            messages=data["messages"],
            calls=frozenset(data["calls"]),
            last_used=0.0,
        )

    def save_response(self, record: StoredResponse) -> None:
        data = {
            "response_id": record.response_id,
            "owner": record.owner,
            "body": record.body,
            "input_items": [dict(item) for item in record.input_items],
            "session_id": record.session_id,
            "turns": record.turns,
            "messages": record.messages,
            "calls": sorted(record.calls),
        }
        key = self._key("response", record.response_id)
        self._client.set(key, json.dumps(data, separators=(",", ":")), px=self._ttl_ms)

    def delete_response(self, response_id: str) -> None:
        self._client.delete(self._key("response", response_id))

    def _key(self, kind: str, name: str) -> str:
        return f"{self._prefix}{kind}:{name}"
