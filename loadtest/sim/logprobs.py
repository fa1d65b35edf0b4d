"""Log probabilities of generated tokens, in vLLM 0.32's shapes (checked against a real
vLLM 0.32 CPU server's streams, ``gateway/proxy/logprobs.py``'s sources):

- completions ``logprobs: k``: per token ``tokens``, ``token_logprobs``, ``top_logprobs``
  (a dict: the sampled token first, then the next most likely: ``max(k, 1)`` entries in
  all, as vLLM's greedy sampling gives) and ``text_offset`` (the offset of the token in the
  answer, advanced by the reported tokens' lengths);
- chat ``logprobs: true``, ``top_logprobs: k``: ``{"content": [...]}``, an entry per
  token (``token``, ``logprob``, ``bytes``, ``top_logprobs``: the first ``k`` of those).

The values are made up and fixed: the sampled word ``-0.25``, the j-th other ``-1 - j``;
the other words are the next filler words (distinct from the sampled one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loadtest.sim import tokenizer

Words = Callable[[int], str]  # an answer's generated token index → its text

SAMPLED = -0.25


def top(word: Words, index: int, k: int) -> dict[str, float]:
    """The top entries of generated token ``index`` (``word(index)``): ``max(k, 1)`` of
    them, the sampled word first."""
    out = {word(index): SAMPLED}
    for j in range(1, min(max(k, 1), len(tokenizer.FILLER))):
        out[word(index + j)] = -1.0 - j
    return out


def completion(word: Words, index: int, k: int, offset: int) -> dict[str, Any]:
    """A completions chunk's ``logprobs`` for one token at text offset ``offset``."""
    text = word(index)
    return {"text_offset": [offset], "token_logprobs": [SAMPLED], "tokens": [text],
            "top_logprobs": [top(word, index, k)]}


def chat(word: Words, index: int, k: int) -> dict[str, Any]:
    """A chat chunk's ``logprobs`` for one token."""
    text = word(index)
    return {"content": [{
        "token": text, "logprob": SAMPLED, "bytes": list(text.encode()),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                         for t, lp in list(top(word, index, k).items())[:k]]}]}
