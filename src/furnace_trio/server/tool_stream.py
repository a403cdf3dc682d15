"""Tool-call parsing over a request's engine events (the handler's side).

:class:`ToolCallStream` sits between :class:`~furnace_trio.engine.RequestStream` and the
response shaping: each choice's text goes through its own
:class:`~furnace_trio.tools.tool_calls.ToolCallParser`; what comes out is the same events with
only the visible content left in ``Delta.text``, plus :class:`ToolCallReady` events.
Fallbacks are logged with the request id and counted (``/metrics``). No I/O, no Trio.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from furnace_trio.engine import Delta, Finished
from furnace_trio.tools.tool_calls import (
    ContentDelta,
    ParserEvent,
    ToolCall,
    ToolCallFallback,
    ToolCallFormat,
    ToolCallParsed,
    ToolCallParser,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolCallReady:
    """Choice ``index`` produced a complete call (in output order)."""

    index: int
    call: ToolCall


class ToolCallStream:
    """One parser per choice; :meth:`translate` maps one engine event to output events.

    Invariant: for each choice, every content character and call comes out before that
    choice's ``Finished``, because ``finish()`` runs on the ``Finished`` event itself.
    """

    def __init__(
        self,
        request_id: str,
        n: int,
        fmt: ToolCallFormat,
        tools: Mapping[str, Mapping[str, Any] | None],
        *,
        parallel: bool,
        fallbacks: Counter[str],
        drop_repeats: bool = False,
    ) -> None:
        self.request_id = request_id
        self._parsers = [
            ToolCallParser(fmt, tools, parallel=parallel, drop_repeats=drop_repeats)
            for _ in range(n)
        ]
        self._fallbacks = fallbacks

    def translate(self, event: object) -> list[object]:
        if isinstance(event, Delta):
            parsed = self._parsers[event.index].feed(event.text)
            return self._events(event.index, parsed, event)
        if isinstance(event, Finished):
            parsed = self._parsers[event.index].finish(cut=event.reason == "length")
            return [*self._events(event.index, parsed, None), event]
        return [event]

    def _events(self, index: int, parsed: list[ParserEvent], delta: Delta | None) -> list[object]:
        text: list[str] = []
        calls: list[object] = []
        for item in parsed:
            if isinstance(item, ContentDelta):
                text.append(item.text)
            elif isinstance(item, ToolCallParsed):
                calls.append(ToolCallReady(index, item.call))
            elif isinstance(item, ToolCallFallback):
                self._fallbacks[item.reason.value] += 1
                logger.warning(
                    "request %s choice %d: tool-call fallback %s (%s)",
                    self.request_id,
                    index,
                    item.reason.value,
                    item.detail,
                )
        out: list[object] = []
        joined = "".join(text)
        if delta is not None:
            out.append(Delta(index, joined, delta.token_ids, delta.logprobs))
        elif joined:
            out.append(Delta(index, joined, (), ()))
        return [*out, *calls]


def render_fallback_metrics(counts: Mapping[str, int]) -> str:
    """``furnace_tool_call_fallbacks_total{reason=...}`` in Prometheus text format."""
    lines = [
        "# HELP furnace_tool_call_fallbacks_total Tool-call outputs recovered or dropped.",
        "# TYPE furnace_tool_call_fallbacks_total counter",
    ]
    lines += [
        f'furnace_tool_call_fallbacks_total{{reason="{reason}"}} {count}'
        for reason, count in sorted(counts.items())
    ]
    return "\n".join(lines) + "\n"
