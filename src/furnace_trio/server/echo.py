"""``echo`` for ``/v1/completions``: each choice's prompt before its completion.

The prompt's text goes in front of each choice's first delta. With ``logprobs``, the
request was submitted with ``prompt_logprobs``: the engine's first delta of each sample
carries the scores of the prompt's tokens after the first, and :class:`Echo` puts the
first token (no logprob: nothing precedes it) and those scores in front of the sample's
own logprobs, as OpenAI's and vLLM's ``echo`` do. So ``token_logprobs[:len(prompt)]`` are
the prompt's (``None`` first), which is what evaluation harnesses read to score a text.
With ``max_tokens`` 0 (``generated=False``) a choice is its prompt alone: the one token
the engine computed (it always computes one) is dropped, and the choice ends with
``length`` and no completion tokens.
No I/O, no Trio.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from furnace_trio.engine import Delta, Finished, LogprobEntry


class Echo:
    """Maps a response's engine events: choice ``i`` echoes prompt ``i // n``, whose text
    is ``texts[i // n]`` and whose first token's (unscored) entry is ``firsts[i // n]``."""

    def __init__(
        self,
        texts: Sequence[str],
        firsts: Sequence[LogprobEntry],
        n: int,
        *,
        want_logprobs: bool,
        generated: bool = True,
    ) -> None:
        self._texts = tuple(texts)
        self._firsts = tuple(firsts)
        self._n = n
        self._want_logprobs = want_logprobs
        self._generated = generated
        self._echoed: set[int] = set()

    def translate(self, event: object) -> list[object]:
        if not isinstance(event, Delta | Finished):
            return [event]
        if event.index in self._echoed:
            if self._generated:
                return [event]
            if isinstance(event, Delta):
                return []  # the computed token that max_tokens 0 does not want
            return [Finished(event.index, "length", 0)]
        self._echoed.add(event.index)
        prompt = event.index // self._n
        first = (self._firsts[prompt],) if self._want_logprobs else ()
        if isinstance(event, Finished):  # it ended before any delta (logprobs off)
            end = event if self._generated else Finished(event.index, "length", 0)
            return [Delta(event.index, self._texts[prompt], (), first), end]
        own = event.text if self._generated else ""
        logprobs = event.logprobs if self._generated else ()
        if self._want_logprobs:
            logprobs = (*first, *(event.prompt_logprobs or ()), *logprobs)
        return [
            dataclasses.replace(
                event,
                text=self._texts[prompt] + own,
                token_ids=event.token_ids if self._generated else (),
                logprobs=logprobs,
            )
        ]
