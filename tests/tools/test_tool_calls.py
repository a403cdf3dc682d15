"""The streaming tool-call parser: every format, every split point, and recovery."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import pytest

from furnace_trio.tools.tool_calls import (
    ContentDelta,
    FallbackReason,
    ParserEvent,
    ToolCallFallback,
    ToolCallFormat,
    ToolCallParsed,
    ToolCallParser,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS: dict[str, Any] = {"get_weather": WEATHER, "get_time": None}


def _parser(fmt: ToolCallFormat, **kwargs: Any) -> ToolCallParser:
    counter = itertools.count()
    return ToolCallParser(fmt, TOOLS, id_factory=lambda: f"call_{next(counter)}", **kwargs)


def run(fmt: ToolCallFormat, pieces: Sequence[str], **kwargs: Any) -> list[ParserEvent]:
    parser = _parser(fmt, **kwargs)
    events: list[ParserEvent] = []
    for piece in pieces:
        events.extend(parser.feed(piece))
    events.extend(parser.finish())
    return events


def summary(events: Sequence[ParserEvent]) -> tuple[str, list[tuple[str, Any]], list[str]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [
        (e.call.name, json.loads(e.call.arguments)) for e in events if isinstance(e, ToolCallParsed)
    ]
    reasons = [e.reason.value for e in events if isinstance(e, ToolCallFallback)]
    return content, calls, reasons


def every_split(fmt: ToolCallFormat, text: str, **kwargs: Any) -> tuple[str, Any, list[str]]:
    """Parse ``text`` whole, split in two at every point and one character at a time;
    all must agree. Returns the common summary."""
    expected = summary(run(fmt, [text], **kwargs))
    for cut in range(len(text) + 1):
        assert summary(run(fmt, [text[:cut], text[cut:]], **kwargs)) == expected, cut
    assert summary(run(fmt, list(text), **kwargs)) == expected
    return expected


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_hermes_content_then_two_calls() -> None:
    text = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n" + (
        '{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls, reasons = every_split(ToolCallFormat.HERMES, text)
    assert content == "Let me check."
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert reasons == []


def test_hermes_plain_text_passes_through_including_lookalikes() -> None:
    text = "a <b> and <tool and [TOOL_CALLS] {x} <"
    assert every_split(ToolCallFormat.HERMES, text) == (text, [], [])


def test_hermes_ids_and_order() -> None:
    events = run(ToolCallFormat.HERMES, [f"<tool_call>{CALL}</tool_call>"])
    parsed = [e for e in events if isinstance(e, ToolCallParsed)]
    assert [(p.index, p.call.id, p.call.name) for p in parsed] == [(0, "call_0", "get_weather")]
    assert json.loads(parsed[0].call.arguments) == {"city": "Paris"}


def test_llama3_bare_json_and_python_tag() -> None:
    bare = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert every_split(ToolCallFormat.LLAMA3, f"  {bare}") == (
        "",
        [("get_weather", {"city": "Oslo"})],
        [],
    )
    tagged = '<|python_tag|>{"name": "get_time", "parameters": {}}; ' + bare
    assert every_split(ToolCallFormat.LLAMA3, tagged) == (
        "",
        [("get_time", {}), ("get_weather", {"city": "Oslo"})],
        [],
    )


def test_llama3_json_that_is_not_a_call_is_content() -> None:
    text = '{"answer": 42, "text": "} not a call {"}'
    content, calls, reasons = every_split(ToolCallFormat.LLAMA3, text)
    assert (content, calls, reasons) == (text, [], ["not_a_call"])
    # a JSON object in the middle of prose is never a call
    prose = f"Here: {CALL}"
    assert every_split(ToolCallFormat.LLAMA3, prose) == (prose, [], [])


def test_mistral_array_and_bare_array() -> None:
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, ' + (
        '{"name": "get_time", "arguments": {}}]'
    )
    expected = ("", [("get_weather", {"city": "Rome"}), ("get_time", {})], [])
    assert every_split(ToolCallFormat.MISTRAL, text) == expected
    # [TOOL_CALLS] is a special token some detokenizers drop
    assert every_split(ToolCallFormat.MISTRAL, text.removeprefix("[TOOL_CALLS] ")) == expected


def test_truncated_call_is_dropped_and_content_kept() -> None:
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"ci'
    content, calls, reasons = every_split(ToolCallFormat.HERMES, text)
    assert (content, calls, reasons) == ("Sure.", [], ["truncated"])


def test_truncated_start_marker_never_leaks() -> None:
    assert every_split(ToolCallFormat.HERMES, "Sure. <tool_ca") == ("Sure.", [], ["truncated"])
    assert every_split(ToolCallFormat.MISTRAL, "ok [TOOL_") == ("ok", [], ["truncated"])


def test_complete_calls_stand_when_a_later_one_is_truncated() -> None:
    text = f"<tool_call>{CALL}</tool_call><tool_call>" + '{"name": "get_time", "argu'
    content, calls, reasons = every_split(ToolCallFormat.HERMES, text)
    assert (content, calls, reasons) == ("", [("get_weather", {"city": "Paris"})], ["truncated"])


def test_missing_end_marker_with_complete_json_is_recovered() -> None:
    for text in (f"<tool_call>{CALL}", f"<tool_call>{CALL}\n</tool_"):
        content, calls, reasons = every_split(ToolCallFormat.HERMES, text)
        assert (content, calls, reasons) == (
            "",
            [("get_weather", {"city": "Paris"})],
            ["missing_end_marker"],
        )


def test_malformed_json_in_markup_is_dropped() -> None:
    text = "Hi <tool_call>{name: get_weather}</tool_call> bye"
    content, calls, reasons = every_split(ToolCallFormat.HERMES, text)
    assert calls == []
    assert "<tool_call>" not in content and "get_weather" not in content
    assert content.startswith("Hi") and content.endswith("bye")
    assert reasons == ["malformed_json"]


def test_mistral_unknown_dialect_drops_the_rest() -> None:
    text = 'ok [TOOL_CALLS]get_weather[ARGS]{"city": "x"}'
    assert every_split(ToolCallFormat.MISTRAL, text) == ("ok", [], ["malformed_json"])


def test_unknown_tool_dropped_and_schema_mismatch_kept() -> None:
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert every_split(ToolCallFormat.HERMES, unknown) == ("", [], ["unknown_tool"])
    bad = '<tool_call>{"name": "get_weather", "arguments": {"unit": "k"}}</tool_call>'
    _, calls, reasons = every_split(ToolCallFormat.HERMES, bad)
    assert calls == [("get_weather", {"unit": "k"})]
    assert reasons == ["schema_mismatch"]


def test_suffix_after_call_is_content_without_markup() -> None:
    text = f"<tool_call>{CALL}</tool_call>\n\nDone, I think."
    content, calls, reasons = every_split(ToolCallFormat.HERMES, text)
    assert (content, len(calls), reasons) == ("Done, I think.", 1, ["trailing_text"])


def test_arguments_as_string_and_parallel_off() -> None:
    text = (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}</tool_call>'
        f"<tool_call>{CALL}</tool_call>"
    )
    _, calls, reasons = every_split(ToolCallFormat.HERMES, text, parallel=False)
    assert calls == [("get_weather", {"city": "Lima"})]
    assert reasons == ["extra_call"]


def test_whitespace_only_output_is_content() -> None:
    assert every_split(ToolCallFormat.LLAMA3, "  \n") == ("  \n", [], [])
    assert every_split(ToolCallFormat.HERMES, "") == ("", [], [])


def test_content_streams_before_the_call_completes() -> None:
    parser = _parser(ToolCallFormat.HERMES)
    assert parser.feed("Hello there") == [ContentDelta("Hello there")]
    assert parser.feed(" <tool_") == []
    assert parser.feed("call>{") == []
    assert parser.finish() == [ToolCallFallback(FallbackReason.TRUNCATED, "{")]


def test_feed_after_finish_raises() -> None:
    parser = _parser(ToolCallFormat.HERMES)
    parser.finish()
    with pytest.raises(ValueError):
        parser.feed("x")


_CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
_OTHER = '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>\n'


def test_a_repeated_forced_call_is_dropped() -> None:
    parser = ToolCallParser(ToolCallFormat.HERMES, {"f": None, "g": None}, drop_repeats=True)
    events = parser.feed(_CALL + _OTHER + _CALL) + parser.finish()
    assert [c.arguments for c in parser.calls] == ['{"a": 1}', '{"a": 2}']
    assert [e.reason for e in events if isinstance(e, ToolCallFallback)] == [
        FallbackReason.DUPLICATE_CALL
    ]


def test_repeated_calls_the_model_chose_all_stand() -> None:
    """``auto``: two identical calls may be meant (roll a die twice)."""
    parser = ToolCallParser(ToolCallFormat.HERMES, {"f": None, "g": None})
    events = parser.feed(_CALL + _OTHER + _CALL) + parser.finish()
    assert [c.arguments for c in parser.calls] == ['{"a": 1}', '{"a": 2}', '{"a": 1}']
    assert len({c.id for c in parser.calls}) == 3
    assert not [e for e in events if isinstance(e, ToolCallFallback)]


@pytest.mark.parametrize("cut", [True, False])
def test_a_call_cut_by_the_token_limit_is_returned_as_far_as_it_got(cut: bool) -> None:
    parser = ToolCallParser(ToolCallFormat.HERMES, {"get_weather": WEATHER})
    events = parser.feed('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    events += parser.finish(cut=cut)
    if cut:
        assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", '{"city": "Pa')]
    else:
        assert parser.calls == []
    assert [e.text for e in events if isinstance(e, ContentDelta)] == ["Sure."]


def test_a_cut_call_without_its_arguments_or_name() -> None:
    named = ToolCallParser(ToolCallFormat.HERMES, {"get_weather": WEATHER})
    named.feed('<tool_call>{"name": "get_weather", "argu')
    named.finish(cut=True)
    assert [(c.name, c.arguments) for c in named.calls] == [("get_weather", "")]
    unnamed = ToolCallParser(ToolCallFormat.HERMES, {"get_weather": WEATHER})
    unnamed.feed('<tool_call>{"name": "get_wea')
    unnamed.finish(cut=True)
    assert unnamed.calls == []
