"""The settings' groups, one small model per concern (``docs/configuration.md``).

Each field declares whether a change needs a restart: :func:`restart` with the reason
(what wired it in at start); a field declared with plain ``Field``/a default is read
while serving, so a reload (``gateway/reload.py``) applies it. The reload's restart
list, the docs' table and the reload test all read that declaration (:func:`leaves`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic.fields import FieldInfo

from gateway.core.settings.parts import RedisCluster, RedisSentinel
from policies.classes import default_floors
from policies.fairness import POLICIES

RESTART = "restart"  # the key of a field's json_schema_extra naming why it needs a restart


def restart(default: Any = ..., why: str = "", **field: Any) -> Any:
    """A field whose value is wired in at start: a reload keeps the old one and reports
    the field under ``restart_required``; ``why`` says what holds it."""
    assert why, "a restart field says why"
    return Field(default, json_schema_extra={RESTART: why}, **field)


def restart_reason(info: FieldInfo) -> str | None:
    extra = info.json_schema_extra
    return extra.get(RESTART) if isinstance(extra, dict) else None  # type: ignore[return-value]


class Group(BaseModel):
    """One concern's settings (a YAML mapping, ``FAIRGATE_<GROUP>__<FIELD>`` in env)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


AT_START = "bound when the server starts"


class ListenSettings(Group):
    """The client side: the listen socket and the guards of its connections
    (gateway/http/server.py, gateway/http/client_guard.py)."""

    host: str = restart("127.0.0.1", AT_START)
    port: int = restart(8000, AT_START)
    # `fairgate serve` processes on the listen port (gateway/runtime/workers.py); None: one
    # per core; 1: the gateway in the serving process itself
    workers: int | None = restart(None, "the worker processes are forked at start", ge=1)
    # `fairgate serve`'s event loop: uvloop when installed (a dependency on CPython outside
    # Windows), else asyncio's
    event_loop: Literal["auto", "uvloop", "asyncio"] = restart("auto", "the loop runs the process")
    # a cap with a clear 503, and a deadline for a connection to complete a request's
    # headers (also closes idle keep-alives) or for a body to keep arriving, then at
    # least this rate
    max_client_connections: int = restart(10000, AT_START, ge=1)
    client_idle_timeout_s: float = restart(30.0, AT_START, gt=0)
    min_body_bytes_per_s: int = restart(1024, AT_START, ge=0)
    # connections on which no request authenticated yet; None: half the cap
    max_unauthenticated_connections: int | None = restart(None, AT_START, ge=1)
    max_body_bytes: int = restart(4 * 1024 * 1024, "the HTTP app's body limit, set at start",
                                  ge=1)


CONNECTED = "the store's client is connected at start"


class StoreSettings(Group):
    """Where the shared state lives (gateway/storage/redis_client.py): one Redis (or
    Valkey), Sentinel or a Cluster; None of the three: an embedded Valkey server."""

    redis_url: str | None = restart(None, CONNECTED)
    redis_sentinel: RedisSentinel | None = restart(None, CONNECTED)  # the store behind Sentinel
    # a Redis Cluster instead of redis_url (connect_cluster)
    redis_cluster: RedisCluster | None = restart(None, CONNECTED)
    # with redis_sentinel or redis_cluster: how long queued clients (and newcomers) wait
    # for the store to come back (a failover: the master's down-after-milliseconds, or
    # the cluster-node-timeout, plus the promotion) before they get a 503; 0: at once, as
    # with a single Redis
    store_failover_wait_s: float = Field(default=10.0, ge=0)
    # a store that keeps its connections open but answers nothing (a frozen process, a
    # node cut off without a reset) fails each command after this long instead of holding
    # it forever: clients get the 503 of a store that is down, loops back off. Above the
    # dispatcher's 1 s blocking read (STORE_BLOCK_S); a timed-out command is not sent again
    redis_socket_timeout_s: float = restart(5.0, CONNECTED, ge=2.0)
    # A Redis outage: "fail_closed" answers queued and new requests 503 until it is back;
    # "local" keeps serving each replica's own clients from its own fair queues, pacing
    # each backend with its share of the gate (gateway/scheduling/local.py)
    store_outage: Literal["fail_closed", "local"] = "fail_closed"
    # the embedded Valkey's data and the Batch API's files
    data_dir: Path = restart(Path(".fairgate"), "the file store is opened at start")

    @field_validator("redis_url", mode="before")
    @classmethod
    def _empty_url_is_none(cls, value: Any) -> Any:
        return None if value == "" else value  # FAIRGATE_STORE__REDIS_URL="" unsets a file's


