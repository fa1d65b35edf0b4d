"""Continuing a running answer on another backend: what fairgate keeps of a chat or
completion stream, the request that continues it, and the re-framing of what comes back.

Pure protocol logic on plain data (no I/O); ``gateway/proxy/relay.py`` and
``gateway/proxy/upstream.py`` drive it.

- fairgate asks the backend for ``return_token_ids`` (vLLM 0.32: ``prompt_token_ids``,
  top level in chat's first frame, on a completion choice's first frame; ``token_ids`` on
  every choice) and strips those fields before the client sees them unless the client
  asked for them itself (:meth:`Progress.original`).
- A continuation is a ``/v1/completions`` call whose prompt is the prompt's ids plus the
  ids generated so far, ``max_tokens`` reduced by what was generated, the same sampling
  parameters (:meth:`Progress.continuation_body`), all read from the typed request
  (``gateway/proxy/completion_request.CompletionRequest``), never from its body.
- Its frames are re-framed in the original endpoint's format (:meth:`Progress.continued`):
  chat chunks stay chat chunks with the original ``id``, ``created`` and ``model``; the
  usage counts the whole answer once (the original prompt, every generated token).
- A request whose tools or structured output a token-id prompt cannot carry is
  *replayed* instead (``gateway/proxy/replay.py``): sent again as it came, only what the
  client has not received relayed (:attr:`Progress.transcript`).
- A request that a continuation cannot reproduce keeps today's behaviour
  (:func:`not_continuable` says why; ``docs/reliability.md`` lists the cases).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from gateway.proxy.completion_request import CompletionRequest
from gateway.proxy.endpoints import CHAT
from gateway.proxy.logprobs import Logprobs
from gateway.proxy.penalties import continued_bias
from gateway.proxy.replay import SEED_RANGE, Replay, Transcript, seeded
from gateway.proxy.stop_strings import SeamText, StopStrings, seam_tail


def not_continuable(creq: CompletionRequest) -> str | None:
    """Why a continuation could not reproduce this request's answer; ``None``: it can
    (read with the body: ``completion_request._unresumable`` lists the cases)."""
    return creq.unresumable


def _empty(value: Any) -> bool:
    return value is None or value == []


@dataclass(slots=True)
class Progress:
    """One streamed answer (a single choice) as the client has received it so far."""

    chat: bool
    wants_ids: bool  # the client asked for return_token_ids itself
    id: str | None = None
    created: int | None = None
    model: str | None = None
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    base_generated: int = 0  # generated before the current continuation began
    continuations: int = 0
    stops: StopStrings | None = None  # its stop strings: the text is fairgate's at a seam
    said: list[str] = field(default_factory=list)  # with stops: the text the client got
    seam: SeamText | None = None  # with stops, once continued
    logprobs: Logprobs | None = None
    echo: str | None = None  # the prompt text to echo (vLLM echoes none with the ids)
    changed: bool = False  # the latest original event was changed beyond its ids
    cut: bool = False  # fairgate ended the answer at a stop string across the seam

    # a replayed stream (gateway/proxy/replay.py): what the client's deltas add up to, the
    # request as first sent, the replay under way
    transcript: Transcript | None = None
    sent_body: dict[str, Any] | None = None
    replay: Replay | None = None


    @classmethod
    def of(cls, creq: CompletionRequest) -> Progress | None:
        """The progress of a request that can be continued (from token ids, or replayed);
        ``None`` for one that cannot."""
        chat = creq.endpoint is CHAT
        if creq.unresumable is None:
            top = creq.logprobs
            return cls(chat, creq.return_token_ids, stops=creq.stop_strings,
                       logprobs=None if top is None else Logprobs(chat, top),
                       echo=None if creq.return_token_ids else creq.echo)
        if creq.replayable:
            return cls(chat, creq.return_token_ids, transcript=Transcript())
        return None

    def first_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """What the backend gets first: a replayed stream's body seeded (a replay must
        draw the same tokens) and kept for its replays."""
        if self.transcript is None:
            return body
        self.sent_body = seeded(body, random.randrange(SEED_RANGE))
        return self.sent_body

    def replay_body(self) -> dict[str, Any]:
        """The body of a replay (``resumable`` must hold): the request as first sent."""
        if self.sent_body is None or self.transcript is None:
            raise ValueError("not a replayed stream")
        self.replay = Replay(self.chat, self.transcript, self.generated, self.prompt_ids)
        self.base_generated = len(self.generated)
        self.continuations += 1
        return dict(self.sent_body)

    @property
    def resumable(self) -> bool:
        """Enough is known to continue by token ids (the prompt's ids came)."""
        return self.prompt_ids is not None and self.finish_reason is None

    def original(self, event: dict[str, Any]) -> dict[str, Any]:
        """Record an event of the original stream; the event for the client."""
        if self.id is None:
            self.id, self.created, self.model = (event.get("id"), event.get("created"),
                                                 event.get("model"))
        if self.chat and not _empty(event.get("prompt_token_ids")):
            self.prompt_ids = list(event["prompt_token_ids"])
            if not self.wants_ids:
                event["prompt_token_ids"] = None
        for choice in _choices(event):
            echoed = 0
            if not self.chat and not _empty(choice.get("prompt_token_ids")):
                self.prompt_ids = list(choice["prompt_token_ids"])
                if not self.wants_ids and self.echo is None:  # vLLM's echo sends them
                    choice["prompt_token_ids"] = None
                if self.echo is not None:  # the first frame: vLLM's echo of the prompt
                    echo, self.echo, self.changed = self.echo, None, True
                    choice["text"] = echo + (choice.get("text") or "")
                    echoed = len(echo)
            self._seen(choice, echoed)
            self._record(choice)
        return event

    def _seen(self, choice: dict[str, Any], echoed: int) -> None:
        """What the client gets of an original choice beyond its ids: its text (with stop
        strings; ``echoed``: its first characters are the echoed prompt), the offsets of
        its log probabilities."""
        if self.stops is not None:
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get(
                "text")
            if isinstance(text, str) and len(text) > echoed:
                self.said.append(text[echoed:])
        if self.logprobs is not None:
            self.logprobs.original(choice.get("logprobs"))

    def _record(self, choice: dict[str, Any]) -> None:
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.generated += ids
            if not self.wants_ids:
                choice["token_ids"] = None
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        if self.transcript is not None:
            self.transcript.add(choice, self.chat)

    def continuation_body(self, creq: CompletionRequest, stream: bool) -> dict[str, Any]:
        """The ``/v1/completions`` body that continues the answer (``resumable`` must
        hold): the request's sampling parameters, its prompt's ids and what was generated,
        its output bound less what was generated."""
        if self.prompt_ids is None:
            raise ValueError("the prompt's token ids never came: nothing to continue from")
        out = dict(creq.sampling)
        out.update(model=creq.model, prompt=self.prompt_ids + self.generated,
                   return_token_ids=True, stream=stream)
        if stream:
            out["stream_options"] = {"include_usage": True}
        bound = creq.output.bound
        if bound is not None:
            out["max_tokens"] = max(1, bound - len(self.generated))
        if creq.min_tokens > 0:
            out["min_tokens"] = max(0, creq.min_tokens - len(self.generated))
        if self.stops is not None:  # no text held back: fairgate holds and cuts (seam_at)
            out.update(stop=list(self.stops.strings), include_stop_str_in_output=True)
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs.seam()
        if (bias := continued_bias(out, self.generated)) is not None:
            out["logit_bias"] = bias  # the penalties the generated tokens carried
        self.base_generated = len(self.generated)
        self.continuations += 1
        return out

    def seam_ids(self) -> tuple[list[int], list[int]]:
        """With stop strings, what a continuation first decodes (``seam_at``): the
        prompt's ids, and the prompt's and the generated ids together."""
        prompt = self.prompt_ids or []
        return prompt, prompt + self.generated

    def seam_at(self, prompt_text: str, full_text: str) -> bool:
        """The text at the seam, from the ids of :meth:`seam_ids` decoded: from here on
        fairgate applies the stop strings (``gateway/proxy/stop_strings.py``); False
        when the decoded text does not extend what the client got (nothing exact can
        follow)."""
        if self.stops is None:
            return True
        said = "".join(self.said)
        tail = seam_tail(full_text, prompt_text, said)
        if tail is None:
            return False
        self.seam = SeamText(self.stops, said + tail, len(said), len(self.generated))
        return True

    def continued(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """An event of a continuation's stream (``/v1/completions`` chunks), re-framed as
        the original endpoint's chunk; a replay's carries only what is new to the client
        (``None``: nothing is)."""
        if self.replay is not None:
            return self._replayed(event, self.replay)
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat
                               else "text_completion", "created": self.created,
                               "model": self.model}
        choices = []
        for choice in _choices(event):
            ids = choice.get("token_ids")
            self._record(choice)
            reframed = self._reframed(choice)
            if self.seam is not None:
                self._seamed(self.seam, choice, reframed,
                             len(ids) if isinstance(ids, list) else 0)
            choices.append(reframed)
        out["choices"] = choices
        usage = event.get("usage")
        if isinstance(usage, dict):
            out["usage"] = self.usage()
        if "system_fingerprint" in event:
            out["system_fingerprint"] = event["system_fingerprint"]
        return out

    def _replayed(self, event: dict[str, Any], replay: Replay) -> dict[str, Any] | None:
        replay.prompt(event.get("prompt_token_ids"))
        choices = []
        for choice in _choices(event):
            if not self.chat:
                replay.prompt(choice.get("prompt_token_ids"))
            out = replay.choice(choice, self.wants_ids)
            if out is not None:
                choices.append(out)
                if out["finish_reason"] is not None:
                    self.finish_reason = out["finish_reason"]
        usage = event.get("usage")
        if not choices and not isinstance(usage, dict):
            return None
        out_event: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk" if self.chat
            else "text_completion", "created": self.created, "model": self.model,
            "choices": choices}
        if isinstance(usage, dict):
            out_event["usage"] = self.usage()
        if "system_fingerprint" in event:
            out_event["system_fingerprint"] = event["system_fingerprint"]
        return out_event

    def _reframed(self, choice: dict[str, Any]) -> dict[str, Any]:
        ids = choice.get("token_ids") if self.wants_ids else None
        finish = choice.get("finish_reason")
        logprobs = (None if self.logprobs is None
                    else self.logprobs.continued(choice.get("logprobs")))
        if self.chat:
            out: dict[str, Any] = {"index": 0, "delta": {"content": choice.get("text", "")},
                                   "logprobs": logprobs, "finish_reason": finish,
                                   "token_ids": ids}
            if finish is not None:
                out["stop_reason"] = choice.get("stop_reason")
            return out
        return {"index": 0, "text": choice.get("text", ""), "logprobs": logprobs,
                "finish_reason": finish, "stop_reason": choice.get("stop_reason"),
                "prompt_token_ids": None, "token_ids": ids}

    def _seamed(self, seam: SeamText, choice: dict[str, Any], out: dict[str, Any],
                tokens: int) -> None:
        """A stop-string answer's re-framed choice (of ``tokens`` token ids) with the
        text, ``finish_reason`` and ``stop_reason`` the uninterrupted run would have had."""
        piece = seam.feed(choice.get("text") or "", tokens, choice.get("finish_reason"),
                          choice.get("stop_reason"))
        if self.chat:
            out["delta"]["content"] = piece.text
        else:
            out["text"] = piece.text
        out["finish_reason"] = piece.finish_reason
        if piece.finish_reason is not None or not self.chat:
            out["stop_reason"] = piece.stop_reason
        self.said.append(piece.text)
        if piece.finish_reason is not None:
            self.finish_reason = piece.finish_reason
        self.cut = self.cut or piece.cut

    def usage(self) -> dict[str, int]:
        """The whole answer's usage: the original prompt, every generated token."""
        prompt = len(self.prompt_ids or ())
        completion = len(self.generated)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion}

    def closing(self, wants_usage: bool) -> list[dict[str, Any]]:
        """The events that end an answer whose last token came but whose backend died
        before its usage frame: the usage (when the client asked for it)."""
        if not wants_usage:
            return []
        return [{"id": self.id, "object": "chat.completion.chunk" if self.chat
                 else "text_completion", "created": self.created, "model": self.model,
                 "choices": [], "usage": self.usage()}]


def _choices(event: dict[str, Any]) -> list[dict[str, Any]]:
    choices = event.get("choices")
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict)]
