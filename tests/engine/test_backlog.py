"""A request whose stream is not read pauses once it holds ``max_response_bytes`` unsent,
takes no steps while others go on, and resumes (then finishes) once its stream is read."""

from __future__ import annotations

import pytest

from furnace_trio.engine import EngineConfig
from furnace_trio.engine.backlog import TOKEN_BYTES, TOP_LOGPROB_BYTES, Backlog

from ..scripted import EOS, ScriptedRunner, encode
from ..server.waiting import engine_reaches
from .harness import collect, request, serving


def test_backlog_pauses_past_the_limit_and_resumes_at_half() -> None:
    backlog = Backlog(1000)
    assert not backlog.add(1000)  # at the limit: still fine
    assert backlog.add(1)  # past it: pause, once
    assert not backlog.add(500)
    assert not backlog.take(1000)  # 501 held: above half
    assert backlog.take(1)  # 500, half: resume, once
    assert not backlog.take(10)
    with pytest.raises(ValueError):
        Backlog(0)


async def test_unread_stream_pauses_its_request_while_others_run() -> None:
    per_token = TOKEN_BYTES + 20 * TOP_LOGPROB_BYTES
    limit = 10 * per_token
    runner = ScriptedRunner({encode("short"): [*encode("ok"), EOS]})
    async with serving(runner, EngineConfig(max_response_bytes=limit)) as engine:
        unread = engine.submit(request("long", max_tokens=400, logprobs=20))
        await engine_reaches(engine, lambda s: s.requests_paused == 1, "a pause")
        paused = engine.statistics()
        # the Admitted message counts too; one step may overshoot by one token
        assert paused.generation_tokens_total <= 10
        assert paused.pauses_total == 1 and paused.running == 1
        other = await collect(engine.submit(request("short", max_tokens=20)))
        assert other.text == {0: "ok"}
        after = engine.statistics()
        assert after.generation_tokens_total == paused.generation_tokens_total + 2
        assert after.requests_paused == 1
        out = await collect(unread)
    assert out.finished[0].reason == "length"
    assert out.finished[0].completion_tokens == 400
    assert len(out.token_ids[0]) == 400
    stats = engine.statistics()
    assert stats.requests_paused == 0 and stats.idle