class ReplicasSettings(Group):
    """The gateway replicas sharing one store (gateway/scheduling/dispatcher.py)."""

    replica_id: str | None = restart(None, "the process's id in the store")  # None: random
    replica_heartbeat_s: float = 1.0
    # A replica silent this long is dead: its queued requests are dropped and what it
    # held in flight is released (sooner when it leaves a grant unread for 2 s). Three
    # heartbeats: a killed replica's slots must not hold the survivors' gates for long.
    replica_ttl_s: float = 3.0


class FleetSettings(Group):
    """Reading the backends (gateway/backends/scrape.py, registry.py): one process
    scrapes each (a lease in Redis) every ``scrape_interval_s`` while it is busy or work
    is queued for its model, every ``idle_scrape_interval_s`` while idle (never more than
    half of ``snapshot_stale_s``); the next enqueue brings it back at once."""

    # how often each process reads the backends added at runtime (admin API, DNS) from
    # Redis: a new or removed one is in force everywhere within this time
    backends_refresh_s: float = Field(default=1.0, gt=0)
    scrape_interval_s: float = Field(default=0.1, gt=0)
    idle_scrape_interval_s: float = Field(default=0.5, gt=0)
    scrape_timeout_s: float = 1.0
    # a request that finds no healthy backend of its model before each was scraped (or
    # failed) once, right after the start, waits for that at most this long (then 503)
    first_scrape_wait_s: float = Field(default=5.0, ge=0)
    snapshot_stale_s: float = 1.0
    # Scale from zero: a request whose pool has no healthy backend stays queued this long
    # for one to become ready (docs/autoscaling.md) before its 503; 0: the 503 at once
    cold_start_wait_s: float = Field(default=0.0, ge=0)
    unhealthy_after_failures: int = 3


class PacingSettings(Group):
    """How much each backend is given (policies/pacing.py, policies/prefill.py)."""

    # "adaptive": each class's max_waiting is the ceiling of an allowance tuned per
    # backend from its TPOT, TTFT and batch room; "fixed": max_waiting as is
    mode: Literal["adaptive", "fixed"] = "adaptive"
    # the span of each backend's TPOT, TTFT and prefix-cache windows that pacing reads
    tpot_window_s: float = Field(default=5.0, gt=0)
    # a request the prefill-token gate holds may be passed by smaller ones that fit for
    # this long; then its backend takes no more of the class until the request gets in
    # (0: it blocks its class at once)
    prefill_backfill_s: float = Field(default=1.0, ge=0)


class RoutingSettings(Group):
    """Where work goes (policies/locality.py). "least_loaded": backends least loaded
    first, each takes requests in strict fairness order. "locality": each backend's
    prefix index (Redis) records what it was sent, and among the users within
    ``locality_slack`` (service units) of the least-served one, the head whose prompt
    prefix is best cached there goes first; 0 = strict order. "auto": locality for a
    model with two or more backends, least_loaded for one."""

    mode: Literal["auto", "least_loaded", "locality"] = "auto"
    locality_slack: float = Field(default=4096.0, ge=0)
    locality_candidates: int = Field(default=8, ge=1, le=64)  # users compared within the slack
    # block hashes kept per backend (≈ 64 tokens each); a hash not sent again this long
    # is dropped
    prefix_index_size: int = Field(default=8192, ge=1)
    prefix_index_ttl_s: float = Field(default=600.0, gt=0)
    # a request whose prefix another backend holds waits for that one unless it has more
    # than this many requests in flight beyond the backend with room (bounded load)
    locality_max_imbalance: int = Field(default=4, ge=0)


POLICY = "the fairness policy is built at start"


