"""Sessions: the plain store, then turns through the engine with the scripted runner."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import trio

from furnace_trio.core.params import SamplingParams
from furnace_trio.engine import Admitted, Engine, EngineConfig, GenerationRequest
from furnace_trio.engine.sessions import (
    SessionBusy,
    SessionNotFound,
    SessionReply,
    SessionStore,
    turn_seed,
)

from ..scripted import EOS, ScriptedRunner, encode
from .harness import collect, serving

# -- the store --------------------------------------------------------------------------------


def store(**kw: Any) -> tuple[SessionStore, list[int]]:
    released: list[int] = []
    settings: dict[str, Any] = {"ttl_s": 10.0, "max_blocks": 8, "max_sessions": 4}
    settings.update(kw)
    return SessionStore(release=released.extend, **settings), released


def commit(s: SessionStore, sid: str, blocks: Sequence[int], now: float = 0.0) -> None:
    turn = s.begin_turn(sid, "me", [{"role": "user", "content": sid}], now)
    s.commit(
        turn,
        SessionReply({"role": "assistant", "content": "ok"}, "ok"),
        token_ids=list(range(len(blocks) * 4)),
        blocks=blocks,
        output_token_ids=[1, 2],
        seed=None,
        now=now,
        reply_exact=True,
    )
    s.end_turn(turn, now)


def test_store_turns_commit_or_leave_no_trace() -> None:
    s, released = store()
    commit(s, "a", [1, 2])
    session = s.get("a", "me", 0.0)
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.blocks == (1, 2) and s.pinned_blocks == 2 and session.rng_state != 0
    before = (list(session.messages), session.token_ids, session.blocks, session.rng_state)
    turn = s.begin_turn("a", "me", [{"role": "user", "content": "more"}], 1.0)
    assert [m["content"] for m in turn.prompt_messages] == ["a", "ok", "more"]
    with pytest.raises(SessionBusy):
        s.begin_turn("a", "me", [], 1.0)
    with pytest.raises(SessionBusy):
        s.delete("a", "me", 1.0)
    s.end_turn(turn, 1.0)  # never committed: a cancelled turn
    assert (session.messages, session.token_ids, session.blocks, session.rng_state) == before
    commit(s, "a", [3])  # the next turn replaces the pins
    assert released == [1, 2] and s.pinned_blocks == 1


def test_store_owner_expiry_and_delete() -> None:
    s, released = store()
    commit(s, "a", [1])
    for call in (lambda: s.get("a", "you", 0.0), lambda: s.delete("a", "you", 0.0)):
        with pytest.raises(SessionNotFound):
            call()
    with pytest.raises(SessionNotFound):
        s.begin_turn("a", "you", [], 0.0)
    s.get("a", "me", 10.0)  # idle exactly ttl: still there
    assert s.expire(10.5) == 1 and released == [1] and len(s) == 0
    commit(s, "b", [2])
    s.delete("b", "me", 0.0)
    assert released == [1, 2] and s.pinned_blocks == 0


def test_store_budget_unpins_least_recent_sessions_but_keeps_history() -> None:
    s, released = store(max_blocks=4)
    commit(s, "a", [1, 2, 3])
    commit(s, "b", [4, 5])  # 5 > 4: a loses its pins
    a = s.get("a", "me", 0.0)
    assert a.blocks == () and a.token_ids == () and len(a.messages) == 2
    assert released == [1, 2, 3] and s.pinned_blocks == 2
    assert s.reclaim(1) == 2 and s.pinned_blocks == 0


def test_turn_seeds_continue_and_replay() -> None:
    assert turn_seed(7, 0) == 7  # the first turn samples like a stateless seeded request
    assert turn_seed(7, 123) == turn_seed(7, 123) != turn_seed(7, 124)


# -- turns through the engine -----------------------------------------------------------------


def render_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """A toy chat template: exact, so a turn's prompt extends the previous one."""
    return "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + "<assistant>"


def render(messages: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
    return encode(render_text(messages))


def reply_script(prompt: tuple[int, ...], index: int) -> list[int]:
    return [*encode(f"reply {len(prompt)}"), EOS]


async def run_turn(
    engine: Engine, sid: str, text: str, owner: str = "", **params: Any
) -> tuple[str, int]:
    turn = engine.begin_turn(sid, owner, [{"role": "user", "content": text}])
    stream = engine.submit(
        GenerationRequest(render(turn.prompt_messages), SamplingParams(**params), turn=turn)
    )
    out = await collect(stream)
    assert out.failed is None
    (admitted,) = [e for e in out.events if isinstance(e, Admitted)]
    return out.text[0], admitted.cached_tokens


async def test_turns_reuse_the_session_kv_and_match_stateless_requests() -> None:
    runner = ScriptedRunner(reply_script, block_size=4)
    async with serving(runner) as engine:
        first, cached = await run_turn(engine, "s", "hello", max_tokens=20)
        assert cached == 0
        second, cached = await run_turn(engine, "s", "again", max_tokens=20)
        session = engine.get_session("s", "")
        # the first prompt and most of the reply come from the session's pinned blocks
        assert cached > len(render(session.messages[:1]))
        assert [m["content"] for m in session.messages] == ["hello", first, "again", second]
        # the same conversation, stateless, with caching off: same text
    async with serving(
        ScriptedRunner(reply_script, block_size=4), EngineConfig(prefix_cache=False)
    ) as engine:
        history = [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "again"},
        ]
        out = await collect(
            engine.submit(GenerationRequest(render(history), SamplingParams(max_tokens=20)))
        )
        assert out.text[0] == second


