"""Prefill work: which backends a prompt may run on, and how much prefill a backend may
have queued (the length-aware pools and the prefill-token gate).

**Pools.** A backend may declare the prompt lengths it takes (``min_prompt_tokens`` …
``max_prompt_tokens``, estimated tokens, :func:`policies.cost.estimate_prompt_tokens`): a
short-context pool and a ``long_context`` pool of the same model, say. A request is only
ever dispatched to a backend whose range holds its estimate (``gateway/storage/lua/dispatch.lua``
passes over the others' requests, so nothing fails over to a backend that cannot take
it), and a prompt no backend of its model takes is refused at admission with a 400 that
names the ranges (:func:`no_fit_message`).

**The prefill-token gate.** Counting requests, one 30k-token prompt is "1 waiting" while
it occupies several of the engine's steps and stalls every stream on its backend. So a
backend's *pending prefill* is counted in tokens too: the estimated uncached prompt tokens
(the prompt minus what the backend's prefix index holds, :func:`uncached_tokens`) of the
requests dispatched to it that it may not have scheduled yet (see :func:`still_pending`).
A class may dispatch to a backend only while that sum plus the request stays within its
``max_waiting_prefill_tokens`` (default: the backend's ``max_num_batched_tokens`` ×
:data:`PREFILL_GATE_STEPS`); a request always goes when nothing is pending, so a prompt
larger than the limit is not locked out (:func:`prefill_fits`).

**Backfill.** A request the gate holds is still the fair choice: it goes to the first
backend whose pending prefill leaves it room. Meanwhile the backend that held it would
idle its class (head-of-line blocking), so for ``prefill_backfill_s`` after the request was
first held, the next request in fairness order whose estimate fits the room may pass it
there (:func:`may_backfill`); after that the backends take no more of the class until it
got in, so it waits at most that long plus one backend's drain. The fairness bound grows
by what the backends serve in ``prefill_backfill_s``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from policies.cost import CHARS_PER_TOKEN
from policies.locality import BLOCK_CHARS

PREFILL_GATE_STEPS = 4
"""The default prefill-token limit in engine steps: a backend is sent no more uncached
prompt than it prefills in about this many steps of its ``max_num_batched_tokens``."""
TOKENS_PER_BLOCK = BLOCK_CHARS // CHARS_PER_TOKEN  # estimated tokens of one locality block


@dataclass(frozen=True, slots=True)
class PromptRange:
    """The estimated prompt lengths a backend takes (both ends included)."""

    min_tokens: int = 0
    max_tokens: int | None = None  # None: any length (the model's context bounds it)

    def admits(self, tokens: int) -> bool:
        return tokens >= self.min_tokens and (self.max_tokens is None
                                              or tokens <= self.max_tokens)

    @property
    def bounded(self) -> bool:
        return self.min_tokens > 0 or self.max_tokens is not None

    def describe(self) -> str:
        if self.max_tokens is None:
            return f"≥ {self.min_tokens}" if self.min_tokens else "any length"
        return f"{self.min_tokens}–{self.max_tokens}"


@dataclass(frozen=True, slots=True)
class Pool:
    """What ``gateway/storage/lua/lib/pools.lua`` knows of one backend when fairness looks for a
    request it may take: its prompt range and the queued requests' estimated prompt
    tokens (a request not listed fits anywhere: it is gone, to be dropped)."""

    prompt_range: PromptRange = PromptRange()
    prompt_tokens: Mapping[str, int] = field(default_factory=dict)
    tokens_per_block: int = TOKENS_PER_BLOCK

    @property
    def ranged(self) -> bool:
        return self.prompt_range.bounded

    def fits(self, request_id: str, room: int | None = None, held_blocks: int = 0) -> bool:
        """Whether the backend's range takes the request and, with ``room`` (a backfill
        past a request the prefill gate holds), whether its tokens not held in the first
        ``held_blocks`` blocks fit in it."""
        if not self.ranged and room is None:
            return True
        tokens = self.prompt_tokens.get(request_id)
        if tokens is None:
            return True
        if room is not None and uncached_tokens(tokens, held_blocks,
                                                self.tokens_per_block) > room:
            return False
        return self.prompt_range.admits(tokens)


def fitting(ranges: Mapping[str, PromptRange], tokens: int) -> list[str]:
    """The backends (by name) whose range takes a prompt of ``tokens``."""
    return [name for name, r in ranges.items() if r.admits(tokens)]


def no_fit_message(model: str, tokens: int, ranges: Mapping[str, PromptRange]) -> str:
    """The 400's text when no backend of ``model`` takes the prompt."""
    limits = sorted({r.describe() for r in ranges.values()})
    return (f"the prompt (about {tokens} tokens) fits no backend of model {model!r}: "
            f"they take prompts of {', '.join(limits)} tokens")


def class_limit(configured: int | None, max_num_batched_tokens: int,
                steps: int = PREFILL_GATE_STEPS) -> int:
    """A class's prefill-token limit on a backend (0: no limit): its configured
    ``max_waiting_prefill_tokens``, else ``steps`` of the backend's token budget."""
    return configured if configured is not None else max_num_batched_tokens * steps


def uncached_tokens(prompt_tokens: int, held_blocks: int,
                    tokens_per_block: int = TOKENS_PER_BLOCK) -> int:
    """A prompt's estimated tokens to prefill on a backend whose prefix index holds its
    first ``held_blocks`` blocks (vLLM computes only the uncached tail)."""
    return max(0, prompt_tokens - held_blocks * tokens_per_block)


def prefill_fits(pending: int, tokens: int, limit: int) -> bool:
    """Whether a request of ``tokens`` uncached prompt tokens may join a backend's
    ``pending`` prefill under ``limit`` (0: no limit). With nothing pending it always may:
    a prompt above the limit waits for an idle queue, not forever."""
    return limit <= 0 or pending <= 0 or pending + tokens <= limit


def may_backfill(held_for_s: float, backfill_s: float, room: int, tokens: int) -> bool:
    """Whether a request of ``tokens`` estimated prompt tokens may pass the one the gate
    has held for ``held_for_s`` on a backend with ``room`` tokens left under the limit."""
    return held_for_s < backfill_s and tokens <= room


def still_pending(dispatched: Sequence[tuple[str, float]], taken_at: float,
                  not_yet_scheduled: int) -> set[str]:
    """Which dispatched requests (id, dispatch time) may still wait for their prefill by a
    snapshot taken at ``taken_at`` that shows ``not_yet_scheduled`` requests waiting or
    not yet registered (vLLM's waiting + the snapshot's unseen): every one sent after the
    scrape began, and of the earlier ones the newest ``not_yet_scheduled`` (vLLM schedules
    in arrival order within a priority). A request also leaves when its first token comes
    or it ends. Mirrored by ``gateway/storage/lua/snapshot.lua``."""
    before = sorted((t, rid) for rid, t in dispatched if t < taken_at)
    kept = {rid for rid, t in dispatched if t >= taken_at}
    if not_yet_scheduled > 0:
        kept |= {rid for _, rid in before[-not_yet_scheduled:]}
    return kept
