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

:class:`Replay` checks one replay against what the client has: its first generated token
ids must be the ones already relayed, and what its deltas add up to (content, reasoning,
each tool call's name and arguments: a :class:`Transcript`) must extend what the client
has; only the part beyond goes out, in frames of the original stream (the caller stamps
its ``id``, ``created``, ``model``). A tool call the client has keeps the id it got; a new
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


@dataclass(slots=True)
class Call:
    """One tool call as its deltas add up."""

    id: str | None = None
    type: str | None = None
    name: str = ""
    arguments: str = ""


@dataclass(slots=True)
class Transcript:
    """What a streamed choice's deltas add up to: the text of each field, the tool calls."""

    texts: dict[str, str] = field(default_factory=dict)
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

    def _text(self, name: str, value: Any) -> None:
        if isinstance(value, str) and value:
            self.texts[name] = self.texts.get(name, "") + value

    def _call(self, piece: dict[str, Any]) -> None:
        index = piece.get("index")
        if not isinstance(index, int) or index < 0:
            index = max(len(self.calls) - 1, 0)
        while len(self.calls) <= index:
            self.calls.append(Call())
        call = self.calls[index]
        call.id = call.id or piece.get("id")
        call.type = call.type or piece.get("type")
        function = piece.get("function")
        if isinstance(function, dict):
            call.name += function.get("name") or ""
            call.arguments += function.get("arguments") or ""


def _beyond(sent: str, made: str, final: bool, what: str) -> str:
    """The part of ``made`` beyond ``sent``: ``""`` while the replay is behind (not at
    its end), :class:`Diverged` when they disagree."""
    if made.startswith(sent):
        return made[len(sent):]
    if sent.startswith(made) and not final:
        return ""
    raise Diverged(f"the replay's {what} differs from what the client has at character "
                   f"{_first_difference(sent, made)}")


def _first_difference(a: str, b: str) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


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
    made: Transcript = field(default_factory=Transcript)

    def __post_init__(self) -> None:
        self.expected = len(self.generated)

    @property
    def recomputed(self) -> int:
        """Generated tokens the replay computes again."""
        return self.expected

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
        self.made.add(choice, self.chat)
        out = self._new_parts(choice, finish is not None)
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

    def _new_parts(self, choice: dict[str, Any], final: bool) -> dict[str, Any] | None:
        if not self.chat:
            text = _beyond(self.sent.texts.get("text", ""), self.made.texts.get("text", ""),
                           final, "text")
            return {"index": 0, "text": text} if text else None
        delta: dict[str, Any] = {}
        for name in TEXT_FIELDS:
            text = _beyond(self.sent.texts.get(name, ""), self.made.texts.get(name, ""),
                           final, name)
            if text:
                delta[name] = text
        calls = self._new_calls(final)
        if calls:
            delta["tool_calls"] = calls
        return {"index": 0, "delta": delta} if delta else None

    def _new_calls(self, final: bool) -> list[dict[str, Any]]:
        sent, made = self.sent.calls, self.made.calls
        if final and len(made) < len(sent):
            raise Diverged(f"the replay made {len(made)} tool calls; the client had "
                           f"{len(sent)}")
        out = []
        for index, call in enumerate(made):
            if index >= len(sent):  # a call the client has not seen: the replay's own id
                out.append({"index": index, "id": call.id, "type": call.type or "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
                continue
            had = sent[index]
            name = _beyond(had.name, call.name, final, f"tool call {index}'s name")
            arguments = _beyond(had.arguments, call.arguments, final,
                                f"tool call {index}'s arguments")
            if name or arguments:
                function = {"name": name} if name else {}
                out.append({"index": index, "function": {**function,
                                                         "arguments": arguments}})
        return out
