"""The ``priority`` number forwarded to vLLM (lower = scheduled sooner).

class base (``policies/classes.py``) + the request's rank among its user's outstanding
requests for the model. Ranks are capped below the gap between class bases so class
always dominates.
"""

from __future__ import annotations


def vllm_priority(class_base: int, rank: int, class_gap: int = 1000) -> int:
    return class_base + min(max(rank, 0), class_gap - 1)
