"""Grammar-constrained decoding with llguidance: JSON, JSON schema, forced tool calls.

Why llguidance: it has no dependencies (xgrammar requires an unpinned ``torch``, ``triton``
and ``transformers``, which this project cannot take), and its masks are cheap on the
SmolLM2 vocabulary (49,152 tokens): tens of microseconds per token for a JSON schema
(``benchmarks/bench_grammar.py``; the figures are in docs/benchmarks.md).

Where the state lives: each request gets one :class:`GrammarConstraint` in its
:class:`~furnace_trio.core.params.SamplingParams`. The sampler calls
:meth:`GrammarConstraint.allowed` on the runner's thread, inside the model step, with the
tokens the sequence has produced; the constraint advances a matcher per sequence (so
``n > 1`` works) and returns its mask. Nothing runs on the Trio thread, constrained and
unconstrained requests share steps, and the mask needs no extra round trip through the
engine. Grammar compilation runs in a worker thread from the handler; the one-off
tokenizer conversion (:meth:`GrammarCompiler.warm`, ~0.7 s holding the GIL) runs while
the model loads.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from furnace_trio.core.tokens import common_prefix
from furnace_trio.loading.tokenizer import Tokenizer
from furnace_trio.tools.schema_bounds import ANY_VALUE_DEFS, bounded_schema, bounded_subschema

logger = logging.getLogger(__name__)

__all__ = ["GrammarCompiler", "GrammarConstraint", "GrammarError"]

#: Compact JSON: a tiny model given free whitespace tends to emit it forever.
_COMPACT = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The grammar (a schema the client sent) cannot be compiled."""


class GrammarConstraint:
    """A compiled grammar and one matcher per sequence (see the module docstring).

    Invariant: a matcher has consumed exactly the tokens in ``consumed[seq_id]``: the
    sequence's output so far, and with speculative decoding the drafts whose positions
    were sampled, which the next call rolls back where the output parted from them. A token
    the grammar rejects (it cannot be sampled under the mask, but an
    ``ignore_eos`` run or a mismatched vocabulary could produce one) lifts the constraint for
    that sequence rather than failing the request: logged, never silent.
    """

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        grammar: str,
        *,
        end_on_repeat: tuple[str, str] | None = None,
    ) -> None:
        self._template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._template.is_error():
            raise GrammarError(self._template.get_error())
        self._tokenizer = tokenizer
        self._vocab = tokenizer.vocab_size
        self._end_on_repeat = end_on_repeat
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._consumed: dict[int, list[int]] = {}
        # How many consumed tokens are the sequence's own output (never rolled back), and
        # the drafts whose positions the sampler is about to ask for (valid_drafts).
        self._settled: dict[int, int] = {}
        self._ahead: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._lifted: set[int] = set()

    def allowed(self, seq_id: int, output_token_ids: Sequence[int]) -> np.ndarray | None:
        ahead = self._ahead.get(seq_id)
        drafting = ahead is not None and _follows(output_token_ids, *ahead)
        if not drafting:
            self._ahead.pop(seq_id, None)
        matcher = self._synced(seq_id, output_token_ids, settle=not drafting)
        if matcher is None:
            return None
        mask = allocate_token_bitmask(1, self._vocab)
        fill_next_token_bitmask(matcher, mask)
        if (
            self._end_on_repeat is not None
            and output_token_ids
            and matcher.is_accepting()
            and _last_block_repeats(
                self._tokenizer.decode_str(list(output_token_ids)), *self._end_on_repeat
            )
        ):
            mask[0] &= _eos_mask(self._tokenizer.eos_tokens, mask.shape[1])
        return mask[0]

    def valid_drafts(
        self, seq_id: int, output_token_ids: Sequence[int], drafts: Sequence[int]
    ) -> int:
        """How many of ``drafts``, proposed after ``output_token_ids``, the grammar takes
        in a row (all of them where the constraint is lifted); nothing is consumed."""
        matcher = self._synced(seq_id, output_token_ids, settle=True)
        if matcher is None:
            return len(drafts)
        valid = int(matcher.validate_tokens(list(drafts)))
        self._ahead[seq_id] = (len(output_token_ids), tuple(drafts[:valid]))
        return valid

    def _synced(
        self, seq_id: int, output_token_ids: Sequence[int], *, settle: bool
    ) -> llguidance.LLMatcher | None:
        """The sequence's matcher after exactly ``output_token_ids`` (``None``: lifted):
        drafts it consumed that the output does not hold rolled back, new tokens consumed.
        Only the tokens past the settled ones are compared; ``settle``: these are the
        sequence's own output (not a draft position's), so they settle."""
        if seq_id in self._lifted:
            return None
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            matcher = self._matchers[seq_id] = self._template.deep_copy()
        consumed = self._consumed.setdefault(seq_id, [])
        settled = self._settled.get(seq_id, 0)
        if settled > len(output_token_ids):  # not an extension of the settled output
            settled = 0
        keep = settled + common_prefix(consumed[settled:], output_token_ids[settled:])
        if keep < len(consumed):
            matcher.rollback(len(consumed) - keep)
            del consumed[keep:]
        for token in output_token_ids[keep:]:
            if not matcher.consume_token(token):
                logger.warning(
                    "grammar rejected token %d of seq %d (%s); constraint lifted",
                    token,
                    seq_id,
                    matcher.get_error(),
                )
                self._lifted.add(seq_id)
                return None
            consumed.append(token)
        if settle:
            self._settled[seq_id] = len(consumed)
        return matcher


