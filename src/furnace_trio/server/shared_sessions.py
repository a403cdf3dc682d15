"""Sessions shared by replicas through a store (``FURNACE_SESSION_STORE=redis://...``).

Each replica keeps its sessions in its engine as always (history, pinned KV, RNG); the
store keeps what outlives a replica: every committed history (with a revision), the turn
locks, and the Responses API's stored responses. The KV stays local. A turn runs as::

    lock(session)          SET NX PX in the store: another replica's turn in flight -> 409
    sync(session)          the store's revision differs from the one this replica last
                           saw (another replica committed since, or this one never held
                           the session): adopt the store's history, without pins
    engine.begin_turn      the turn recomputes what it does not find in the prefix cache
    ...                    the reply is generated and committed locally
    finish(turn)           save the committed history under a new revision, then unlock;
                           awaited before the response's last event, so the next turn,
                           on whichever replica, finds it

A turn that fails or is cancelled commits nothing; the keeper task (:meth:`serve`) notices
it ended and unlocks, within :data:`KEEP_INTERVAL_S`. While a turn runs the keeper renews
its lock every third of :data:`LOCK_TTL_S`; a replica that dies holding a lock frees it
when the TTL runs out. Every store call runs in a worker thread (the ``redis`` client
blocks; its asyncio API does not run under Trio), limited to :data:`STORE_THREADS` at
once.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from furnace_trio.engine.sessions import (
    SessionBusy,
    SessionNotFound,
    SharedHistory,
    Turn,
    TurnState,
)
from furnace_trio.server.errors import APIError
from furnace_trio.server.redis_store import RedisStore, StoreUnavailable
from furnace_trio.server.responses_store import StoredResponse

if TYPE_CHECKING:
    from furnace_trio.engine import Engine

__all__ = ["LOCK_TTL_S", "SharedSessions"]

logger = logging.getLogger(__name__)

#: How long a turn lock outlives the last renewal (a dead replica's turn frees it then).
LOCK_TTL_S = 15.0
#: How often the keeper looks for ended turns (their locks are freed then).
KEEP_INTERVAL_S = 0.25
STORE_THREADS = 8

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class _Held:
    """A turn lock this replica holds: the turn it guards, and the session's turn count
    when it began (more once committed)."""

    turn: Turn
    token: str
    turns_before: int
    renewed_at: float
    settling: trio.Event | None = None  # set once the settling in progress is done


class SharedSessions:
    """The replica's side of the shared store; one per app. See the module docstring."""

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self._limiter = trio.CapacityLimiter(STORE_THREADS)
        self._held: dict[str, _Held] = {}
        self._revisions: dict[str, str] = {}  # the revision each local copy is at
        self._scope: trio.CancelScope | None = None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await trio.to_thread.run_sync(partial(fn, *args), limiter=self._limiter)
        except StoreUnavailable as exc:
            logger.error("session store: %s", exc)
            raise APIError(
                503,
                f"The session store is unavailable: {exc}",
                code="session_store_unavailable",
                headers={"Retry-After": "1"},
            ) from None

    async def check(self) -> None:
        """Raise unless the store answers (at startup)."""
        await trio.to_thread.run_sync(self._store.ping)

    # -- turns ----------------------------------------------------------------------------------

    async def begin_turn(
        self, engine: Engine, session_id: str, owner: str, messages: Sequence[Mapping[str, Any]]
    ) -> Turn:
        """Lock, sync and begin a turn (``SessionBusy``, ``SessionNotFound``,
        ``ValueError`` as :meth:`Engine.begin_turn`). :meth:`finish` ends it."""
        if not session_id or len(session_id) > 256:
            raise ValueError("a session id has 1 to 256 characters")
        token = await self.lock(session_id)
        try:
            await self.sync(engine, session_id, owner)
            turn = engine.begin_turn(session_id, owner, messages)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.unlock(session_id, token)
            raise
        self.hold(turn, token)
        return turn

    async def lock(self, session_id: str) -> str:
        """Take the session's turn lock (its token); :class:`SessionBusy` when taken."""
        token = uuid.uuid4().hex
        ttl_ms = int(LOCK_TTL_S * 1000)
        if not await self._call(self._store.lock, session_id, token, ttl_ms):
            raise SessionBusy(f"session {session_id!r} has a turn in flight")
        return token

    async def unlock(self, session_id: str, token: str) -> None:
        with contextlib.suppress(APIError):
            await self._call(self._store.unlock, session_id, token)

    def hold(self, turn: Turn, token: str) -> None:
        """``turn`` runs under the lock ``token``: renew it until the turn finishes."""
        self._held[turn.session_id] = _Held(
            turn, token, turn.session.turns, renewed_at=trio.current_time()
        )

    async def sync(self, engine: Engine, session_id: str, owner: str) -> None:
        """Make the local copy of a session the store's: adopt its history when its
        revision is not the one this replica last saw; drop a local copy the store no
        longer has (it expired or was deleted through another replica)."""
        loaded = await self._call(self._store.load_session, session_id)
        local = self._revisions.get(session_id)
        if loaded is None:
            if local is not None:
                self._revisions.pop(session_id, None)
                with contextlib.suppress(SessionNotFound, SessionBusy):
                    engine.delete_session(session_id, owner)
            return
        history, revision = loaded
        if history.owner != owner:
            raise SessionNotFound(f"no session {session_id!r}")
        try:
            engine.get_session(session_id, owner)
            present = True
        except SessionNotFound:
            present = False
        if present and local == revision:
            return
        logger.info("session %s: adopting turn %d from the store", session_id, history.turns)
        try:
            engine.adopt_session(history)
        except SessionBusy:
            return  # a turn of the local copy runs (a read while it does): keep it
        self._revisions[session_id] = revision

    async def finish(self, turn: Turn) -> None:
        """The turn's reply is complete: save the history if it committed, then unlock."""
        held = self._held.get(turn.session_id)
        if held is None or held.turn is not turn:
            return
        await self._settle(held)

    async def _settle(self, held: _Held) -> None:
        if held.settling is not None:
            await held.settling.wait()  # the other caller saved (or will retry)
            return
        held.settling = trio.Event()
        try:
            await self._save_and_unlock(held)
        finally:
            held.settling.set()
            held.settling = None

    async def _save_and_unlock(self, held: _Held) -> None:
        session = held.turn.session
        if session.turns > held.turns_before:
            revision = uuid.uuid4().hex
            await self._call(self._store.save_session, SharedHistory.of(session), revision)
            self._revisions[session.session_id] = revision
            held.turns_before = session.turns
        if self._held.get(session.session_id) is held:
            del self._held[session.session_id]
        await self.unlock(session.session_id, held.token)

    async def delete(self, engine: Engine, session_id: str, owner: str) -> None:
        """Forget a session here and in the store (``SessionBusy``, ``SessionNotFound``)."""
        token = await self.lock(session_id)
        try:
            await self.sync(engine, session_id, owner)
            engine.delete_session(session_id, owner)
            await self._call(self._store.delete_session, session_id)
            self._revisions.pop(session_id, None)
        finally:
            with trio.CancelScope(shield=True):
                await self.unlock(session_id, token)

    # -- stored responses -----------------------------------------------------------------------

    async def put_response(self, record: StoredResponse) -> None:
        await self._call(self._store.save_response, record)

    async def get_response(self, response_id: str) -> StoredResponse | None:
        return await self._call(self._store.load_response, response_id)

    async def delete_response(self, response_id: str) -> None:
        await self._call(self._store.delete_response, response_id)

    # -- the keeper -----------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Renew the locks of turns in flight; save and unlock turns that ended without
        :meth:`finish` (failed, cancelled, or their client left during the save). Runs
        until :meth:`stop`."""
        with trio.CancelScope() as self._scope:
            task_status.started()
            while True:
                await trio.sleep(KEEP_INTERVAL_S)
                await self._keep(trio.current_time())

    async def _keep(self, now: float) -> None:
        ttl_ms = int(LOCK_TTL_S * 1000)
        for held in list(self._held.values()):
            try:
                if held.turn.state is TurnState.ENDED:
                    await self._settle(held)
                elif now - held.renewed_at >= LOCK_TTL_S / 3:
                    held.renewed_at = now
                    sid = held.turn.session_id
                    if not await self._call(self._store.renew, sid, held.token, ttl_ms):
                        logger.warning("session %s: its turn lock expired", sid)
            except APIError:
                pass  # logged by _call; tried again next round

    async def stop(self) -> None:
        """Settle the turns that ended (the server drained), stop the keeper, close."""
        with trio.move_on_after(5), trio.CancelScope(shield=True):
            await self._keep(trio.current_time())
        if self._scope is not None:
            self._scope.cancel()
        self._store.close()
