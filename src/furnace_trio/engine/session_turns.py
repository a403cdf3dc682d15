"""The engine's side of sessions: which request runs which session turn, and its pins.

:class:`~furnace_trio.engine.sessions.SessionStore` keeps the sessions themselves (history,
pinned KV, expiry). A turn's request, once it finishes naturally, leaves its KV pinned
(:class:`~furnace_trio.engine.kv_cache_manager.KeptKV`); :meth:`SessionTurns.commit` hands
those pins and the reply to the store (the reply comes from whoever consumes the request's
stream: only it knows what the client received, tool calls and their ids included), and :meth:`SessionTurns.end` always closes the
turn, dropping pins nobody committed. So a turn that is cancelled or fails leaves its
session exactly as it was. Every call is synchronous and never awaits (safe in
``finally`` blocks and under cancellation); times come from ``trio.current_time()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from furnace_trio.engine.kv_cache_manager import KeptKV, KVCacheManager
from furnace_trio.engine.sessions import Session, SessionReply, SessionStore, Turn, TurnState

__all__ = ["SessionTurns"]


@dataclass(slots=True, eq=False)
class _TurnRun:
    """A session turn's request: the seed it samples with and, once it finished, its pins."""

    turn: Turn
    seed: int | None
    kept: KeptKV | None = None


class SessionTurns:
    """The session store, and each request's open turn until the turn ends."""

    def __init__(
        self,
        store: SessionStore,
        kv: KVCacheManager,
        pop_kept: Callable[[str], KeptKV | None],
        decode: Callable[[Sequence[int]], str],
    ) -> None:
        self.store = store
        self._decode = decode  # the engine's: what a reply's token ids read as
        self._kv = kv
        self._pop_kept = pop_kept  # the pins a finished keep_kv request left (the scheduler's)
        self._runs: dict[str, _TurnRun] = {}  # by request id, until the turn ends

    def __len__(self) -> int:
        """Turns whose request has not ended."""
        return len(self._runs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._runs

    def session_of(self, request_id: str) -> str | None:
        """The session whose turn ``request_id`` runs, if any."""
        run = self._runs.get(request_id)
        return None if run is None else run.turn.session.session_id

    def begin(self, session_id: str, owner: str, new_messages: Sequence[Mapping[str, Any]]) -> Turn:
        """Start a session turn (creating the session); raises ``SessionBusy``,
        ``SessionNotFound`` or ``ValueError``. The caller must :meth:`end` it."""
        return self.store.begin_turn(session_id, owner, new_messages, trio.current_time())

    def start(self, turn: Turn, request_id: str, seed: int | None) -> int | None:
        """``request_id`` runs ``turn``: the seed it samples with (the session's, unless the
        request chose one)."""
        seed = self.store.seed_for(turn, seed)
        turn.request_id = request_id
        self._runs[request_id] = _TurnRun(turn, seed)
        return seed

    def finished(self, request_id: str) -> None:
        """The turn's request finished naturally: take the pins it left."""
        run = self._runs.get(request_id)
        if run is not None:
            run.kept = self._pop_kept(request_id)

    def commit(self, turn: Turn, reply: SessionReply) -> bool:
        """Append the finished turn and its ``reply`` to the session, with the KV its
        request pinned. ``False`` (nothing changed) unless its request finished."""
        run = self._runs.get(turn.request_id or "")
        if run is None or run.kept is None or turn.state is not TurnState.OPEN:
            return False
        kept, run.kept = run.kept, None
        self.store.commit(
            turn,
            reply,
            token_ids=kept.token_ids,
            blocks=kept.blocks,
            output_token_ids=kept.output_token_ids,
            seed=run.seed,
            now=trio.current_time(),
            reply_exact=self._decode(kept.output_token_ids) == reply.text,
        )
        return True

    def end(self, turn: Turn) -> None:
        """Free the session for its next turn; uncommitted pins are dropped. Idempotent."""
        run = self._runs.pop(turn.request_id or "", None)
        if run is not None:
            kept = run.kept or self._pop_kept(turn.request_id or "")
            if kept is not None:
                self._kv.unpin(kept.blocks)
        self.store.end_turn(turn, trio.current_time())

    def end_for(self, request_id: str) -> None:
        """End the turn ``request_id`` runs, if any (its request was aborted)."""
        run = self._runs.get(request_id)
        if run is not None:
            self.end(run.turn)

    def get(self, session_id: str, owner: str) -> Session:
        return self.store.get(session_id, owner, trio.current_time())

    def delete(self, session_id: str, owner: str) -> None:
        self.store.delete(session_id, owner, trio.current_time())

    def reclaim(self, num_blocks: int) -> None:
        """Admission is ``num_blocks`` short: drop expired sessions, then pins."""
        self.store.expire(trio.current_time())
        self.store.reclaim(num_blocks)
