"""What a backend's scraper publishes with each snapshot, so that every gateway process
dispatches by the same gates without scraping the backend itself.

One process holds a backend's scrape lease (``gateway/backends/scrape.py``); with each
snapshot it stores these plain numbers in the snapshot hash (field ``shared``, JSON):
each class's gate and pacing state as that scrape left them, the batch's size, the recent
prefix-cache hit ratio and TTFT, the scrape's cumulative histogram sums (a process that
takes the lease over continues the recent-mean windows from them), the model card, and
the LoRA adapters the backend lists and its LoRA gauge (``docs/adapters.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.backends.vllm_metrics import LoraState
from gateway.core import jsonio
from policies.gates import Gate
from policies.pacing import Pacing


@dataclass(frozen=True, slots=True)
class Published:
    gates: dict[str, Gate]  # each class's gate by this snapshot
    pacing: dict[str, Pacing]  # each class's adaptive pacing after it
    peak_running: int  # the most requests seen running at once (the batch's size)
    prefix_hit_ratio: float | None  # recent prefix-cache hits / queries (None: no queries)
    ttft_s: float | None  # recent mean time to first token
    sums: dict[str, tuple[float, float]]  # the scrape's histogram (sum, count) pairs
    max_model_len: int | None  # from the backend's /v1/models (None: unknown)
    model_card_read: bool  # /v1/models was read (or the backend has none)
    adapters: tuple[str, ...] = ()  # the LoRA adapters its /v1/models lists
    lora: LoraState | None = None  # its vllm:lora_requests_info (None: LoRA off)

    def encode(self) -> str:
        # orjson (``gateway/core/jsonio.py``): every process reads each snapshot (a
        # fleet's: hundreds a second); what it holds is finite numbers and short strings
        return jsonio.dumps({
            "gates": {c: [g.limit, g.reason, g.free_slots, g.max_inflight]
                      for c, g in self.gates.items()},
            "pacing": {c: [p.allowance, p.reason, p.peak_running, p.bonus]
                       for c, p in self.pacing.items()},
            "peak": self.peak_running, "hit": self.prefix_hit_ratio, "ttft": self.ttft_s,
            "sums": {name: list(pair) for name, pair in self.sums.items()},
            "card": self.max_model_len, "card_read": self.model_card_read,
            "adapters": list(self.adapters),
            "lora": None if self.lora is None else [self.lora.max_lora, list(self.lora.active)],
        }).decode()

    @classmethod
    def decode(cls, text: str) -> Published:
        """The published numbers; ValueError when ``text`` is not what :meth:`encode`
        wrote."""
        try:
            d: dict[str, Any] = jsonio.loads(text.encode())
            return cls(
                {c: Gate(int(limit), reason, int(free), int(inflight))
                 for c, (limit, reason, free, inflight) in d["gates"].items()},
                {c: Pacing(float(allowance), str(reason), int(peak), int(bonus))
                 for c, (allowance, reason, peak, bonus) in d["pacing"].items()},
                int(d["peak"]), _number(d["hit"]), _number(d["ttft"]),
                {name: (float(s), float(n)) for name, (s, n) in d["sums"].items()},
                None if d["card"] is None else int(d["card"]), bool(d["card_read"]),
                tuple(str(a) for a in d.get("adapters", ())), _lora(d.get("lora")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a published snapshot: {text[:200]!r}") from exc


def _lora(value: Any) -> LoraState | None:
    if value is None:
        return None
    max_lora, active = value
    return LoraState(int(max_lora), tuple(str(a) for a in active))


def _number(value: Any) -> float | None:
    return None if value is None else float(value)
