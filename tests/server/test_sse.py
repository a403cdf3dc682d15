"""SSE framing: the pre-serialized content event is byte for byte the general chunk."""

from __future__ import annotations

import json

import pytest

from furnace_trio.server.sse import Collector, Kind, sse_event

TEXTS = [
    " hello",
    'quote " and backslash \\ and slash /',
    "line\nbreak\ttab\r\x00\x1f",
    "é€😀 and \u2028\u2029",
    "\ue000furnace-text\ue000",  # the placeholder's own characters, as model output
    "x" * 500,
]


def _collector(kind: Kind, model: str = "SmolLM2-135M-Instruct", n: int = 2) -> Collector:
    return Collector(
        kind=kind,
        response_id="chatcmpl-abc" if kind == "chat" else "cmpl-abc",
        model=model,
        created=1_764_750_000,
        n=n,
        prompt_tokens=7,
    )


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct", 'odd "model" \ue000furnace-text\ue000'])
def test_content_event_equals_the_general_chunk(
    kind: Kind, include_usage: bool, model: str
) -> None:
    fast, general = _collector(kind, model), _collector(kind, model)
    for index in (0, 1):
        for text in TEXTS:
            expected = sse_event(general.chunk(index, text=text, include_usage=include_usage))
            assert fast.content_event(index, text, include_usage=include_usage) == expected
    # The text each choice carried is recorded alike (completion logprob offsets use it).
    assert [c.text_length for c in fast.choices] == [c.text_length for c in general.choices]
    assert fast.choices[0].text_length == sum(len(t) for t in TEXTS)


def test_content_event_parses_as_the_openai_chunk() -> None:
    collector = _collector("chat", n=1)
    event = collector.content_event(0, 'say "hi"\n', include_usage=True)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    body = json.loads(event[6:])
    assert body["object"] == "chat.completion.chunk"
    assert body["choices"] == [
        {"index": 0, "delta": {"content": 'say "hi"\n'}, "logprobs": None, "finish_reason": None}
    ]
    assert body["usage"] is None
