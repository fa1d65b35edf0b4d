"""``stop`` and ``stop_token_ids``: where an answer ends early, as vLLM 0.32 ends it.

- ``stop_token_ids``: the answer ends at the first generated token whose id is listed;
  that token counts in the usage and ``token_ids`` but its text is left out (vLLM's
  detokenizer skips a stop token), ``stop_reason`` is the id;
- ``stop`` (a string or a list of them): after each token the new text, plus as many
  characters before it as a stop string could reach back, is searched for each stop
  string in the order given; the first found ends the answer, its text cut just
  *before* the stop string, ``stop_reason`` is that string. ``include_stop_str_in_output``
  keeps the stop string (or the stop token's text);
- either way ``finish_reason`` is "stop", even when the stopping token was also the
  ``max_tokens``-th (vLLM checks stop strings after the length cap);
- a stream holds back the last ``len(longest stop string) - 1`` characters until more
  text shows they do not start a stop string (vLLM's ``stop_buffer_length``): a token's
  frame may carry less text than the token, or none; the last frame carries the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stops:
    """A request's stop conditions (empty: none)."""

    strings: tuple[str, ...] = ()
    token_ids: frozenset[int] = frozenset()
    include_in_output: bool = False

    def __bool__(self) -> bool:
        return bool(self.strings or self.token_ids)

    @property
    def buffer_chars(self) -> int:
        """Characters a stream holds back (vLLM's ``stop_buffer_length``)."""
        if not self.strings or self.include_in_output:
            return 0
        return max(len(s) for s in self.strings) - 1


NO_STOPS = Stops()


@dataclass(frozen=True, slots=True)
class StopHit:
    """Where one choice's answer stopped: ``tokens`` generated (the stopping one
    included), the first ``chars`` characters of their text kept, and why."""

    tokens: int
    chars: int
    reason: str | int


def find_stop(
    stops: Stops, count: int, word: Callable[[int], str], token_id: Callable[[int], int]
) -> StopHit | None:
    """Where an answer of ``count`` tokens (``word(i)``, ``token_id(i)``) stops early, if
    it does."""
    if not stops:
        return None
    text = ""
    for i in range(count):
        piece = word(i)
        if token_id(i) in stops.token_ids:
            kept = len(text) + (len(piece) if stops.include_in_output else 0)
            return StopHit(i + 1, kept, token_id(i))
        text += piece
        for stop in stops.strings:
            at = text.find(stop, max(0, len(text) - len(piece) - len(stop) + 1))
            if at >= 0:
                return StopHit(i + 1, at + len(stop) if stops.include_in_output else at, stop)
    return None


class HeldText:
    """One streamed choice's text as vLLM releases it: all but the held-back tail of
    what was generated, the rest (up to a stop) with the last token."""

    __slots__ = ("_buffer", "_hit", "_sent", "_text")

    def __init__(self, buffer_chars: int, hit: StopHit | None) -> None:
        self._buffer = buffer_chars
        self._hit = hit
        self._text = ""
        self._sent = 0

    def delta(self, piece: str, last: bool) -> str:
        """The text a frame carries once the token ``piece`` was generated."""
        self._text += piece
        if last:
            end = self._hit.chars if self._hit is not None else len(self._text)
        else:
            end = len(self._text) - self._buffer
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent : end], end
        return out
