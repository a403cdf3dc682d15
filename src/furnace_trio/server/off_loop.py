"""Work whose cost the client chooses, run off the event loop: decoding and validating a
request body, and compiling its grammar.

What frees the loop, measured on 2 cores with CPython 3.11: C code holds the GIL whether
it runs on the Trio thread or in a worker (``json.loads`` of a 3.9 MiB body stalls the
loop for about 200 ms either way), while Python code in a worker hands the GIL back at
each switch interval (the loop's longest stall beside a busy Python thread was about
20 ms). llguidance releases the GIL for most of a compilation but not while it turns a
JSON schema into a grammar. So the work runs in worker threads, and whatever would hold
the GIL for long is bounded before it starts:

- decoding: at most :data:`~furnace_trio.server.schemas.MAX_JSON_VALUES` values, with a
  Python frame per object so that the loop gets its turns (see
  :mod:`~furnace_trio.server.protocol`);
- schemas: at most ``FURNACE_MAX_SCHEMA_NODES`` values, checked against their meta-schema
  in Rust (see :mod:`~furnace_trio.server.schema_check`).

Each kind of work has its own :class:`trio.CapacityLimiter`, so hostile bodies can neither
take the worker threads that rendering and tokenizing use (Trio's default limiter) nor
crowd the GIL with dozens of threads. Compiling a grammar also has a time budget: past it
the request is a 400, and the thread (which cannot be stopped) is abandoned. It keeps its
limiter slot until it ends, so abandoned work never exceeds :data:`COMPILE_THREADS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from furnace_trio.server.errors import invalid_request

__all__ = ["COMPILE_THREADS", "COMPILE_TIME_BUDGET_S", "PARSE_THREADS", "OffLoop"]

T = TypeVar("T")

#: Request bodies decoded and validated at once (each takes well under a second).
PARSE_THREADS = 2
#: Grammars compiled at once.
COMPILE_THREADS = 2
#: How long a request's grammar may take to compile, waiting for a thread included. Within
#: the schema budget a compilation takes up to a few seconds on a busy 2-core machine.
COMPILE_TIME_BUDGET_S = 10.0


def _limiter(threads: int) -> Callable[[], trio.CapacityLimiter]:
    return lambda: trio.CapacityLimiter(threads)


@dataclass(slots=True)
class OffLoop:
    """The worker threads for client-chosen work, and the compile time budget."""

    parse_limiter: trio.CapacityLimiter = field(default_factory=_limiter(PARSE_THREADS))
    compile_limiter: trio.CapacityLimiter = field(default_factory=_limiter(COMPILE_THREADS))
    compile_budget_s: float = COMPILE_TIME_BUDGET_S

    async def parse(self, parse: Callable[[], T]) -> T:
        """``parse()`` (a body's decoding and validation) in a worker thread."""
        return await trio.to_thread.run_sync(parse, limiter=self.parse_limiter)

    async def compile(self, compile_grammar: Callable[[], T], param: str) -> T:
        """``compile_grammar()`` in a worker thread, or a 400 naming ``param`` when it takes
        longer than the budget."""
        with trio.move_on_after(self.compile_budget_s):
            return await trio.to_thread.run_sync(
                compile_grammar, limiter=self.compile_limiter, abandon_on_cancel=True
            )
        raise invalid_request(
            f"the grammar for {param} did not compile within {self.compile_budget_s:g} s; "
            "send a simpler schema",
            param,
        )