class FairnessSettings(Group):
    """Who goes first (policies/fairness.py, docs/scheduling.md)."""

    policy: str = restart("vtc", POLICY)
    # Fair share per model ("model") or across the fleet ("fleet": a tenant's and a
    # user's service counters span every model, each model's charges multiplied by its
    # cost factor). Needs one Redis (or Sentinel), not a Redis Cluster.
    fairness_scope: Literal["model", "fleet"] = restart(
        "model", "the store's fleet-wide counters are named at start")
    # fleet scope: what a model's service counts for against the others' (8 for a 70B
    # model beside 8B ones at 1); a model not listed counts 1.0. Read per request.
    cost_factors: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = {}
    # Sessions, a third level (tenant -> user -> session): within a user, its sessions
    # (X-Fairgate-Session, or a Responses API conversation) share its service fairly.
    sessions: bool = False
    vtc_input_weight: float = restart(1.0, POLICY)
    vtc_output_weight: float = restart(2.0, POLICY)
    # VTC's optional KV-occupancy term: cost per token-second of KV cache a request held
    # (policies/cost.py kv_token_seconds), charged at settle; 0: off
    vtc_kv_weight: float = restart(0.0, POLICY, ge=0)
    priority_class_gap: int = restart(1000, POLICY)
    # Starvation protection (policies/starvation.py): a class backlogged this long is
    # owed its floor share of the last `starvation_window` dispatches.
    starvation_after_s: float = 30.0
    class_floors: dict[str, float] = Field(default_factory=default_floors)
    starvation_window: int = 100
    # A trusted key's end user idle this long (nothing queued or in flight) has its
    # fairness state forgotten; it returns as a new user.
    end_user_idle_s: float = Field(default=86400.0, gt=0)
    # Preemption for fairness (policies/preemption.py): a request that waited its class's
    # preempt_after_ms while the model's backends are full takes the slot of a running
    # request of a preemptible lower class, or (classes with fair_preemption) of an
    # over-served user of its own class. false: never.
    preemption: bool = True
    # same-class preemption: the waiting user's fairness score must be lower than the
    # running user's by more than this (service units); None: any lower score. Set, it
    # also turns same-class preemption on for preemptible classes without fair_preemption
    preempt_fair_gap: float | None = Field(default=None, gt=0)
    # what preemption may make the backends compute again (the preempted answers' prompts
    # and tokens so far): this part of the tokens the streams served, plus a burst
    preempt_recompute_ratio: float = Field(default=0.05, ge=0, le=1)
    preempt_recompute_burst_tokens: int = Field(default=1024, ge=0)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"must be one of {', '.join(POLICIES)}")
        return value


OPENED = "the upstream client is built at start"


class UpstreamSettings(Group):
    """Talking to the backends (gateway/proxy/upstream.py, continuation.py)."""

    upstream_timeout_s: float = restart(600.0, OPENED)  # the backend sends nothing this long → 502
    max_request_s: float = restart(3600.0, OPENED, gt=0)  # one answer, streamed or not, at most
    # a stream under way that brings no whole frame for this long is cut: continued
    # elsewhere when it can be, else ended with an error event (bytes trickled in reset
    # aiohttp's sock_read timer, so upstream_timeout_s never fires)
    stream_idle_timeout_s: float = Field(default=60.0, gt=0)
    upstream_keepalive_s: float = restart(4.0, OPENED)  # below uvicorn's 5 s idle close
    # A chat or completion whose backend fails mid-answer continues on another backend of
    # its model from the tokens generated so far, at most this many times (0: the stream
    # ends with an error event); each continuation waits at most `continue_wait_s`.
    continue_attempts: int = Field(default=2, ge=0, le=10)
    continue_wait_s: float = Field(default=60.0, gt=0)
    # A running answer moved on purpose (a drain with migrate, preemption) continues the
    # same way; one request is moved at most this many times (0: never moved).
    max_moves: int = Field(default=4, ge=0, le=100)


class LimitsSettings(Group):
    """Bounds on what one client may send or hold: each refused with a clear 400 (413,
    429) instead of reaching Redis, the metrics or vLLM."""

    max_queued_per_user: int = Field(default=1000, ge=1)
    # /tokenize and /detokenize (not queued): their own body limit, and how many of one
    # user's may be at the backends at once on a replica (beyond: 429)
    max_unqueued_body_bytes: int = Field(default=1024 * 1024, ge=1)
    max_unqueued_per_user: int = Field(default=4, ge=1)
    max_json_depth: int = Field(default=64, ge=2)  # nesting of a request body or batch line body
    max_output_tokens: int = Field(default=131072, ge=1)  # max_tokens / max_completion_tokens
    max_end_user_chars: int = Field(default=256, ge=1)  # body field `user`, printable text only
    retry_after_s: int = 1
    # a streamed request sent with X-Fairgate-Queue-Status: 1 gets its 200 at once and an
    # SSE comment with its place in the queue this often (gateway/http/queue_status.py)
    queue_status_interval_s: float = Field(default=1.0, gt=0)


