"""Sessions: a conversation's history, pinned KV and sampler state kept between turns.

Plain Python (no Trio, no torch): the engine owns one :class:`SessionStore` and passes the
time in (``trio.current_time()``, so tests can use ``autojump_clock``). A session holds::

    messages         the conversation as the client sees it: its messages, and each reply
                     as the client received it (content, tool calls with their ids)
    prompt_messages  the same conversation as the chat template renders it for the model:
                     each reply is the text the model generated (tool-call markup and all)
    history_text     what the conversation so far renders to, and the exact token ids the
    history_ids      model read and wrote for it (see "Two views of a reply" below)
    token_ids        the tokens whose KV the session pins (full blocks only)
    blocks           one reference to each of those KV blocks, so the prefix cache cannot
                     evict them; the next turn's prefix lookup finds them like any cached block
    rng_state        a 64-bit sampler state: a seeded turn samples with a seed derived from
                     (request seed, rng_state), and a committed turn advances it, so a seeded
                     conversation replayed from scratch yields the same text every turn

A turn (:class:`Turn`) is the only way to change a session, and it changes it only when it
commits: a cancelled or failed turn leaves messages, tokens, pins and RNG exactly as they
were. One turn at a time (:class:`SessionBusy`, HTTP 409).

Two views of a reply. What the client received (a ``tool_calls`` list with ids, arguments
re-serialised, the content around the calls) cannot be rendered back into the tokens the
model generated: the template's own tool-call format, JSON spacing, key order and the
whitespace around the markup all differ, and even plain text may tokenize differently
from how it was sampled. So the display view (``messages``, what ``GET /v1/sessions``
shows) and the prompt view are kept apart: the next turn renders ``prompt_messages``, and
:meth:`Turn.encode_prompt` reuses ``history_ids`` verbatim for the part of the rendered
text that is ``history_text``, encoding only what the new messages add. The next prompt
therefore starts with exactly the tokens the session's KV holds, and only the new input is
computed. Where the template does not render the history as a prefix (it rewrites earlier
turns, or the tools in the system prompt changed), the whole text is encoded afresh; the
prefix cache then reuses whatever blocks still match, and the rest is recomputed: slower,
never wrong.

Decisions:

- A chat request naming an unknown session id *creates* it (clients pick ids, as in seed
  004, and the first turn needs no separate call). An id owned by another API key is
  :class:`SessionNotFound` (404) for that key, on every route: it cannot be probed.
- Idle sessions expire after ``ttl_s``; expiry is checked whenever the store is used (each
  engine step and every sessions call), so no timer task is needed.
- Pinned KV is bounded by ``max_blocks``: beyond it, the least recently used sessions lose
  their pins (not their history); their next turn simply recomputes. The engine also asks
  the store to :meth:`~SessionStore.reclaim` pins when a request does not fit the pool.
- At most ``max_sessions`` sessions; beyond it the least recently used idle one goes.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "Session",
    "SessionBusy",
    "SessionError",
    "SessionNotFound",
    "SessionReply",
    "SessionStore",
    "SharedHistory",
    "Turn",
    "TurnState",
    "turn_seed",
]

_MASK64 = (1 << 64) - 1


class SessionError(Exception):
    """Base of the session errors."""


class SessionNotFound(SessionError):
    """Unknown, expired, deleted, or owned by another API key: HTTP 404."""


class SessionBusy(SessionError):
    """A turn of the session is in flight: HTTP 409."""


class TurnState(enum.Enum):
    OPEN = "open"  # begun, not finished
    COMMITTED = "committed"  # its reply is in the session
    ENDED = "ended"  # the session is free again (committed or not)


def _hash64(*parts: bytes) -> int:
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(len(part).to_bytes(4, "little"))
        digest.update(part)
    return int.from_bytes(digest.digest(), "little")


def turn_seed(seed: int, rng_state: int) -> int:
    """The seed a seeded turn samples with: fresh per turn, the same on every replay."""
    if rng_state == 0:
        return seed  # the first turn samples exactly like a stateless seeded request
    return _hash64((seed & _MASK64).to_bytes(8, "little"), rng_state.to_bytes(8, "little")) & (
        (1 << 63) - 1
    )


def _advance(rng_state: int, seed: int | None, output_token_ids: Sequence[int]) -> int:
    tokens = b"".join((t & 0xFFFF_FFFF).to_bytes(4, "little") for t in output_token_ids)
    seed_bytes = b"" if seed is None else (seed & _MASK64).to_bytes(8, "little")
    return _hash64(rng_state.to_bytes(8, "little"), seed_bytes, tokens) or 1


def owner_of(api_key: str | None) -> str:
    """A session's owner tag for an API key (a digest: the store never keeps keys)."""
    if api_key is None:
        return ""
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(slots=True, eq=False)
class Session:
    """One conversation. Changed only by :meth:`SessionStore.commit` (and KV eviction)."""

    session_id: str
    owner: str
    created_at: float
    last_used: float
    messages: list[Mapping[str, Any]] = field(default_factory=list)
    prompt_messages: list[Mapping[str, Any]] = field(default_factory=list)
    history_text: str = ""
    history_ids: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()
    rng_state: int = 0
    turns: int = 0
    busy: bool = False


