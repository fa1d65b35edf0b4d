"""Continuing a stream by replaying it: the request sent again, as it came, to another
backend, and only what the client has not received relayed.

Pure protocol logic on plain data (no I/O); ``gateway/proxy/continuation.py`` holds a
replayed stream's state and the relay (``gateway/proxy/relay.py``, ``upstream.py``)
drives it.

Why a replay and not a continuation from token ids (``docs/reliability.md``): tool calls
and structured output are server state a token-id prompt cannot carry. vLLM 0.32 turns
generated text into ``tool_calls`` deltas with a per-request parser in its API server
(``parser.parse_delta``), and advances a structured-output grammar only over generated
tokens (``StructuredOutputManager.accept_tokens``): a prompt of generated ids restarts it
at its root, and neither ``/v1/completions``, chat's ``continue_final_message`` nor
``/inference/v1/generate`` (token ids plus ``SamplingParams``) takes a grammar state or a
prefix it must accept. Sending the original request again rebuilds both exactly, provided
the generation is deterministic: greedy, or seeded (:func:`seeded` gives a sampled request
a seed at its first dispatch, so a replay draws the same tokens).

:class:`Replay` checks one replay against what the client has (a :class:`Transcript`:
what its deltas add up to, content, reasoning, each tool call's name and arguments): the
replay's first generated token ids must be the ones already relayed, and each of its text
fields must run through what the client has of it (a :class:`Seam` per field, each piece
checked once: the original stream only appends pieces, so recording it costs each frame
one append); only the part beyond goes out, in frames of the original stream (the caller
stamps its ``id``, ``created``, ``model``). A tool call the client has keeps the id it got; a new
one carries the replay's. A replay that differs raises :class:`Diverged` (the relay ends
the stream with an error event rather than duplicate or corrupt text). Where the seam
falls inside a replay's frame (vLLM puts several tokens in one when the reader lags), the
text beyond it is cut by the transcripts, not by tokens: the text an answer's first
tokens decode to does not depend on how they were framed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the delta fields whose text adds up (vLLM 0.32 says ``reasoning``, older ``reasoning_content``)
TEXT_FIELDS = ("content", "reasoning", "reasoning_content")
SEED_RANGE = 2**31  # vLLM takes any int; a 31-bit one suits every sampler


class Diverged(Exception):
    """A replay does not reproduce what the client has received."""


def seeded(body: dict[str, Any], seed: int) -> dict[str, Any]:
    """``body`` with ``seed`` when its sampling is random and unseeded (a replay must draw
    the same tokens); a greedy or seeded body as it is."""
    if body.get("seed") is not None or body.get("temperature") == 0:
        return body
    return {**body, "seed": seed}


class Text:
    """Text that grows by pieces (appending is O(1): the original stream's every frame
    adds one; :meth:`value` joins them)."""

    __slots__ = ("_parts",)

    def __init__(self, text: str = "") -> None:
        self._parts = [text] if text else []

    def add(self, piece: str) -> None:
        if piece:
            self._parts.append(piece)

    def value(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Text) and self.value() == other.value()

    def __repr__(self) -> str:
        return repr(self.value())


@dataclass(slots=True)
class Call:
    """One tool call as its deltas add up."""

    id: str | None = None
    type: str | None = None
    name: Text = field(default_factory=Text)
    arguments: Text = field(default_factory=Text)


@dataclass(slots=True)
class Transcript:
    """What a streamed choice's deltas add up to: the text of each field, the tool calls."""

    texts: dict[str, Text] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    def add(self, choice: dict[str, Any], chat: bool) -> None:
        """A choice of a chunk (chat: its ``delta``; a completion: its ``text``)."""
        if not chat:
            self._text("text", choice.get("text"))
            return
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        for name in TEXT_FIELDS:
            self._text(name, delta.get(name))
        for piece in delta.get("tool_calls") or ():
            if isinstance(piece, dict):
                self._call(piece)

    def text(self, name: str) -> str:
        have = self.texts.get(name)
        return "" if have is None else have.value()

    def _text(self, name: str, value: Any) -> None:
        if isinstance(value, str) and value:
            self.texts.setdefault(name, Text()).add(value)

    def _call(self, piece: dict[str, Any]) -> None:
        call = self.call(piece.get("index"))
        call.id = call.id or piece.get("id")
        call.type = call.type or piece.get("type")
        function = piece.get("function")
        if isinstance(function, dict):
            call.name.add(function.get("name") or "")
            call.arguments.add(function.get("arguments") or "")

    def call(self, index: Any) -> Call:
        """The call at ``index`` (added when new; a piece without a valid index belongs
        to the last call)."""
        at = index if isinstance(index, int) and index >= 0 else max(len(self.calls) - 1, 0)
        while len(self.calls) <= at:
            self.calls.append(Call())
        return self.calls[at]


class Seam:
    """One text field of a replay against what the client has of it (``sent``): the
    replay's pieces are checked against ``sent`` until they pass its end; the part beyond
    is new. Each piece costs its own length."""

    __slots__ = ("pos", "sent", "what")

    def __init__(self, sent: str, what: str) -> None:
        self.sent, self.what, self.pos = sent, what, 0

    def feed(self, piece: str) -> str:
        """The part of ``piece`` beyond what the client has; :class:`Diverged` when it
        disagrees with it."""
        start, self.pos = self.pos, self.pos + len(piece)
        if start >= len(self.sent):
            return piece
        have = self.sent[start:self.pos]
        if not piece.startswith(have):
            at = start + next(k for k, (x, y) in enumerate(zip(have, piece, strict=False))
                              if x != y)
            raise Diverged(f"the replay's {self.what} differs from what the client has "
                           f"at character {at}")
        return piece[len(have):]

    def end(self) -> None:
        """The replay's answer ended: it must have reached what the client has."""
        if self.pos < len(self.sent):
            raise Diverged(f"the replay's {self.what} ended at character {self.pos}; the "
                           f"client had {len(self.sent)}")


