"""Stop strings across token boundaries, with the least holdback.

A stop string can arrive split over several tokens (``"###"`` as ``"#"``, ``"##"``), so
text that might be the start of one is held back until the next fragment decides. Only
the longest suffix of the pending text that is a *proper prefix* of some stop string is
held: everything before it can never become part of a stop and is released at once.
When a stop string completes, the text before it is released and the stop string itself,
and anything after it, never is. With several stop strings the first to *complete* wins
(generation would have ended there), whatever the fragment boundaries::

    stops = ["STOP"]
    feed("hello S")  -> ("hello ", False)   # "S" held: could begin "STOP"
    feed("TO")       -> ("", False)         # "STO" held
    feed("P now")    -> ("", True)          # matched; " now" is dropped

I/O-free: the engine or the HTTP relay feeds it detokenized fragments.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds the first occurrence of any stop string in a stream of text fragments.

    Invariants: the concatenation of everything returned (by :meth:`feed`, then
    :meth:`flush` when nothing matched) equals the whole input up to the start of the
    first stop string to complete (earliest end; on a tie, earliest start), or the whole
    input when none occurs, however the input is split into fragments; the text held back is at
    every moment the longest suffix of the input that is a proper prefix of a stop
    string. With no stop strings it is a pass-through that holds nothing.
    """

    __slots__ = ("_held", "_matched_stop", "_max_len", "_prefixes", "_stops")

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise ValueError("stops must be a sequence of strings, not one string")
        for stop in stops:
            if not isinstance(stop, str):
                raise ValueError(f"stop strings must be str, not {type(stop).__name__}")
            if not stop:
                raise ValueError("stop strings must not be empty")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._prefixes: frozenset[str] = frozenset(
            stop[:i] for stop in self._stops for i in range(1, len(stop))
        )
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self._matched_stop: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings (deduplicated, in the given order)."""
        return self._stops

    @property
    def matched(self) -> bool:
        """Whether a stop string has been found (the matcher is then finished)."""
        return self._matched_stop is not None

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, or ``None``."""
        return self._matched_stop

    @property
    def held(self) -> str:
        """The text currently held back (a proper prefix of some stop string)."""
        return self._held

    def feed(self, text: str) -> tuple[str, bool]:
        """Add a fragment; return (text safe to emit now, whether a stop string matched).

        After a match every further call returns ``("", True)``.
        """
        if self._matched_stop is not None:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        # The stop that *completes* first wins (generation would have ended there); on a
        # tie, the one that starts first (it hides more). This makes the result independent
        # of how the text was split into fragments.
        first = -1
        first_end = -1
        first_stop: str | None = None
        for stop in self._stops:
            index = buffer.find(stop)
            if index == -1:
                continue
            end = index + len(stop)
            if first_stop is None or end < first_end or (end == first_end and index < first):
                first, first_end, first_stop = index, end, stop
        if first_stop is not None:
            self._matched_stop = first_stop
            self._held = ""
            return buffer[:first], True
        hold = 0
        for length in range(min(len(buffer), self._max_len - 1), 0, -1):
            if buffer[-length:] in self._prefixes:
                hold = length
                break
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """Release the held text at the natural end of the generation ("" after a match)."""
        held, self._held = self._held, ""
        return held


__all__ = ["StopStringMatcher"]