@dataclass(frozen=True, slots=True)
class SessionReply:
    """A turn's reply, in both views (see "Two views of a reply" in the module docstring).

    ``message`` is the assistant message as the client received it (``content``, and
    ``tool_calls`` with their ids); ``text`` is what the model generated for it, markup
    included and stop strings removed, which the next turn renders.
    """

    message: Mapping[str, Any]
    text: str


@dataclass(frozen=True, slots=True)
class SharedHistory:
    """What of a session outlives its replica (a shared store keeps it): everything but
    the pinned KV. :meth:`of` takes it from a session, :meth:`SessionStore.adopt` makes a
    session of it."""

    session_id: str
    owner: str
    messages: tuple[Mapping[str, Any], ...]
    prompt_messages: tuple[Mapping[str, Any], ...]
    history_text: str
    history_ids: tuple[int, ...]
    rng_state: int
    turns: int

    @classmethod
    def of(cls, session: Session) -> SharedHistory:
        return cls(
            session.session_id,
            session.owner,
            tuple(session.messages),
            tuple(session.prompt_messages),
            session.history_text,
            session.history_ids,
            session.rng_state,
            session.turns,
        )


@dataclass(slots=True, eq=False)
class Turn:
    """A turn in flight: the whole conversation to render, and the session to commit to.

    ``prompt_text`` and ``prompt_ids`` are set by :meth:`encode_prompt`: the commit needs
    them to extend the session's history ids.
    """

    session: Session
    new_messages: tuple[Mapping[str, Any], ...]
    state: TurnState = TurnState.OPEN
    request_id: str | None = None  # set by the engine when the turn's request is submitted
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None

    @property
    def prompt_messages(self) -> list[Mapping[str, Any]]:
        """History plus the new messages, as the chat template renders them for the model."""
        return [*self.session.prompt_messages, *self.new_messages]

    def encode_prompt(self, text: str, encode: Callable[[str], Sequence[int]]) -> tuple[int, ...]:
        """The token ids of ``text`` (this turn's rendered prompt): where it starts with the
        session's ``history_text``, the session's ``history_ids`` (the tokens its KV holds)
        and then ``encode`` of the rest; else ``encode(text)``. Called once, before the
        turn's request is submitted; the session is busy, so its history cannot change."""
        history = self.session.history_text
        if history and text.startswith(history):
            ids = (*self.session.history_ids, *encode(text[len(history) :]))
        else:
            ids = tuple(encode(text))
        self.prompt_text, self.prompt_ids = text, ids
        return ids

    @property
    def session_id(self) -> str:
        return self.session.session_id


