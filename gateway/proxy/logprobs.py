"""Log probabilities across a continuation's seam. Pure: plain data in and out.

A continuation is a ``/v1/completions`` call, so it is asked for ``logprobs: k`` and its
chunks carry completions-style log probabilities (vLLM 0.32,
``completion/serving.py: _create_completion_logprobs``): ``tokens``, ``token_logprobs``,
``top_logprobs`` (a dict per token: the sampled token first, then the top ``k``) and
``text_offset`` (from 0 in the continuation). :class:`Logprobs` re-frames them:

- completions (``logprobs: k``): as they come, ``text_offset`` moved on by the offset the
  answer had reached (vLLM advances it by the reported tokens' lengths, never by the text
  held back for stop strings);
- chat (``logprobs: true``, ``top_logprobs: k``): as chat's ``logprobs.content`` entries
  (``chat_completion/serving.py: _create_chat_logprobs``): the token, its log
  probability, its UTF-8 bytes and the first ``k`` entries of the top dict. vLLM names
  both with the same decoded token strings; a completions dict keeps one entry per
  *string*, so two top tokens that decode alike show once (chat would list both).

The values are the continuation's: its first token's log probabilities come from the
prefill of the prompt plus the ids generated so far rather than from a decode step, so
they may differ in the last float32 digits (measured in ``docs/reliability.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Logprobs:
    """What log probabilities a stream asked for, and how far its text offsets got."""

    chat: bool
    top: int  # completions: logprobs; chat: top_logprobs (0 when absent)
    next_offset: int = 0  # completions: the text offset of the next token
    base: int = 0  # … when the current continuation began (its offsets start at 0)

    def seam(self) -> int:
        """A continuation begins; the top log probabilities it is asked for."""
        self.base = self.next_offset
        return self.top

    def original(self, logprobs: Any) -> None:
        """A choice's ``logprobs`` in the original stream (the offset so far)."""
        if not self.chat and isinstance(logprobs, dict):
            self._advance(logprobs)

    def continued(self, logprobs: Any) -> dict[str, Any] | None:
        """A continuation choice's ``logprobs`` in the original endpoint's format."""
        if not isinstance(logprobs, dict):
            return None
        if self.chat:
            return {"content": [self._chat_entry(t, lp, top) for t, lp, top in zip(
                logprobs.get("tokens") or (), logprobs.get("token_logprobs") or (),
                logprobs.get("top_logprobs") or (), strict=False)]}
        out: dict[str, Any] = dict(logprobs)
        offsets = out.get("text_offset")
        if isinstance(offsets, list):
            out["text_offset"] = [o + self.base for o in offsets]
            self._advance(out)
        return out

    def _advance(self, logprobs: dict[str, Any]) -> None:
        tokens, offsets = logprobs.get("tokens"), logprobs.get("text_offset")
        if tokens and offsets and isinstance(tokens[-1], str):
            self.next_offset = offsets[-1] + len(tokens[-1])

    def _chat_entry(self, token: str, logprob: float | None, top: Any) -> dict[str, Any]:
        entries = list(top.items())[: self.top] if isinstance(top, dict) else []
        return {"token": token, "logprob": logprob, "bytes": _bytes(token),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)}
                                 for t, lp in entries]}


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))
