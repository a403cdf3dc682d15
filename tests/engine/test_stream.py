"""A request's stream: text from tokens (multi-byte pieces, stop strings, logprobs) and
the grouping of tokens by ``stream_interval``, with a scripted model."""

from __future__ import annotations

import pytest

from furnace_trio.engine import (
    Delta,
    EngineConfig,
    Finished,
)

from ..scripted import EOS, ScriptedRunner, encode
from .harness import (
    collect,
    delta_sizes,
    request,
    serving,
)


async def test_multibyte_characters_split_across_tokens() -> None:
    # "é" is one token, "😀" is two tokens that are each half a character
    script = [ord("a"), 256, 258, 259, ord("b"), EOS]
    runner = ScriptedRunner({encode("u"): script})
    async with serving(runner) as engine:
        out = await collect(engine.submit(request("u", max_tokens=10)))
    assert out.text == {0: "aé😀b"}
    for event in out.events:
        if isinstance(event, Delta):
            assert "\ufffd" not in event.text
    assert out.token_ids[0] == script[:-1]


async def test_stop_string_ends_the_sample_and_is_never_emitted() -> None:
    script = encode("one, two STOP three and more")
    runner = ScriptedRunner({encode("s"): script})
    async with serving(runner) as engine:
        out = await collect(engine.submit(request("s", max_tokens=40, stop=("STOP",))))
        stats = engine.statistics()
    assert out.text == {0: "one, two "}
    assert out.finished[0].reason == "stop"
    assert out.finished[0].completion_tokens == len("one, two STOP")
    assert stats.requests["finished_stop"] == 1
    assert stats.kv_blocks_used == 0 and stats.running == 0


async def test_stop_string_across_tokens_with_multibyte() -> None:
    script = [*encode("x"), 258, 259, *encode("EN"), *encode("D!"), *encode("tail")]
    runner = ScriptedRunner({encode("m"): script})
    async with serving(runner) as engine:
        out = await collect(engine.submit(request("m", max_tokens=40, stop=("END",))))
    assert out.text == {0: "x😀"}
    assert out.finished[0].reason == "stop"


async def test_logprobs_are_passed_through_with_token_text() -> None:
    runner = ScriptedRunner({encode("l"): [*encode("ok"), EOS]})
    async with serving(runner) as engine:
        out = await collect(engine.submit(request("l", max_tokens=5, logprobs=2)))
    entries = [e for ev in out.events if isinstance(ev, Delta) for e in ev.logprobs]
    assert [e.token for e in entries] == ["o", "k"]
    assert entries[0].bytes == (ord("o"),)
    assert entries[0].logprob == -0.5
    assert [t.token_id for t in entries[0].top] == [ord("o"), ord("o") + 1]


# -- stream interval ----------------------------------------------------------------------


async def test_stream_interval_sends_the_first_token_alone_then_groups() -> None:
    runner = ScriptedRunner({encode("g"): [*encode("abcdefghij"), EOS]})
    async with serving(runner, EngineConfig(stream_interval=4)) as engine:
        out = await collect(engine.submit(request("g", max_tokens=20)))
    # the tenth token is held when EOS ends the sample, and sent before Finished
    assert delta_sizes(out) == [1, 4, 4, 1]
    assert out.text == {0: "abcdefghij"}
    assert out.token_ids == {0: list(encode("abcdefghij"))}
    assert out.finished[0].reason == "stop"
    assert out.finished[0].completion_tokens == 10
    assert isinstance(out.events[-1], Finished)


async def test_stream_interval_at_max_tokens_and_for_every_sample() -> None:
    runner = ScriptedRunner(lambda prompt, index: encode("pqrstuvwxyz"[index:]) * 2)
    async with serving(runner, EngineConfig(stream_interval=3)) as engine:
        out = await collect(engine.submit(request("n", max_tokens=8, n=2, seed=1)))
    for index, text in ((0, "pqrstuvw"), (1, "qrstuvwx")):
        assert delta_sizes(out, index) == [1, 3, 3, 1]  # the last group ends at max_tokens
        assert out.text[index] == text
        assert out.finished[index].reason == "length"
        assert out.finished[index].completion_tokens == 8


async def test_stream_interval_keeps_logprobs_and_multibyte_text() -> None:
    script = [*encode("a"), 258, 259, *encode("bc"), 256, EOS]
    runner = ScriptedRunner({encode("l"): script})
    async with serving(runner, EngineConfig(stream_interval=2)) as engine:
        out = await collect(engine.submit(request("l", max_tokens=20, logprobs=1)))
    deltas = [e for e in out.events if isinstance(e, Delta)]
    assert [len(d.token_ids) for d in deltas] == [1, 2, 2, 1]
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert [d.text for d in deltas] == ["a", "😀", "bc", "é"]
    assert [e.token_id for d in deltas for e in d.logprobs] == script[:-1]


async def test_stream_interval_stop_string_inside_a_group() -> None:
    script = encode("one, two STOP three and more and more and more")
    runner = ScriptedRunner({encode("s"): script})
    async with serving(runner, EngineConfig(stream_interval=5)) as engine:
        out = await collect(engine.submit(request("s", max_tokens=40, stop=("STOP",))))
        stats = engine.statistics()
    assert out.text == {0: "one, two "}
    assert delta_sizes(out)[:3] == [1, 5, 5]  # "o", "ne, t", "wo ST" (its text: "wo ")
    assert out.finished[0].reason == "stop"
    assert out.finished[0].completion_tokens == len("one, two STOP")
    # the stop is seen when its group arrives: at most one group of tokens past it ran
    sampled = sum(1 for plan in runner.plans for c in plan.chunks if c.samples)
    assert sampled <= len("one, two STOP") + 5 + 1
    assert stats.kv_blocks_used == 0 and stats.running == 0


def test_stream_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)
