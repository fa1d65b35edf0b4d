"""The parts of a request the pure policies read, whatever its endpoint's body shape.

The endpoint table (``gateway/proxy/endpoints.py``) reads each body once, at the edge,
into one typed request (``gateway/proxy/completion_request.CompletionRequest``); what the
policies need of it is here, as plain data: the :class:`Prompt` (the estimate and the
byte bound of ``policies/cost.py``, the prefix chain of ``policies/locality.py``) and the
:class:`Output` (what it may generate: the output half of what limits reserve). No policy
reads a body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the model reads it.

    ``text`` holds what the model reads (strings, content parts, token ids, at any
    nesting); for a chat, ``roles`` holds each message's role and ``text`` the list of
    their contents, in the same order. ``preamble`` is read before ``text`` (the Responses
    API's ``instructions``). ``items``: input items each estimated as a message.
    ``least``: the fewest tokens ``text`` is estimated at. ``rendered``: every value a
    chat template renders (the prompt field and ``tools``, ``documents``, …: the byte
    bound reads them), with ``template_items`` the messages or items it wraps; ``None``:
    not templated (a completion's raw prompt: a begin/end-of-text token per prompt).
    ``prompts``: the separate prompts of a completion (each generates its sequences)."""

    field: str  # the body field it came from: what a 400 about it names
    text: Any
    roles: tuple[Any, ...] = ()  # as sent (the chain writes each as text)
    preamble: str | None = None
    items: int = 0
    least: int = 1
    rendered: tuple[Any, ...] = ()
    template_items: int | None = None
    prompts: int = 1


NO_PROMPT = Prompt("", "", least=0)


@dataclass(frozen=True, slots=True)
class Output:
    """What a request may generate: ``produces`` (False: an endpoint with no output, such
    as embeddings), its effective output-token ``bound`` (the smallest output-token field
    it sets; None: the model's context bounds it) and the ``sequences`` each prompt
    generates (the larger of ``n`` and ``best_of``)."""

    produces: bool = True
    bound: int | None = None
    sequences: int = 1
