"""The gateway's own Prometheus metrics (``fairgate_*``), on a registry passed in, and the
hooks the request path, the backend pool and the supervisor call to feed them.

Several worker processes (``fairgate serve --workers N``, ``gateway/runtime/workers.py``) share
one view through prometheus_client's multiprocess mode: each worker writes its values to
files in ``PROMETHEUS_MULTIPROC_DIR`` and ``registry`` then collects every worker's files,
so a scrape through any worker sees the same totals. Counters and histograms sum across
workers (a dead worker's counts stay in the sums); the gauges are set from shared state
(queue depths read from Redis, backend scrapes every worker makes), so they report the
most recent value any live worker set (``livemostrecent``). In that mode an idle user's
per-user series are not removed (prometheus_client cannot remove a label set there); the
number of user label values is still bounded by ``metrics_top_users``.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import deque
from collections.abc import Mapping
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.core.user_series import MAX_SHARE_USERS, OTHER_USERS, ServiceShares, UserLabels
from policies.gates import GATE_REASONS

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
RANK_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50, 100, 500)
REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
DISPATCH_RATE_WINDOW_S = 10.0
MAX_RECENT_TTFT = 100_000  # first-token times kept for the history's next interval
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
SHARED: Final = "livemostrecent"
"""Multiprocess mode of a gauge set from state every worker sees alike."""


def multiprocess_dir() -> str | None:
    """The directory workers share their metrics through, or None (one process)."""
    return os.environ.get(MULTIPROC_DIR_ENV) or None


SCRIPT_COMMANDS = frozenset({"EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO"})


class RedisMetrics:
    """Where the boundary reports (owned by :class:`~gateway.core.metrics.GatewayMetrics`)."""

    def __init__(self, latency: Histogram, errors: Counter,
                 commands: Counter | None = None) -> None:
        self.latency = latency
        self.errors = errors
        self.commands = commands  # labels: command, script ("" for a plain command)
        self._counters: dict[tuple[str, str], Any] = {}

    def count(self, args: tuple[Any, ...], scripts: dict[str, str]) -> None:
        if self.commands is None or not args:
            return
        command = str(args[0]).upper()
        script = ""
        if command in SCRIPT_COMMANDS and len(args) > 1:
            script = scripts.get(str(args[1]), "?")
        key = (command, script)
        counter = self._counters.get(key)
        if counter is None:  # labels() costs more than inc(): resolve each pair once
            counter = self._counters[key] = self.commands.labels(command, script)
        counter.inc()


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, top_users: int = 20,
                 user_idle_s: float = 3600.0) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.multiprocess = multiprocess_dir() is not None
        if self.multiprocess:
            # the metrics write to this process's files (their registry is never
            # scraped); the registry scraped collects every worker's files
            r = CollectorRegistry()
            MultiProcessCollector(self.registry)  # type: ignore[no-untyped-call]
            warnings.filterwarnings("ignore", "Removal of labels", UserWarning)
        self.users = UserLabels(top_users, user_idle_s)
        self.tenant_labels = UserLabels(top_users, user_idle_s)  # tenants: bounded alike
        self.shares: dict[str, ServiceShares] = {}
        # service not yet added to the cross-replica shares in Redis (gateway/ops/history.py)
        self.pending_service: dict[str, dict[str, float]] = {}
        # model -> user -> (tenant, weight, tenant weight) of users queued since the last
        # flush: the share ratio needs the weight of a backlogged user not served yet
        self.pending_who: dict[str, dict[str, tuple[str, float, float]]] = {}
        # streams' times to first token (s) since the history's last interval ended
        self.recent_ttft: list[float] = []
        self._share_series: set[tuple[str, str, str]] = set()
        self.recent_dispatches: dict[str, deque[float]] = {}
        # per backend: (time, hit blocks, query blocks) of this replica's recent dispatches
        self.recent_predictions: dict[str, deque[tuple[float, int, int]]] = {}
        self.decision_counts: dict[str, dict[str, int]] = {}  # backend → reason → count
        self._gate_state: dict[str, tuple[float, dict[str, str | None]]] = {}
        self._adapters: dict[str, set[str]] = {}  # adapter series shown per backend
        self._user_series: dict[str, set[tuple[Counter, tuple[str, ...]]]] = {}
        # the request path's and the snapshots' children by (metric, label values):
        # labels() costs more than inc() or set(); a removed label set leaves here too
        # (_remove)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._redis: RedisMetrics | None = None
        self.queue_depth = Gauge(
            "fairgate_queue_depth", "Requests queued in Redis", ["model", "priority_class"],
            registry=r, multiprocess_mode=SHARED)
        self.queue_oldest_wait = Gauge(
            "fairgate_queue_oldest_wait_seconds", "Age of the oldest queued request",
            ["model", "priority_class"], registry=r, multiprocess_mode=SHARED)
        self.queue_wait = Histogram(
            "fairgate_queue_wait_seconds", "Time from enqueue to dispatch", ["priority_class"],
            buckets=WAIT_BUCKETS, registry=r)
        self.ttft = Histogram(
            "fairgate_time_to_first_token_seconds",
            "Streams: from request arrival to the first token frame sent to the client",
            ["priority_class"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            "fairgate_time_per_output_token_seconds",
            "Streams: mean time between output tokens as the client received them",
            ["priority_class"], buckets=TPOT_BUCKETS, registry=r)
        self.request_duration = Histogram(
            "fairgate_request_duration_seconds", "From request arrival to the end of the answer",
            ["priority_class"], buckets=TTFT_BUCKETS, registry=r)
        self.dispatches = Counter(
            "fairgate_dispatches_total", "Requests dispatched to a backend",
            ["model", "backend", "priority_class"], registry=r)
        self.dispatch_rank = Histogram(
            "fairgate_dispatch_priority_rank",
            "vLLM priority of dispatched requests minus the class base (user's in-flight rank)",
            ["priority_class"], buckets=RANK_BUCKETS, registry=r)
        self.gate_closed = Counter(
            "fairgate_gate_closed_total",
            "Backend snapshots that closed a class's gate, by reason",
            ["backend", "priority_class", "reason"], registry=r)
        self.gate_closed_time = Counter(
            "fairgate_gate_closed_seconds_total",
            "Time a class's gate to a backend was closed, by reason",
            ["backend", "priority_class", "reason"], registry=r)
        self.gate_open = Gauge(
            "fairgate_gate_open", "1 when the class's gate to the backend is open",
            ["backend", "priority_class"], registry=r, multiprocess_mode=SHARED)
        self.gate_reason = Gauge(
            "fairgate_gate_closed_reason",
            "1 for the reason a class's gate to the backend is closed now",
            ["backend", "priority_class", "reason"], registry=r, multiprocess_mode=SHARED)
        self.backend_waiting = Gauge(
            "fairgate_backend_waiting_requests", "vllm:num_requests_waiting at last scrape",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.backend_waiting_queued = Gauge(
            "fairgate_backend_waiting_queued_requests",
            "Of vllm:num_requests_waiting at last scrape, those beyond the batch's free slots "
            "(the most seen running less those running): they wait for a running request to "
            "finish. The rest entered a free slot and start at the next engine step",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.backend_running = Gauge(
            "fairgate_backend_running_requests", "vllm:num_requests_running at last scrape",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.backend_kv = Gauge(
            "fairgate_backend_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc at last scrape",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.backend_tpot = Gauge(
            "fairgate_backend_tpot_seconds", "Recent mean time per output token", ["backend"],
            registry=r, multiprocess_mode=SHARED)
        self.backend_adapter_loaded = Gauge(
            "fairgate_backend_adapter_loaded",
            "1: the LoRA adapter is available on the backend (its /v1/models lists it, or "
            "the config puts it there); 0: it was, and is no longer",
            ["backend", "adapter"], registry=r, multiprocess_mode=SHARED)
        self.backend_adapter_active = Gauge(
            "fairgate_backend_adapter_active",
            "1: vllm:lora_requests_info lists the adapter with requests waiting or running "
            "on the backend",
            ["backend", "adapter"], registry=r, multiprocess_mode=SHARED)
        self.backend_lora_slots = Gauge(
            "fairgate_backend_lora_slots",
            "Distinct LoRA adapters one batch of the backend runs (vLLM's --max-loras, the "
            "max_lora label of vllm:lora_requests_info)",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.adapter_loads = Counter(
            "fairgate_adapter_loads_total",
            "Runtime LoRA loads the gateway asked of a backend (POST /v1/load_lora_adapter), "
            "by outcome: loaded or failed",
            ["backend", "adapter", "outcome"], registry=r)
        self.adapter_unloads = Counter(
            "fairgate_adapter_unloads_total",
            "Runtime LoRA unloads the gateway asked of a backend to make room for another "
            "adapter (POST /v1/unload_lora_adapter), by outcome: unloaded or failed",
            ["backend", "adapter", "outcome"], registry=r)
        self.adapter_requests = Gauge(
            "fairgate_adapter_requests",
            "Requests naming a LoRA adapter that this process holds before dispatch, by "
            "state: loading (waiting for its runtime load) or queued (in the fair queue)",
            ["model", "adapter", "state"], registry=r, multiprocess_mode="livesum")
        self.adapter_wait = Histogram(
            "fairgate_adapter_wait_seconds",
            "Requests naming a LoRA adapter: from admission to dispatch, its runtime load "
            "(if any) included", ["model", "adapter"], buckets=WAIT_BUCKETS, registry=r)
        self.backend_prefix_hit_ratio = Gauge(
            "fairgate_backend_prefix_cache_hit_ratio",
            "vLLM's recent prefix cache hit rate: Δvllm:prefix_cache_hits_total / "
            "Δvllm:prefix_cache_queries_total (tokens) over the TPOT window; NaN: no queries",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.backend_pending_prefill = Gauge(
            "fairgate_backend_pending_prefill_tokens",
            "Estimated uncached prompt tokens dispatched to a backend and maybe not yet "
            "scheduled there, by the latest snapshot (the prefill-token gate's count)",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.prefix_predicted_blocks = Counter(
            "fairgate_prefix_predicted_blocks_total",
            "Prompt blocks (policies/locality.py chain) dispatched to a backend (kind=query) "
            "and those its prefix index held at dispatch (kind=hit): the predicted hit rate",
            ["backend", "kind"], registry=r)
        self.dispatch_decisions = Counter(
            "fairgate_dispatch_decisions_total",
            "Dispatches by why the request went to the backend: cache_hit (its prefix index "
            "held the prompt's first blocks), load (placed by load: least_loaded routing, or "
            "the backend holding its prefix was too busy), fairness_order (locality, nothing "
            "cached anywhere: the fairness order's next)", ["model", "backend", "reason"],
            registry=r)
        self.dispatch_stale_view = Counter(
            "fairgate_dispatch_stale_view_total",
            "Dispatch decisions that admitted nothing because the deciding process's gates "
            "came from a snapshot older than the one before the backend's stored one (the "
            "process is behind the backend's snapshots; its next snapshot decides again)",
            ["model", "backend"], registry=r)
        self.backend_healthy = Gauge(
            "fairgate_backend_healthy", "1 when the last scrapes succeeded", ["backend"],
            registry=r, multiprocess_mode=SHARED)
        self.backend_scraping = Gauge(
            "fairgate_backend_scraping",
            "1 while this process holds the backend's scrape lease (scrapes it for all)",
            ["backend"], registry=r, multiprocess_mode="livesum")
        self.backend_drained = Gauge(
            "fairgate_backend_drained", "1 when an operator drained the backend (this replica)",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.pacing_allowance = Gauge(
            "fairgate_pacing_allowance",
            "Requests of the class adaptive pacing lets wait at the backend now (at most "
            "max_waiting)", ["backend", "priority_class"], registry=r, multiprocess_mode=SHARED)
        self.pacing_free_slots = Gauge(
            "fairgate_pacing_free_slots",
            "Free batch slots the latest snapshot's burst may fill too (adaptive pacing, "
            "while nothing waits): requests sent into them start at once and do not wait",
            ["backend", "priority_class"], registry=r, multiprocess_mode=SHARED)
        self.pacing_changes = Counter(
            "fairgate_pacing_changes_total", "Changes of the pacing allowance, by reason",
            ["backend", "priority_class", "reason"], registry=r)
        self.requests = Counter(
            "fairgate_requests_total", "Finished client requests by status",
            ["model", "priority_class", "status"], registry=r)
        self.errors = Counter(
            "fairgate_errors_total", "Error responses by HTTP status and OpenAI error type",
            ["status", "type", "code"], registry=r)
        self.tokens = Counter(
            "fairgate_tokens_total", "Tokens served, by kind (prompt; prompt_cached: of the "
            "prompt, found in vLLM's prefix cache; completion)", ["model", "kind"], registry=r)
        self.user_tokens = Counter(
            "fairgate_user_tokens_total", "Tokens served per user (top users, rest: other)",
            ["model", "user", "kind"], registry=r)
        self.user_requests = Counter(
            "fairgate_user_requests_total", "Requests dispatched per user (top users, rest: other)",
            ["model", "user"], registry=r)
        self.user_service = Counter(
            "fairgate_user_service_total",
            "Weighted service per user: (prompt × w_in + output × w_out) / key weight",
            ["model", "user"], registry=r)
        self.tenant_requests = Counter(
            "fairgate_tenant_requests_total",
            "Finished requests per tenant, by outcome (top tenants, rest: other)",
            ["tenant", "priority_class", "outcome"], registry=r)
        self.tenant_tokens = Counter(
            "fairgate_tenant_tokens_total", "Tokens served per tenant (top tenants, rest: other)",
            ["tenant", "kind"], registry=r)
        self.tenant_limit_refusals = Counter(
            "fairgate_tenant_limit_refusals_total",
            "Requests refused by a key's or tenant's limits, per tenant: rate_limit_exceeded "
            "or insufficient_quota", ["tenant", "code"], registry=r)
        self.redis_latency = Histogram(
            "fairgate_redis_command_duration_seconds", "Redis command round trips (non-blocking)",
            ["command"], buckets=REDIS_BUCKETS, registry=r)
        self.loop_lag = Histogram(
            "fairgate_event_loop_lag_seconds",
            "How late this process's event loop ran a timer (gateway/core/loop_lag.py): a "
            "busy loop delays every request it serves by as much",
            buckets=LOOP_LAG_BUCKETS, registry=r)
        self.redis_errors = Counter(
            "fairgate_redis_errors_total", "Redis commands that failed", ["command"], registry=r)
        self.redis_commands = Counter(
            "fairgate_redis_commands_total",
            "Redis commands sent (pipelined ones too); a Lua script by its name",
            ["command", "script"], registry=r)
        self.local_dispatches = Counter(
            "fairgate_local_dispatches_total",
            "Requests this replica granted on its own while Redis was unreachable "
            "(store_outage: local)", ["model", "backend", "priority_class"], registry=r)
        self.serving_locally = Gauge(
            "fairgate_serving_locally",
            "1 while this replica serves from its own queues because Redis is unreachable "
            "(store_outage: local)", registry=r, multiprocess_mode="livemax")
        self.share_ratio = Gauge(
            "fairgate_share_ratio",
            "Served ÷ entitled share of each backlogged tenant and user: its share of the "
            "model's recent (decayed, 60 s half-life) service across every replica against "
            "its weight's share among the backlogged; 1 is exactly fair "
            "(policies/share_ratio.py)", ["model", "level", "name"], registry=r,
            multiprocess_mode=SHARED)
        # Preemption for fairness (policies/preemption.py): streams this replica moved off
        # a full backend for a waiting request of a higher class, by the victim's class
        self.preemptions = Counter(
            "fairgate_preemptions_total",
            "Running requests preempted (their slot given to a waiting request of a higher "
            "class; they continue later, fairgate_continuations_total{reason=\"preempt\"})",
            ["model", "priority_class"], registry=r)
        # Continued answers (gateway/proxy/continuation.py): why, and what they cost.
        self.continuations = Counter(
            "fairgate_continuations_total",
            "Answers continued on another backend, by reason (failover; retry: a whole "
            "answer sent again once after a 5xx answer; drain, preempt: moved on purpose) "
            "and outcome "
            "(continued: a backend took the rest; failed: none could, the stream ended with "
            "an error)", ["reason", "outcome"], registry=r)
        self.continuation_recomputed_tokens = Counter(
            "fairgate_continuation_recomputed_tokens_total",
            "Prompt plus already generated tokens a continuation sent again (the backend "
            "recomputes what its prefix cache lacks); charged to nobody", ["reason"],
            registry=r)
        self.continuation_pause = Histogram(
            "fairgate_continuation_pause_seconds",
            "From a stream's failure to its continuation's first frame", ["reason"],
            buckets=TTFT_BUCKETS, registry=r)
        # The pools' demand and capacity (gateway/ops/pools.py, policies/autoscale.py)
        self.pool_demand_tokens = Gauge(
            "fairgate_pool_queued_demand_tokens",
            "Queued demand on a pool (a model and prompt range) by class: estimated "
            "uncached prompt tokens plus expected output tokens", ["pool", "priority_class"],
            registry=r, multiprocess_mode=SHARED)
        self.pool_queued = Gauge(
            "fairgate_pool_queued_requests", "Queued requests a pool's backends take, by "
            "class (estimated from a sample of the queue)", ["pool", "priority_class"],
            registry=r, multiprocess_mode=SHARED)
        self.pool_wait = Gauge(
            "fairgate_pool_wait_estimate_seconds",
            "Estimated queue wait of the pool's queued requests by class, of the request "
            "halfway (p50) and 90 % (p90) down the class's queue (NaN: no rate measured yet)",
            ["pool", "priority_class", "percentile"], registry=r, multiprocess_mode=SHARED)
        self.pool_at_risk = Gauge(
            "fairgate_pool_requests_at_risk",
            "Queued requests whose wait estimate passes their deadline (first-token "
            "deadline, else the class's max_queue_wait_s), by class",
            ["pool", "priority_class"], registry=r, multiprocess_mode=SHARED)
        self.pool_ready = Gauge(
            "fairgate_pool_ready_replicas", "Backends of the pool that take work now",
            ["pool"], registry=r, multiprocess_mode=SHARED)
        self.pool_desired = Gauge(
            "fairgate_pool_desired_replicas",
            "Backends the pool needs for each class's queue-wait target (Little's law on "
            "the measured per-backend rate, with hysteresis and a scale-down delay; "
            "docs/autoscaling.md)", ["pool"], registry=r, multiprocess_mode="livemax")
        self.backend_service_tokens = Gauge(
            "fairgate_backend_service_tokens_per_second",
            "Tokens a backend computed per second (uncached prompt + output), from vLLM's "
            "counters over the last 30 s", ["backend"], registry=r, multiprocess_mode=SHARED)
        self.backend_service_requests = Gauge(
            "fairgate_backend_service_requests_per_second",
            "Requests a backend finished per second, from vLLM's counters over the last "
            "30 s", ["backend"], registry=r, multiprocess_mode=SHARED)
        self.first_scrape_waits = Counter(
            "fairgate_first_scrape_waits_total",
            "Requests that found no healthy backend of their model before its backends' "
            "first scrape and waited for it (first_scrape_wait_s)", ["model"], registry=r)
        self.loop_restarts = Counter(
            "fairgate_loop_restarts_total",
            "Background loops restarted after a crash (dispatch, listen, heartbeat, scrape, "
            "batch, history, quotas, migrate, pools)", ["loop"], registry=r)
        # Fed by the Batch API (/v1/batches): job counts by status and per-line outcomes.
        self.batch_jobs = Gauge(
            "fairgate_batch_jobs", "Batch jobs by status", ["status"], registry=r,
            multiprocess_mode=SHARED)
        self.batch_requests = Counter(
            "fairgate_batch_requests_total", "Batch lines finished, by outcome", ["outcome"],
            registry=r)

    @property
    def redis(self) -> RedisMetrics:
        if self._redis is None:
            self._redis = RedisMetrics(self.redis_latency, self.redis_errors,
                                       self.redis_commands)
        return self._redis

    # -- hooks called on the request path ---------------------------------------------

    def on_dispatch(self, model: str, backend: str, klass: str, user: str, rank: int) -> None:
        self.child(self.dispatch_rank, klass).observe(rank)
        recent = self.recent_dispatches.setdefault(backend, deque(maxlen=100_000))
        recent.append(time.monotonic())
        self._user_inc(self.user_requests, (model,), user, 1.0)

    def on_finish(self, model: str, klass: str, user: str, prompt_tokens: int,
                  output_tokens: int, service: float, timing: StreamTiming | None,
                  cached_tokens: int = 0) -> None:
        """After the answer went out (or failed): latency histograms, per-user counters."""
        child = self.child
        child(self.tokens, model, "prompt").inc(prompt_tokens)
        if cached_tokens:
            child(self.tokens, model, "prompt_cached").inc(cached_tokens)
        child(self.tokens, model, "completion").inc(output_tokens)
        if timing is not None:
            timing.end_s = time.monotonic()
            child(self.request_duration, klass).observe(timing.end_s - timing.arrived_s)
            if timing.first_token_s is not None:
                ttft = timing.first_token_s - timing.arrived_s
                child(self.ttft, klass).observe(ttft)
                if len(self.recent_ttft) < MAX_RECENT_TTFT:
                    self.recent_ttft.append(ttft)
                if output_tokens > 1 and timing.last_token_s is not None:
                    child(self.tpot, klass).observe(
                        (timing.last_token_s - timing.first_token_s) / (output_tokens - 1))
        self._user_inc(self.user_tokens, (model,), user, prompt_tokens, ("prompt",))
        self._user_inc(self.user_tokens, (model,), user, output_tokens, ("completion",))
        self._user_inc(self.user_service, (model,), user, service)
        self.shares.setdefault(model, ServiceShares()).add(user, service, time.monotonic())
        pending = self.pending_service.setdefault(model, {})
        if service > 0 and (user in pending or len(pending) < MAX_SHARE_USERS):
            pending[user] = pending.get(user, 0.0) + service

    def on_queued(self, model: str, user: str, tenant: str, weight: float,
                  tenant_weight: float) -> None:
        """A request of ``user`` (in ``tenant``, "": its own) was queued: who it is goes to
        the shares in Redis with the next flush (bounded like the service)."""
        pending = self.pending_who.setdefault(model, {})
        if user in pending or len(pending) < MAX_SHARE_USERS:
            pending[user] = (tenant, weight, tenant_weight)

    def set_share_ratios(self, model: str, tenants: Mapping[str, float],
                         users: Mapping[str, float]) -> None:
        """``fairgate_share_ratio`` of ``model`` now: series for those given (users and
        tenants within the label caps), the model's others removed."""
        shown: set[tuple[str, str, str]] = set()
        for level, ratios, labelled in (("tenant", tenants, self._tenant_label),
                                        ("user", users, self._user_label)):
            for name, ratio in ratios.items():
                label = labelled(name)
                if label != OTHER_USERS:
                    shown.add((model, level, label))
                    self.share_ratio.labels(model, level, label).set(ratio)
        for series in [s for s in self._share_series if s[0] == model and s not in shown]:
            if self.multiprocess:  # a removed series keeps its last value there
                self.share_ratio.labels(*series).set(float("nan"))
            self.share_ratio.remove(*series)
            self._share_series.discard(series)
        self._share_series |= shown

    def on_tenant_usage(self, tenant: str, klass: str, prompt_tokens: int,
                        output_tokens: int, error: bool) -> None:
        label = self._tenant_label(tenant)
        self.child(self.tenant_requests, label, klass, "error" if error else "ok").inc()
        if prompt_tokens:
            self.child(self.tenant_tokens, label, "prompt").inc(prompt_tokens)
        if output_tokens:
            self.child(self.tenant_tokens, label, "completion").inc(output_tokens)

    def on_limit_refused(self, tenant: str, code: str) -> None:
        self.tenant_limit_refusals.labels(self._tenant_label(tenant), code).inc()

    def _tenant_label(self, tenant: str) -> str:
        """At most ``top_users`` tenant label values (rest: ``other``); an idle tenant's
        series give way to an active one's, as users' do."""
        label, expired = self.tenant_labels.label(tenant, time.monotonic())
        for gone in expired:
            for metric in (self.tenant_requests, self.tenant_tokens,
                           self.tenant_limit_refusals):
                for labels in [k for k in metric._metrics if k[0] == gone]:
                    self._remove(metric, tuple(labels))
        return label

    def _user_label(self, user: str) -> str:
        """At most ``top_users`` user label values (rest: ``other``); an idle user's
        series give way to an active one's."""
        label, expired = self.users.label(user, time.monotonic())
        for gone in expired:
            for metric, labels in self._user_series.pop(gone, set()):
                self._remove(metric, tuple(labels))
        return label

    def _user_inc(self, counter: Counter, head: tuple[str, ...], user: str, amount: float,
                  tail: tuple[str, ...] = ()) -> None:
        label = self._user_label(user)
        labels = (*head, label, *tail)
        if label != OTHER_USERS:
            self._user_series.setdefault(label, set()).add((counter, labels))
        self.child(counter, *labels).inc(amount)

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, resolved once per label set."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def _remove(self, metric: Any, labels: tuple[str, ...]) -> None:
        self._children.pop((metric, labels), None)
        metric.remove(*labels)

    def forget_backend(self, backend: str) -> int:
        """``backend`` left the list in force (``BackendPool.reconcile``): remove every
        series labelled with it, so a removed backend neither exports its last values
        forever nor keeps an alert on its last health firing, and what this process kept
        of it. The number of series removed (in multiprocess mode the workers' files keep
        theirs until the workers restart, as for idle users)."""
        removed = 0
        for metric in vars(self).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            names: tuple[str, ...] = metric._labelnames  # prometheus_client: no public getter
            if "backend" not in names:
                continue
            at = names.index("backend")
            for labels in [k for k in list(metric._metrics) if k[at] == backend]:
                self._remove(metric, tuple(labels))
                removed += 1
        for per_backend in (self.recent_dispatches, self.recent_predictions,
                            self.decision_counts, self._gate_state, self._adapters):
            per_backend.pop(backend, None)
        return removed

    def on_dispatch_decision(self, model: str, backend: str, reason: str,
                             matched_blocks: int, prompt_blocks: int) -> None:
        """Why a request went to ``backend`` and how much of its prompt the backend's
        prefix index held (``routing: locality``; blocks of ``policies/locality.py``)."""
        self.child(self.dispatch_decisions, model, backend, reason).inc()
        counts = self.decision_counts.setdefault(backend, {})
        counts[reason] = counts.get(reason, 0) + 1
        if prompt_blocks > 0:
            self.prefix_predicted_blocks.labels(backend, "query").inc(prompt_blocks)
            self.prefix_predicted_blocks.labels(backend, "hit").inc(matched_blocks)
            recent = self.recent_predictions.setdefault(backend, deque(maxlen=100_000))
            recent.append((time.monotonic(), matched_blocks, prompt_blocks))

    def predicted_hit_ratio(self, backend: str, window_s: float) -> float | None:
        """The share of the prompt blocks dispatched to ``backend`` in the last
        ``window_s`` that its prefix index held (this replica's dispatches; None: none)."""
        recent = self.recent_predictions.get(backend)
        cutoff = time.monotonic() - window_s
        while recent and recent[0][0] < cutoff:
            recent.popleft()
        queried = sum(q for _, _, q in recent) if recent else 0
        return sum(h for _, h, _ in recent) / queried if recent and queried else None

    def moves_view(self) -> dict[str, Any]:
        """This replica's continued answers by reason (continued, failed, tokens sent
        again) and its preemptions by model and class: the dashboard's reliability panel."""
        reasons: dict[str, dict[str, float]] = {}
        for sample in _totals(self.continuations):
            row = reasons.setdefault(sample.labels["reason"], {})
            row[sample.labels["outcome"]] = sample.value
        for sample in _totals(self.continuation_recomputed_tokens):
            reasons.setdefault(sample.labels["reason"], {})["recomputed_tokens"] = sample.value
        preempted = {f"{s.labels['model']} · {s.labels['priority_class']}": s.value
                     for s in _totals(self.preemptions)}
        return {"continuations": reasons, "preempted": preempted}

    def dispatch_rate(self, backend: str) -> float:
        """Dispatches per second to ``backend`` over the last few seconds (this replica)."""
        recent = self.recent_dispatches.get(backend)
        if not recent:
            return 0.0
        cutoff = time.monotonic() - DISPATCH_RATE_WINDOW_S
        while recent and recent[0] < cutoff:
            recent.popleft()
        return len(recent) / DISPATCH_RATE_WINDOW_S

    # -- gates ----------------------------------------------------------------------------

    def record_pacing(self, backend: str, cls: str, allowance: float, free_slots: int,
                      changed_for: str | None) -> None:
        """The allowance and free slots now, and the reason the allowance just changed
        (None: unchanged)."""
        self.child(self.pacing_allowance, backend, cls).set(allowance)
        self.child(self.pacing_free_slots, backend, cls).set(free_slots)
        if changed_for is not None:
            self.child(self.pacing_changes, backend, cls, changed_for).inc()

    def record_adapters(self, backend: str, loaded: frozenset[str],
                        active: tuple[str, ...], slots: int | None) -> None:
        """A backend's adapters by its latest snapshot: available, active, and its slots
        (None: no LoRA gauge). An adapter shown before and gone now drops to 0."""
        shown = self._adapters.setdefault(backend, set())
        for adapter in shown | loaded | set(active):
            self.child(self.backend_adapter_loaded, backend, adapter).set(
                1 if adapter in loaded else 0)
            self.child(self.backend_adapter_active, backend, adapter).set(
                1 if adapter in active else 0)
        shown |= loaded | set(active)
        if slots is not None:
            self.child(self.backend_lora_slots, backend).set(slots)

    def record_gates(self, backend: str, reasons: Mapping[str, str | None], now: float) -> None:
        """Record each class's gate state; the time since the last call is charged to the
        reasons that held until now."""
        previous = self._gate_state.get(backend)
        if previous is not None:
            elapsed = max(0.0, now - previous[0])
            for klass, reason in previous[1].items():
                if reason is not None:
                    self.child(self.gate_closed_time, backend, klass, reason).inc(elapsed)
        self._gate_state[backend] = (now, dict(reasons))
        for klass, reason in reasons.items():
            self.child(self.gate_open, backend, klass).set(1 if reason is None else 0)
            for r in GATE_REASONS:
                self.child(self.gate_reason, backend, klass, r).set(1 if r == reason else 0)
            if reason is not None:
                self.child(self.gate_closed, backend, klass, reason).inc()


class StreamTiming:
    """Monotonic timestamps of one streamed answer, as the client received it."""

    __slots__ = ("arrived_s", "end_s", "first_token_s", "last_token_s")

    def __init__(self, arrived_s: float) -> None:
        self.arrived_s = arrived_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.end_s = arrived_s

    def token_frames_sent(self) -> None:
        now = time.monotonic()
        if self.first_token_s is None:
            self.first_token_s = now
        self.last_token_s = now


def _totals(counter: Counter) -> list[Any]:
    """A labelled counter's ``_total`` samples (one per label set seen)."""
    return [sample for family in counter.collect() for sample in family.samples
            if sample.name.endswith("_total")]
