"""StopStringMatcher: exact output at every split of the input, least holdback."""

from __future__ import annotations

import itertools
import random

import pytest

from furnace_trio.text.stop_strings import StopStringMatcher


def expected_output(text: str, stops: list[str]) -> tuple[str, bool]:
    """The reference: text up to the stop that completes first (then: starts first)."""
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) != -1]
    return (text[: min(hits)[1]], True) if hits else (text, False)


def run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out: list[str] = []
    for piece in pieces:
        emitted, matched = matcher.feed(piece)
        out.append(emitted)
        if matched:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def splits(text: str, max_cuts: int = 3) -> list[list[str]]:
    """Every way to cut ``text`` at up to ``max_cuts`` boundaries (empty pieces included)."""
    result = []
    positions = range(len(text) + 1)
    for n in range(max_cuts + 1):
        for cuts in itertools.combinations_with_replacement(positions, n):
            bounds = [0, *cuts, len(text)]
            result.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return result


CASES = [
    (["STOP"], "hello STOP world"),
    (["STOP"], "STOP at the start"),
    (["STOP"], "ends with STO"),
    (["STOP"], "SSTSTOSTOP"),
    (["ab", "bc"], "xabcx"),
    (["bc", "ab"], "xxbcab"),
    (["aa"], "aaa"),
    (["abab"], "abababab"),
    (["\n\n", "User:"], "line\nUser: hi\n\n"),
    (["é", "😀"], "café 😀"),
    (["x"], "x"),
    (["long stop string", "lo"], "hello long stop"),
    (["abc", "b"], "aabcc"),
    (["</s>", "<|end|>"], "answer <|en <|end|> tail"),
]


@pytest.mark.parametrize(("stops", "text"), CASES)
def test_every_split_gives_text_up_to_first_stop(stops: list[str], text: str) -> None:
    want = expected_output(text, stops)
    for pieces in splits(text):
        assert run(stops, pieces) == want, pieces


def test_random_texts_over_small_alphabet() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 12)))
        want = expected_output(text, stops)
        for pieces in splits(text, max_cuts=2):
            assert run(stops, pieces) == want, (stops, pieces)


def test_holdback_is_the_longest_suffix_that_starts_a_stop() -> None:
    stops = ["abcd", "xyz"]
    prefixes = {s[:i] for s in stops for i in range(1, len(s))}
    text = "qqabcxyabxaabcabcdq"
    matcher = StopStringMatcher(stops)
    seen = ""
    for char in text:
        _, matched = matcher.feed(char)
        if matched:
            break
        seen += char
        held = matcher.held
        assert seen.endswith(held)
        longest = max((k for k in range(1, len(seen) + 1) if seen[-k:] in prefixes), default=0)
        assert len(held) == longest, (seen, held)


def test_released_immediately_when_no_prefix_can_match() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("hello S") == ("hello ", False)
    assert matcher.held == "S"
    assert matcher.feed("X") == ("SX", False)
    assert matcher.feed("ST") == ("", False)
    assert matcher.feed("OP tail") == ("", True)
    assert matcher.matched_stop == "STOP"
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_at_the_very_start() -> None:
    matcher = StopStringMatcher(["<end>"])
    assert matcher.feed("<end>rest") == ("", True)


def test_overlapping_stops_the_first_to_complete_wins() -> None:
    matcher = StopStringMatcher(["bcd", "abcdef"])
    assert matcher.feed("xabcd") == ("xa", True)
    assert matcher.matched_stop == "bcd"
    # "b" completes before "abc" does, even though "abc" starts earlier.
    matcher = StopStringMatcher(["abc", "b"])
    assert matcher.feed("aabcc") == ("aa", True)
    assert matcher.matched_stop == "b"
    # Same end: the one starting first hides more.
    matcher = StopStringMatcher(["bc", "abc"])
    assert matcher.feed("xabc") == ("x", True)
    assert matcher.matched_stop == "abc"


def test_empty_stop_list_is_pass_through() -> None:
    matcher = StopStringMatcher([])
    for piece in ["a", "", "<|im_end|>", "\n"]:
        assert matcher.feed(piece) == (piece, False)
        assert matcher.held == ""
    assert matcher.flush() == ""


def test_flush_releases_held_prefix() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("title ##") == ("title ", False)
    assert matcher.flush() == "##"


@pytest.mark.parametrize("bad", [[""], ["ok", ""], "STOP", [None]])
def test_invalid_stops_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(bad)  # type: ignore[arg-type]