def _follows(tokens: Sequence[int], start: int, drafts: tuple[int, ...]) -> bool:
    """Whether ``tokens`` are a draft position's: ``start`` tokens and then a prefix of
    ``drafts``."""
    return start <= len(tokens) <= start + len(drafts) and (
        tuple(tokens[start:]) == drafts[: len(tokens) - start]
    )


def _last_block_repeats(text: str, start: str, end: str) -> bool:
    """Whether ``text`` ends in a ``start ... end`` block (whitespace after it aside) whose
    body equals an earlier block's."""
    text = text.rstrip()
    if not text.endswith(end):
        return False
    bodies = [part.split(end, 1)[0] for part in text.split(start)[1:]]
    return len(bodies) > 1 and bodies[-1] in bodies[:-1]


def _eos_mask(eos: Sequence[int], words: int) -> np.ndarray:
    """A bitmask row allowing only the end-of-sequence tokens."""
    row = np.zeros(words, dtype=np.uint32)
    for token in eos:
        row[token // 32] |= np.uint32(1 << (token % 32))
    return row.view(np.int32)


class GrammarCompiler:
    """Builds constraints for one tokenizer; the llguidance tokenizer is made on first use.

    Thread-safe (handlers call it from worker threads).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build the llguidance tokenizer now. It takes 0.6 to 0.8 s on the default model's
        vocabulary and holds the GIL throughout, so a server builds it before it serves
        rather than on its first grammar request (which would stall every other request)."""
        self._ll_tokenizer()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                eos = sorted(self._tokenizer.eos_token_ids)
                self._ll = llguidance.LLTokenizer(
                    self._tokenizer._hf.to_str(),
                    n_vocab=self._tokenizer.vocab_size,
                    eos_token=eos,
                )
            return self._ll

    def json_schema(self, schema: Mapping[str, Any] | None) -> GrammarConstraint:
        """Any JSON object (``schema is None``), or one valid against ``schema``; numbers
        the schema leaves unbounded are bounded (see :mod:`~furnace_trio.tools.schema_bounds`)."""
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            bounded_schema(schema), defaults={"whitespace_flexible": False}
        )
        return GrammarConstraint(self._ll_tokenizer(), grammar)

    def tool_calls(
        self, tools: Mapping[str, Mapping[str, Any] | None], *, parallel: bool
    ) -> GrammarConstraint:
        """Hermes-style ``<tool_call>`` blocks calling one of ``tools`` with valid arguments.

        The output is exactly what :class:`~furnace_trio.tools.tool_calls.ToolCallParser` reads in
        the ``hermes`` format, so a forced call always parses.
        """
        if not tools:
            raise GrammarError("no tools to call")
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "arguments": bounded_subschema(schema or None),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, schema in tools.items()
        ]
        call_schema = options[0] if len(options) == 1 else {"anyOf": options}
        call_schema = {**call_schema, "x-guidance": _COMPACT, "$defs": ANY_VALUE_DEFS}
        body = f'"<tool_call>\\n" %json {json.dumps(call_schema)} "\\n</tool_call>"'
        # Generation may end after any complete call, a trailing newline included; a
        # call that repeats an earlier one of the same output ends it (see
        # GrammarConstraint: a small model otherwise repeats its call until max_tokens).
        start = 'start: call ("\\n" call)* "\\n"?' if parallel else 'start: call "\\n"?'
        lark = f"{start}\ncall: {body}\n"
        return GrammarConstraint(
            self._ll_tokenizer(),
            llguidance.LLMatcher.grammar_from_lark(lark),
            end_on_repeat=("<tool_call>", "</tool_call>") if parallel else None,
        )
