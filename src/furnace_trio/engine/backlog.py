"""How much a request holds unsent: :class:`Backlog`, shared by the engine and the stream.

The engine never waits on a client: it hands each request's stream its messages with
``send_nowait`` on an unbounded channel, and the stream takes them only as fast as the
HTTP layer writes them out. A client that stops reading without closing (it looks just like
a slow one) would let the engine generate the whole ``max_tokens`` into that channel, about
2.6 KB of Python objects per token with 20 ``top_logprobs``, and ``n`` times that.

So each request has a backlog: the engine adds an estimate of each message's size in
response bytes (:func:`message_bytes`), the stream subtracts it when it takes the message.
Past ``limit`` the engine pauses the request: its sequences keep their KV blocks and their
running slot but take no steps. Once the stream has taken the backlog down to half the
limit, the engine resumes it, and the client sees nothing but a pause. The estimate errs
high (an SSE chunk of one token is about 150 bytes; one alternative in ``top_logprobs``
about 80), so ``limit`` bounds what a request's unsent messages hold to about the same
order of bytes. Plain Python, touched only on the Trio thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from furnace_trio.engine.messages import Message, PromptScores, Tokens

__all__ = ["TOKEN_BYTES", "TOP_LOGPROB_BYTES", "Backlog", "message_bytes"]

#: Estimated response bytes of one token's chunk (and of any other message).
TOKEN_BYTES = 256
#: Estimated response bytes of each alternative of a token's ``top_logprobs``.
TOP_LOGPROB_BYTES = 96


def message_bytes(message: Message) -> int:
    """The estimated size of a message in response bytes (see the module docstring)."""
    if isinstance(message, Tokens | PromptScores):
        tokens = message.tokens if isinstance(message, Tokens) else message.scores
        size = 0
        for token in tokens:
            size += TOKEN_BYTES + TOP_LOGPROB_BYTES * len(token.top_logprobs)
        return size
    return TOKEN_BYTES


@dataclass(slots=True, eq=False)
class Backlog:
    """Estimated response bytes the engine has sent a stream that it has not taken yet.

    Invariant: ``paused`` is true from the :meth:`add` that returned ``True`` (``held``
    went past ``limit``) to the :meth:`take` that returned ``True`` (``held`` fell to half
    of it or less); the engine pauses and resumes the request on exactly those calls.
    """

    limit: int
    held: int = 0
    paused: bool = False

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError("the backlog limit must be at least 1 byte")

    def add(self, nbytes: int) -> bool:
        """The engine sent ``nbytes`` more; whether the request must pause now."""
        self.held += nbytes
        if self.paused or self.held <= self.limit:
            return False
        self.paused = True
        return True

    def take(self, nbytes: int) -> bool:
        """The stream took ``nbytes``; whether the request may resume now."""
        self.held -= nbytes
        if not self.paused or self.held > self.limit // 2:
            return False
        self.paused = False
        return True