@dataclass(slots=True)
class Replay:
    """One replay of an answer: ``sent`` (what the client has, extended as the replay's
    new parts go out) and ``generated`` (the token ids the client has, extended alike);
    the first ``len(generated)`` ids of the replay must be those."""

    chat: bool
    sent: Transcript
    generated: list[int]
    prompt_ids: list[int] | None = None
    expected: int = 0  # ids the replay must reproduce before anything goes out
    seen: int = 0  # of those, compared so far
    seams: dict[str, Seam] = field(default_factory=dict)  # texts, then "name i", "args i"
    calls: int = 0  # tool calls the client has (their ids included)

    def __post_init__(self) -> None:
        self.expected = len(self.generated)
        self.calls = len(self.sent.calls)

    def prompt(self, ids: Any) -> None:
        """The replay's prompt ids (its first frame): the original's, or it diverged."""
        if (self.prompt_ids is not None and isinstance(ids, list) and ids
                and ids != self.prompt_ids):
            raise Diverged("the replay's prompt is not the original's (another chat "
                           "template or tokenizer?)")

    def choice(self, choice: dict[str, Any], wants_ids: bool) -> dict[str, Any] | None:
        """A replay's choice: the original endpoint's choice carrying only what is new
        to the client; ``None`` when nothing is."""
        new_ids = self._ids(choice.get("token_ids"))
        finish = choice.get("finish_reason")
        if finish is not None and self.seen < self.expected:
            raise Diverged(f"the replay ended after {self.seen} tokens; the client had "
                           f"{self.expected}")
        out = self._new_parts(choice)
        if finish is not None:
            self._ended()
        if out is None and not new_ids and finish is None:
            return None
        if out is None:
            out = {"index": 0, "delta": {}} if self.chat else {"index": 0, "text": ""}
        self.sent.add(out, self.chat)
        self.generated += new_ids
        out.update(logprobs=None, finish_reason=finish,
                   token_ids=new_ids if wants_ids else None)
        if finish is not None or not self.chat:
            out["stop_reason"] = choice.get("stop_reason")
        if not self.chat:
            out["prompt_token_ids"] = None
        return out

    def _ids(self, ids: Any) -> list[int]:
        """The ids of a replay's choice beyond those the client has, the others checked."""
        if not isinstance(ids, list):
            return []
        k = 0
        while k < len(ids) and self.seen < self.expected:
            if ids[k] != self.generated[self.seen]:
                raise Diverged(f"the replay's token {self.seen} is {ids[k]}, the client's "
                               f"was {self.generated[self.seen]}")
            k += 1
            self.seen += 1
        return list(ids[k:])

    def _seam(self, key: str, sent: Text | None, what: str) -> Seam:
        seam = self.seams.get(key)
        if seam is None:
            seam = self.seams[key] = Seam("" if sent is None else sent.value(), what)
        return seam

    def _new_parts(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        if not self.chat:
            text = choice.get("text")
            new = self._seam("text", self.sent.texts.get("text"), "text").feed(
                text if isinstance(text, str) else "")
            return {"index": 0, "text": new} if new else None
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return None
        out: dict[str, Any] = {}
        for name in TEXT_FIELDS:
            piece = delta.get(name)
            if isinstance(piece, str) and piece:
                new = self._seam(name, self.sent.texts.get(name), name).feed(piece)
                if new:
                    out[name] = new
        calls = [c for piece in delta.get("tool_calls") or () if isinstance(piece, dict)
                 if (c := self._new_call(piece)) is not None]
        if calls:
            out["tool_calls"] = calls
        return {"index": 0, "delta": out} if out else None

    def _new_call(self, piece: dict[str, Any]) -> dict[str, Any] | None:
        """What of a replay's tool-call piece is new to the client: a call it has keeps
        the id it got; one it has not comes with the replay's id, type and name."""
        index = piece.get("index")
        if not isinstance(index, int) or index < 0:
            index = max(len(self.sent.calls) - 1, 0)
        function = piece.get("function")
        function = function if isinstance(function, dict) else {}
        had = self.sent.calls[index] if index < len(self.sent.calls) else None
        name = self._seam(f"name {index}", None if had is None else had.name,
                          f"tool call {index}'s name").feed(function.get("name") or "")
        arguments = self._seam(f"args {index}", None if had is None else had.arguments,
                               f"tool call {index}'s arguments").feed(
            function.get("arguments") or "")
        if index >= self.calls:  # new to the client: as the replay says it
            self.calls = index + 1
            return {"index": index, **({"id": piece["id"]} if piece.get("id") else {}),
                    "type": piece.get("type") or "function",
                    "function": {"name": name, "arguments": arguments}}
        if not (name or arguments):
            return None
        return {"index": index, "function": {**({"name": name} if name else {}),
                                             "arguments": arguments}}

    def _ended(self) -> None:
        """The replay's answer ended: it reached all the client has."""
        for name in TEXT_FIELDS if self.chat else ("text",):
            self._seam(name, self.sent.texts.get(name), name).end()
        for index, call in enumerate(self.sent.calls):
            self._seam(f"name {index}", call.name, f"tool call {index}'s name").end()
            self._seam(f"args {index}", call.arguments,
                       f"tool call {index}'s arguments").end()
