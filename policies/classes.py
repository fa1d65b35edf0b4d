"""Priority classes: the one table every other module reads.

Lower position = served first. Each row holds the class's defaults — the only place they
are written: its vLLM priority base, its pacing gate (``max_waiting``, ``max_tpot_ms``,
``max_kv_usage``), how long a request may wait, its starvation floor (the share of recent
dispatches a backlogged class is owed; see ``policies/starvation.py``), its default
first-token deadline (``ttft_slo_ms``; None: none, a client may still send one), its
prefill-token limit (``max_waiting_prefill_tokens``; None: from the backend's step budget,
see ``policies/prefill.py``) and its preemption rule (``policies/preemption.py``).
``gateway/core/settings.py``'s class entries start from these rows.
"""

from __future__ import annotations

from dataclasses import dataclass

# a stream is never preempted before it has generated this many tokens: its user sees it
# progress, and a preemption never throws away a stream that has only just been scheduled
# (what it recomputes then is mostly its prompt, for a slot it barely used)
PREEMPT_GRACE_TOKENS = 32


@dataclass(frozen=True, slots=True)
class ClassSpec:
    name: str
    priority_base: int
    max_waiting: int
    max_queue_wait_s: float
    floor: float
    ttft_slo_ms: int | None = None
    max_tpot_ms: float = 150.0
    max_kv_usage: float | None = None
    max_waiting_prefill_tokens: int | None = None
    # preemption for fairness (policies/preemption.py): its running requests may give
    # their slot to a waiting request of a higher class (preemptible), or of its own class
    # whose user is below its fair share (fair_preemption); a waiting request of the class
    # may take one after this long (None: never); one request is preempted at most
    # max_preemptions times, and never before it generated preempt_grace_tokens
    preemptible: bool = False
    preempt_after_ms: int | None = None
    max_preemptions: int = 2
    fair_preemption: bool = True
    preempt_grace_tokens: int = PREEMPT_GRACE_TOKENS


CLASSES: tuple[ClassSpec, ...] = (
    # interactive and default: a user below its fair share takes the slot of the most
    # over-served user's youngest stream of its class (fair_preemption, on by default);
    # never for a lower class (only batch is preemptible across classes)
    ClassSpec("interactive", priority_base=0, max_waiting=3, max_queue_wait_s=300.0, floor=0.0,
              preempt_after_ms=500),
    ClassSpec("default", priority_base=1000, max_waiting=3, max_queue_wait_s=300.0, floor=0.10,
              preempt_after_ms=2000),
    # batch runs only when the backend queue is empty: a little idle GPU beats a slower
    # user; a batch request gives its slot back when a higher class waits (preemption)
    ClassSpec("batch", priority_base=2000, max_waiting=1, max_queue_wait_s=86400.0, floor=0.05,
              preemptible=True),
)
CLASS_ORDER: tuple[str, ...] = tuple(c.name for c in CLASSES)
SPECS: dict[str, ClassSpec] = {c.name: c for c in CLASSES}
DEFAULT_CLASS = SPECS["default"]  # a key's class when it names none


def class_rank(name: str) -> int:
    """Position of a class in the service order; unknown names raise ValueError."""
    return CLASS_ORDER.index(name)


def default_floors() -> dict[str, float]:
    return {c.name: c.floor for c in CLASSES if c.floor > 0}


def effective_class(granted: str, requested: str | None) -> str | None:
    """The class a request runs in: the key's class, or a *lower* one it asks for.

    Returns None when the request asks to be raised above its key's class (forbidden).
    """
    if requested is None or requested == granted:
        return granted
    if requested not in CLASS_ORDER:
        return None
    return requested if class_rank(requested) > class_rank(granted) else None