class AccessSettings(Group):
    """Keys, quotas and logins (gateway/access/)."""

    # HMAC pepper of the API keys created at runtime (gateway/access/keyring.py); set it
    # (FAIRGATE_ACCESS__KEY_PEPPER) outside Redis in production. None: a random pepper
    # kept in Redis, shared by the replicas.
    key_pepper: SecretStr | None = restart(None, "the key store is set up at start")
    key_cache_s: float = Field(default=0.5, gt=0, le=1.0)  # runtime keys: local cache lifetime
    key_rotate_grace_s: float = Field(default=3600.0, ge=0)  # old secret valid this long by default
    quota_lease_s: float = Field(default=30.0, gt=0)  # a concurrency slot expires unless renewed
    usage_retention_days: int = restart(400, "the usage ledger is built at start",
                                        ge=1)  # daily usage records kept in Redis
    session_ttl_s: float = restart(12 * 3600, "the session store is built at start",
                                   gt=0)  # a dashboard login lasts this long
    # a client address that failed this many dashboard logins within the window (opened
    # at its first failure) gets 429 too_many_login_failures until the window ends
    login_max_failures: int = Field(default=10, ge=1)
    login_failure_window_s: float = Field(default=60.0, gt=0)
    metrics_auth: bool = False  # true: GET /metrics needs an admin key (Bearer)


class BatchSettings(Group):
    """The Batch API (gateway/batch/)."""

    max_file_bytes: int = restart(200 * 1024 * 1024, "the file store is built at start")
    max_files_bytes_per_user: int = Field(default=2 * 1024**3, ge=0)  # all of a user's files → 413
    batch_max_in_flight: int = 64  # lines of one batch queued or running at once
    batch_lease_s: float = 10.0  # a runner silent this long loses its batch to another
    batch_poll_s: float = 1.0


class LoraSettings(Group):
    """LoRA adapters' upkeep (``adapters`` lists them; docs/adapters.md)."""

    # how often a backend with LoRA (vLLM's vllm:lora_requests_info gauge) has its
    # /v1/models read again by its scraper, for the adapters loaded or unloaded since
    adapter_refresh_s: float = Field(default=5.0, gt=0)
    # runtime adapters: one the gateway loaded is not unloaded for another within its
    # minimum residency: nine times its measured load, at least 1 s
    # (policies/adapters.residency_s), or adapter_min_residency_s when set; a request for
    # one resident nowhere waits at most adapter_load_wait_s for its load (a 503 after);
    # a load that failed is not tried again for adapter_load_retry_s
    adapter_min_residency_s: float | None = Field(default=None, ge=0)
    adapter_load_wait_s: float = Field(default=60.0, gt=0)
    adapter_load_retry_s: float = Field(default=30.0, gt=0)


LOGS = "the logs are set up at start"


class OperationsSettings(Group):
    """Logs, metrics and the dashboard (gateway/core/logs.py, metrics.py)."""

    log_level: Literal["debug", "info", "warning", "error"] = restart("info", LOGS)
    # above this many per-request info lines (finished, one a request) a second, keep
    # about this many; errors and rejections always logged. None: every line
    log_sample_above_per_s: float | None = restart(None, LOGS, gt=0)
    # per-user series: this many users, rest "other"
    metrics_top_users: int = restart(20, "the metrics are built at start", ge=0)
    # an idle user's series give way to an active one
    metrics_user_idle_s: float = restart(3600.0, "the metrics are built at start")
    # the Grafana dashboard (deploy/grafana/dashboards/fairgate.json) as operators reach
    # it: the live dashboard links to it (None: no link)
    grafana_url: str | None = None


# every group by its name in the config (the order of docs/configuration.md)
GROUPS: dict[str, type[Group]] = {
    "listen": ListenSettings, "store": StoreSettings, "replicas": ReplicasSettings,
    "fleet": FleetSettings, "pacing": PacingSettings, "routing": RoutingSettings,
    "fairness": FairnessSettings, "upstream": UpstreamSettings, "limits": LimitsSettings,
    "access": AccessSettings, "batch": BatchSettings, "lora": LoraSettings,
    "operations": OperationsSettings,
}
# the flat names of fields renamed inside their group (the group took the old name)
RENAMED = {"fairness.policy": "fairness", "pacing.mode": "pacing", "routing.mode": "routing"}
