"""``stop`` strings across a continuation's seam, applied as vLLM 0.32 applies them
(``vllm/v1/engine/detokenizer.py``: ``BaseIncrementalDetokenizer.update``,
``check_stop_strings``, ``get_next_output_text``). Pure: plain data in and out.

vLLM holds back the last ``len(longest stop) - 1`` characters of a stream's text while a
stop string may be forming there (none with ``include_stop_str_in_output``), so when a
backend fails the client has less text than the token ids generated: the *tail*. A
continuation's vLLM detokenizes the generated ids as its prompt and checks stop strings
only in its own new text, so a stop string that began in the tail and ends in the new
text would go unseen, and the tail itself would never be sent.

So fairgate takes over the text at the seam (:class:`SeamText`): it learns the whole
text of the ids generated so far (the backend's ``/detokenize``; ``upstream.py``), asks
the continuation for its stop strings *with* ``include_stop_str_in_output`` (no text held
back, so each chunk's text is its tokens' text, and a stop string inside the new text
still ends it at the same token: fairgate cuts the string off unless the client kept
it), holds the text back as the uninterrupted run's detokenizer would have, and itself
looks for a stop string across the seam: found, it ends the answer there
(``finish_reason`` "stop", ``stop_reason`` the string) and the continuation is closed.

Where a chunk holds several tokens (vLLM puts several in one when its output is read
late), a stop string across the seam completed in it keeps all of the chunk's tokens, and
``min_tokens`` is judged by the chunk's last token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StopStrings:
    """A request's ``stop`` strings and how vLLM applies them."""

    strings: tuple[str, ...]
    include: bool  # include_stop_str_in_output
    min_tokens: int = 0

    @classmethod
    def of(cls, body: dict[str, Any]) -> StopStrings | None:
        """The body's stop strings; ``None`` when it sets none."""
        stop = body.get("stop")
        strings = (stop,) if isinstance(stop, str) else tuple(
            s for s in stop if isinstance(s, str)) if isinstance(stop, list) else ()
        if not strings:
            return None
        min_tokens = body.get("min_tokens")
        return cls(strings, bool(body.get("include_stop_str_in_output")),
                   min_tokens if isinstance(min_tokens, int) and min_tokens > 0 else 0)

    @property
    def buffer(self) -> int:
        """Characters a stream holds back (vLLM's ``stop_buffer_length``)."""
        return 0 if self.include else max(len(s) for s in self.strings) - 1


@dataclass(slots=True)
class Piece:
    """What a continuation's chunk becomes for the client."""

    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    cut: bool = False  # fairgate ended the answer: the continuation's rest is dropped


class SeamText:
    """The text of a stop-string answer from its seam on: ``text``, everything the
    uninterrupted run's detokenizer would hold (the client got the first ``sent``
    characters; the seam is at ``seam``), and ``tokens`` generated so far.

    A stop string inside the continuation's own text is vLLM's to find (it knows each
    token's text and ``min_tokens`` exactly): its chunk ends there, the stop string kept
    (asked with ``include_stop_str_in_output``), and fairgate cuts it off unless the client
    kept it. fairgate looks only for a stop string across the seam: begun before it,
    completed by the continuation's first characters."""

    __slots__ = ("finished", "seam", "sent", "stops", "text", "tokens")

    def __init__(self, stops: StopStrings, text: str, sent: int, tokens: int) -> None:
        self.stops, self.text, self.sent, self.tokens = stops, text, sent, tokens
        self.seam = len(text)
        self.finished = False

    def feed(self, text: str, tokens: int, finish: str | None,
             stop_reason: str | int | None) -> Piece:
        """One continuation chunk: its text (asked with ``include_stop_str_in_output``),
        the number of its token ids, its ``finish_reason`` and ``stop_reason``."""
        self.tokens += tokens
        stops = self.stops
        if (finish == "stop" and not isinstance(stop_reason, str) and not stops.include
                and tokens == 1):
            # a stop token (EOS or stop_token_ids): vLLM leaves its text out unless asked
            text = ""
        before = len(self.text)
        self.text += text
        longest = max(len(s) for s in stops.strings)
        if before < self.seam + longest - 1 and self.tokens > stops.min_tokens:
            found = self._across()
            if found is not None:
                stop, at = found
                self.text = self.text[:at + len(stop) if stops.include else at]
                return self._released("stop", stop, cut=True)
        if finish == "stop" and isinstance(stop_reason, str) and not stops.include:
            # vLLM's own find, kept in its text: cut off as the client asked
            if self.text.endswith(stop_reason):
                self.text = self.text[:len(self.text) - len(stop_reason)]
        return self._released(finish, stop_reason)

    def _across(self) -> tuple[str, int] | None:
        """The stop string across the seam that completes first (ties: the list's
        order), and where it begins."""
        best: tuple[str, int] | None = None
        for stop in self.stops.strings:
            at = self.text.find(stop, max(0, self.seam + 1 - len(stop)))
            if 0 <= at < self.seam and (best is None or at + len(stop) < best[1] + len(
                    best[0])):
                best = (stop, at)
        return best

    def _released(self, finish: str | None, stop_reason: str | int | None,
                  cut: bool = False) -> Piece:
        end = len(self.text) if finish is not None else len(self.text) - self.stops.buffer
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        self.finished = finish is not None
        return Piece(out, finish, stop_reason, cut)


def seam_tail(full: str, prompt: str, sent: str) -> str | None:
    """The text held back at the seam: what the generated ids decode to (``full``, the
    prompt's and generated ids decoded together, less ``prompt``, the prompt's ids
    decoded) beyond ``sent``, what the client got; ``None`` when they disagree (the ids
    decode otherwise than the stream did: nothing exact can follow)."""
    if not full.startswith(prompt):
        return None
    output = full[len(prompt):]
    if not output.startswith(sent):
        return None
    return output[len(sent):]
