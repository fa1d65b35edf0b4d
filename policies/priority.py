"""The ``priority`` number forwarded to vLLM (lower = scheduled sooner).

class base + the request's rank among its user's outstanding requests for the model.
Ranks are capped below the gap between class bases so class always dominates.
"""

from __future__ import annotations

from collections.abc import Mapping

DEFAULT_BASES: Mapping[str, int] = {"interactive": 0, "default": 1000, "batch": 2000}


def vllm_priority(class_base: int, rank: int, class_gap: int = 1000) -> int:
    return class_base + min(max(rank, 0), class_gap - 1)
