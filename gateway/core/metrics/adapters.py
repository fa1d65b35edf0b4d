"""LoRA adapters: where each is available and active (by the backends' snapshots), the
runtime loads and unloads the gateway asked for, and the requests waiting for them
(``gateway/scheduling/adapter_loads.py``, ``admission.py``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.core.metrics.base import SHARED, WAIT_BUCKETS, Children, MetricGroup


class AdapterMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children) -> None:
        super().__init__(child)
        self._shown: dict[str, set[str]] = {}  # adapter series shown per backend
        self.loaded = Gauge(
            "fairgate_backend_adapter_loaded",
            "1: the LoRA adapter is available on the backend (its /v1/models lists it, or "
            "the config puts it there); 0: it was, and is no longer",
            ["backend", "adapter"], registry=r, multiprocess_mode=SHARED)
        self.active = Gauge(
            "fairgate_backend_adapter_active",
            "1: vllm:lora_requests_info lists the adapter with requests waiting or running "
            "on the backend",
            ["backend", "adapter"], registry=r, multiprocess_mode=SHARED)
        self.lora_slots = Gauge(
            "fairgate_backend_lora_slots",
            "Distinct LoRA adapters one batch of the backend runs (vLLM's --max-loras, the "
            "max_lora label of vllm:lora_requests_info)",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.loads = Counter(
            "fairgate_adapter_loads_total",
            "Runtime LoRA loads the gateway asked of a backend (POST /v1/load_lora_adapter), "
            "by outcome: loaded or failed",
            ["backend", "adapter", "outcome"], registry=r)
        self.unloads = Counter(
            "fairgate_adapter_unloads_total",
            "Runtime LoRA unloads the gateway asked of a backend to make room for another "
            "adapter (POST /v1/unload_lora_adapter), by outcome: unloaded or failed",
            ["backend", "adapter", "outcome"], registry=r)
        self.requests = Gauge(
            "fairgate_adapter_requests",
            "Requests naming a LoRA adapter that this process holds before dispatch, by "
            "state: loading (waiting for its runtime load) or queued (in the fair queue)",
            ["model", "adapter", "state"], registry=r, multiprocess_mode="livesum")
        self.wait = Histogram(
            "fairgate_adapter_wait_seconds",
            "Requests naming a LoRA adapter: from admission to dispatch, its runtime load "
            "(if any) included", ["model", "adapter"], buckets=WAIT_BUCKETS, registry=r)

    def record(self, backend: str, loaded: frozenset[str], active: tuple[str, ...],
               slots: int | None) -> None:
        """A backend's adapters by its latest snapshot: available, active, and its slots
        (None: no LoRA gauge). An adapter shown before and gone now drops to 0."""
        shown = self._shown.setdefault(backend, set())
        for adapter in shown | loaded | set(active):
            self.child(self.loaded, backend, adapter).set(1 if adapter in loaded else 0)
            self.child(self.active, backend, adapter).set(1 if adapter in active else 0)
        shown |= loaded | set(active)
        if slots is not None:
            self.child(self.lora_slots, backend).set(slots)

    def forget_backend(self, backend: str) -> int:
        self._shown.pop(backend, None)
        return super().forget_backend(backend)