async def test_cancelled_turn_leaves_the_session_unchanged() -> None:
    runner = ScriptedRunner(lambda p, i: [*encode("x" * 50), EOS], block_size=4)
    async with serving(runner) as engine:
        await run_turn(engine, "s", "hello", max_tokens=60)
        session = engine.get_session("s", "")
        before = (list(session.messages), session.token_ids, session.blocks, session.rng_state)
        pinned = engine.sessions.pinned_blocks
        turn = engine.begin_turn("s", "", [{"role": "user", "content": "and?"}])
        stream = engine.submit(
            GenerationRequest(
                render(turn.prompt_messages), SamplingParams(max_tokens=60), turn=turn
            )
        )
        with pytest.raises(SessionBusy):
            engine.begin_turn("s", "", [{"role": "user", "content": "concurrent"}])
        async with stream:
            async for _event in stream:
                break  # leave mid-generation
        after = (list(session.messages), session.token_ids, session.blocks, session.rng_state)
        assert after == before and engine.sessions.pinned_blocks == pinned
        await run_turn(engine, "s", "next", max_tokens=5)  # no longer busy
        assert len(session.messages) == 4


async def test_sessions_expire_when_idle(autojump_clock: trio.testing.MockClock) -> None:
    runner = ScriptedRunner(reply_script, block_size=4)
    async with serving(runner, EngineConfig(session_ttl_s=60)) as engine:
        await run_turn(engine, "s", "hello", max_tokens=20)
        assert engine.statistics().kv_blocks_used > 0  # pinned
        await trio.sleep(30)
        engine.get_session("s", "")  # touching does not refresh: only turns do
        await trio.sleep(31)
        with pytest.raises(SessionNotFound):
            engine.get_session("s", "")
        assert engine.statistics().kv_blocks_used == 0


async def test_other_owners_cannot_see_or_use_a_session() -> None:
    runner = ScriptedRunner(reply_script, block_size=4)
    async with serving(runner) as engine:
        await run_turn(engine, "s", "hello", owner="alice", max_tokens=5)
        with pytest.raises(SessionNotFound):
            engine.get_session("s", "bob")
        with pytest.raises(SessionNotFound):
            engine.begin_turn("s", "bob", [{"role": "user", "content": "hi"}])
        with pytest.raises(SessionNotFound):
            engine.delete_session("s", "bob")
        engine.delete_session("s", "alice")
        assert engine.statistics().kv_blocks_used == 0


async def test_memory_pressure_unpins_sessions_and_their_next_turn_recomputes() -> None:
    runner = ScriptedRunner(reply_script, block_size=4, num_blocks=40)
    config = EngineConfig(session_max_blocks=40)
    async with serving(runner, config) as engine:
        await run_turn(engine, "s", "hello " * 10, max_tokens=20)
        assert engine.sessions.pinned_blocks > 0
        # needs most of the pool: admission reclaims the session's pins
        big = GenerationRequest(encode("y" * 120), SamplingParams(max_tokens=30))
        assert (await collect(engine.submit(big))).failed is None
        assert engine.sessions.kv_evictions == 1
        second, _ = await run_turn(engine, "s", "again", max_tokens=20)
        assert second.startswith("reply") and len(engine.get_session("s", "").messages) == 4


async def test_a_turn_keeps_the_reply_as_delivered_and_the_tokens_as_generated() -> None:
    """The consumer commits the reply the client got; the session renders what the model
    wrote, and its next prompt starts with the turn's own tokens, unless a stop string cut
    the text short of them."""
    generated = '<tool_call>{"name":"f"}</tool_call>'
    sent = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    runner = ScriptedRunner(lambda p, i: [*encode(generated), EOS], block_size=4)
    async with serving(runner) as engine:
        turn = engine.begin_turn("s", "", [{"role": "user", "content": "go"}])
        text = render_text(turn.prompt_messages)
        prompt = turn.encode_prompt(text, encode)
        stream = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=60), turn=turn))
        async with stream:
            assert not stream.commit_turn(sent)  # not finished yet
            async for _event in stream:
                pass
            assert stream.commit_turn(sent)
            assert not stream.commit_turn(sent)  # once
        session = engine.get_session("s", "")
        assert session.messages[-1] == sent
        assert session.prompt_messages[-1] == {"role": "assistant", "content": generated}
        assert session.history_ids == (*prompt, *encode(generated))
        assert session.history_text == text + generated

        turn = engine.begin_turn("s", "", [{"role": "user", "content": "again"}])
        text = render_text(turn.prompt_messages)
        prompt = turn.encode_prompt(text, encode)
        assert prompt[: len(session.history_ids)] == session.history_ids
        stop = SamplingParams(max_tokens=60, stop=["name"])
        out = await collect(engine.submit(GenerationRequest(prompt, stop, turn=turn)))
        assert out.text[0] == '<tool_call>{"'
        assert session.prompt_messages[-1] == {"role": "assistant", "content": out.text[0]}
        assert session.history_ids == prompt and session.history_text == text