def _extend_history(
    session: Session, turn: Turn, reply_text: str, reply_ids: Sequence[int] | None
) -> None:
    """The history after a committed turn: its prompt, and its reply where its ids are
    known to be the text's; nothing when the prompt was not encoded by the turn."""
    if turn.prompt_text is None or turn.prompt_ids is None:
        session.history_text, session.history_ids = "", ()
    elif reply_ids is None:
        session.history_text, session.history_ids = turn.prompt_text, turn.prompt_ids
    else:
        session.history_text = turn.prompt_text + reply_text
        session.history_ids = (*turn.prompt_ids, *reply_ids)


class SessionStore:
    """Every session, by id, least recently used first. See the module docstring."""

    def __init__(
        self,
        *,
        ttl_s: float,
        max_blocks: int,
        max_sessions: int,
        release: Callable[[Sequence[int]], None],
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        if max_blocks < 0:
            raise ValueError("max_blocks must be >= 0")
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self.max_sessions = max_sessions
        self._release = release  # drops one reference to each block (BlockPool.free)
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.pinned_blocks = 0
        self.kv_evictions = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    # -- the API's operations -----------------------------------------------------------------

    def get(self, session_id: str, owner: str, now: float) -> Session:
        """The session, or :class:`SessionNotFound` (also for another owner's)."""
        self.expire(now)
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise SessionNotFound(f"no session {session_id!r}")
        return session

    def delete(self, session_id: str, owner: str, now: float) -> None:
        """Forget a session and unpin its KV; :class:`SessionBusy` while a turn runs."""
        session = self.get(session_id, owner, now)
        if session.busy:
            raise SessionBusy(f"session {session_id!r} has a turn in flight")
        self._remove(session)

    def begin_turn(
        self,
        session_id: str,
        owner: str,
        new_messages: Sequence[Mapping[str, Any]],
        now: float,
    ) -> Turn:
        """Start a turn, creating the session if the id is new. The session is busy until
        :meth:`end_turn`; nothing else about it changes before :meth:`commit`."""
        if not session_id or len(session_id) > 256:
            raise ValueError("a session id has 1 to 256 characters")
        self.expire(now)
        session = self._sessions.get(session_id)
        if session is None:
            session = Session(session_id, owner, created_at=now, last_used=now)
            self._sessions[session_id] = session
            self._trim_sessions()
        elif session.owner != owner:
            raise SessionNotFound(f"no session {session_id!r}")
        elif session.busy:
            raise SessionBusy(f"session {session_id!r} has a turn in flight")
        session.busy = True
        session.last_used = now
        self._sessions.move_to_end(session_id)
        return Turn(session, tuple(new_messages))

    def adopt(self, shared: SharedHistory, now: float) -> Session:
        """Replace (or create) a session with a history kept elsewhere (another replica's,
        through a shared store): its messages, history ids, RNG state and turn count; no
        pins (its KV is recomputed by the next turn, and cached by the prefix cache from
        then on). :class:`SessionBusy` while a turn of the local copy runs."""
        if not shared.session_id or len(shared.session_id) > 256:
            raise ValueError("a session id has 1 to 256 characters")
        self.expire(now)
        old = self._sessions.get(shared.session_id)
        if old is not None:
            if old.busy:
                raise SessionBusy(f"session {shared.session_id!r} has a turn in flight")
            self._remove(old)
        session = Session(
            shared.session_id,
            shared.owner,
            created_at=now,
            last_used=now,
            messages=[dict(m) for m in shared.messages],
            prompt_messages=[dict(m) for m in shared.prompt_messages],
            history_text=shared.history_text,
            history_ids=tuple(shared.history_ids),
            rng_state=shared.rng_state,
            turns=shared.turns,
        )
        self._sessions[shared.session_id] = session
        self._trim_sessions()
        return session

    def seed_for(self, turn: Turn, seed: int | None) -> int | None:
        """The seed the turn samples with (``None`` stays unseeded)."""
        return None if seed is None else turn_seed(seed, turn.session.rng_state)

    def commit(
        self,
        turn: Turn,
        reply: SessionReply,
        *,
        token_ids: Sequence[int],
        blocks: Sequence[int],
        output_token_ids: Sequence[int],
        seed: int | None,
        now: float,
        reply_exact: bool,
    ) -> None:
        """The turn finished: append its messages and reply, swap in its pins (the store
        now owns one reference to each of ``blocks``), advance the RNG.

        ``reply_exact``: ``output_token_ids`` decode to exactly ``reply.text`` (false when
        a stop string cut the text short), so they extend the history ids; otherwise the
        history ends with the prompt and the next turn encodes the reply's text afresh.
        """
        if turn.state is not TurnState.OPEN:
            raise ValueError(f"the turn is {turn.state.value}")
        session = turn.session
        if self._sessions.get(session.session_id) is not session:
            self._release(blocks)  # deleted meanwhile (not possible through the API)
            turn.state = TurnState.COMMITTED
            return
        session.messages.extend(turn.new_messages)
        session.messages.append(dict(reply.message))
        session.prompt_messages.extend(turn.new_messages)
        session.prompt_messages.append({"role": "assistant", "content": reply.text})
        _extend_history(session, turn, reply.text, output_token_ids if reply_exact else None)
        self._unpin(session)
        session.token_ids = tuple(token_ids)
        session.blocks = tuple(blocks)
        self.pinned_blocks += len(blocks)
        session.rng_state = _advance(session.rng_state, seed, output_token_ids)
        session.turns += 1
        session.last_used = now
        self._sessions.move_to_end(session.session_id)
        turn.state = TurnState.COMMITTED
        self._trim_blocks(keep=session)

    def end_turn(self, turn: Turn, now: float) -> None:
        """The turn is over, committed or not: the session takes turns again. Idempotent."""
        if turn.state is TurnState.ENDED:
            return
        turn.state = TurnState.ENDED
        turn.session.busy = False
        turn.session.last_used = now

    # -- memory -------------------------------------------------------------------------------

    def expire(self, now: float) -> int:
        """Drop sessions idle for longer than the TTL; how many."""
        gone = [s for s in self._sessions.values() if not s.busy and now - s.last_used > self.ttl_s]
        for session in gone:
            logger.info("session %s expired", session.session_id)
            self._remove(session)
        self.expired += len(gone)
        return len(gone)

    def reclaim(self, num_blocks: int) -> int:
        """Unpin least recently used sessions' KV until ``num_blocks`` pins were dropped
        (or none are left); how many were. Histories stay."""
        dropped = 0
        for session in list(self._sessions.values()):
            if dropped >= num_blocks:
                break
            if session.blocks:
                dropped += len(session.blocks)
                self._unpin(session)
                self.kv_evictions += 1
        return dropped

    def close(self) -> None:
        """Unpin everything (the engine is going away)."""
        for session in list(self._sessions.values()):
            self._remove(session)

    # -- internals ----------------------------------------------------------------------------

    def _unpin(self, session: Session) -> None:
        if session.blocks:
            self._release(session.blocks)
            self.pinned_blocks -= len(session.blocks)
        session.blocks = ()
        session.token_ids = ()

    def _remove(self, session: Session) -> None:
        self._unpin(session)
        self._sessions.pop(session.session_id, None)

    def _trim_blocks(self, keep: Session) -> None:
        for session in list(self._sessions.values()):
            if self.pinned_blocks <= self.max_blocks:
                return
            if session is not keep and session.blocks:
                self._unpin(session)
                self.kv_evictions += 1
        if self.pinned_blocks > self.max_blocks:
            self._unpin(keep)  # alone larger than the budget
            self.kv_evictions += 1

    def _trim_sessions(self) -> None:
        for session in list(self._sessions.values()):
            if len(self._sessions) <= self.max_sessions:
                return
            if not session.busy:
                self._remove(session)
