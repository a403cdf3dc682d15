"""Hostile clients beside the soak's normal ones: bodies that cost the server what the
client chooses, sent while the normal clients keep it busy.

Each :class:`HostileCase` is one request and the statuses it may get. A hostile client
sends them in turn, one at a time, until the soak's clients are done. Meanwhile a loop
watch (``tests/loop_watch.py``) probes ``/health`` every 10 ms and, the server being in
this process, how late the event loop wakes. ``run_soak`` reports both, and fails on any
unexpected status or a late wake-up past :data:`STALL_LIMIT_UNDER_LOAD_S` (round trips
under load include queueing behind the normal clients, so they are reported only).

The cases:

- ``schema-44k``: a tool schema of 44,000 ``anyOf`` branches (3.9 MiB), refused before
  decoding (400); it stalled the loop for a minute when checked on it;
- ``schema-over-budget``: 5,000 branches in ``response_format``, within the body's value
  budget and past ``FURNACE_MAX_SCHEMA_NODES`` (400);
- ``schema-compiles``: 2,000 branches within every budget, checked and compiled off the
  loop and answered (200, or 503 when the queue is full);
- ``fan-out``: 128 prompts x ``n`` 16 (400, past ``FURNACE_MAX_SEQUENCES_PER_REQUEST``);
- ``fan-out-at-cap``: 64 prompts x ``n`` 2, counted against the queue whole (200 or 503);
- ``surrogate`` and ``digits``: a lone surrogate escape and a 5,001-digit number (400).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

#: Latest wake-up of the event loop tolerated while the soak's clients load the server (the
#: scripted soak saw up to 60 ms on a loaded 2-core machine). The tests hold an idle server
#: to 100 ms; every hostile case here stalled the loop for 1.4 s to 60 s when it ran on it.
STALL_LIMIT_UNDER_LOAD_S = 0.5
#: Pause between two hostile requests of the one hostile client.
PAUSE_S = 0.5
#: Tokens each served hostile request asks for: the point is what the server does before
#: generating, and 128 sequences of a few dozen tokens take minutes on a busy CPU.
MAX_TOKENS = 2


@dataclass(frozen=True, slots=True)
class HostileCase:
    name: str
    path: str
    body: bytes
    expected: frozenset[int]


@dataclass(slots=True)
class HostileReport:
    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    longest_stall_s: float = 0.0
    watch: str = ""

    def summary(self) -> str:
        counts = {name: dict(counter) for name, counter in self.statuses.items()}
        return f"hostile: {counts}; {self.watch}; unexpected: {self.unexpected[:5] or 'none'}"


def _branches(count: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "x": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {f"field_{i:06d}": {"type": "string", "maxLength": 1024}},
                    }
                    for i in range(count)
                ]
            }
        },
    }


def _chat(**fields: Any) -> bytes:
    messages = [{"role": "user", "content": "Answer in JSON."}]
    return json.dumps({"messages": messages, "max_tokens": MAX_TOKENS, **fields}).encode()


def hostile_cases() -> list[HostileCase]:
    """The hostile requests (see the module docstring)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": _branches(44_000)}}

    def schema_format(count: int) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": _branches(count)}}

    bad = frozenset({400})
    served = frozenset({200, 503})
    return [
        HostileCase("schema-44k", "/v1/chat/completions", _chat(tools=[tool]), bad),
        HostileCase(
            "schema-over-budget",
            "/v1/chat/completions",
            _chat(response_format=schema_format(5_000)),
            bad,
        ),
        HostileCase(
            "schema-compiles",
            "/v1/chat/completions",
            _chat(response_format=schema_format(2_000)),
            served,
        ),
        HostileCase(
            "fan-out",
            "/v1/completions",
            json.dumps({"prompt": ["Count."] * 128, "n": 16, "max_tokens": MAX_TOKENS}).encode(),
            bad,
        ),
        HostileCase(
            "fan-out-at-cap",
            "/v1/completions",
            json.dumps({"prompt": ["Count."] * 64, "n": 2, "max_tokens": MAX_TOKENS}).encode(),
            served,
        ),
        HostileCase(
            "surrogate",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
            bad,
        ),
        HostileCase(
            "digits",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1'
            + b"0" * 5000
            + b"}",
            bad,
        ),
    ]


async def run_hostile(
    url: str,
    cases: list[HostileCase],
    done: trio.Event,
    report: HostileReport,
    request_timeout: float,
) -> None:
    """Send ``cases`` in turn until ``done`` is set, at least once each."""
    if not cases:
        return
    # verify=False: loopback HTTP; see run_clients in soak.py
    async with httpx.AsyncClient(base_url=url, timeout=request_timeout, verify=False) as http:
        rounds = 0
        while rounds == 0 or not done.is_set():
            for case in cases:
                try:
                    response = await http.post(
                        case.path, content=case.body, headers={"Content-Type": "application/json"}
                    )
                except httpx.HTTPError as exc:
                    report.unexpected.append(f"{case.name}: {exc!r}")
                    continue
                report.statuses.setdefault(case.name, Counter())[response.status_code] += 1
                if response.status_code not in case.expected:
                    report.unexpected.append(
                        f"{case.name}: {response.status_code} {response.text[:200]}"
                    )
                await trio.sleep(PAUSE_S)
            rounds += 1
