"""Configuration: one :class:`Settings` object, from YAML plus ``FAIRGATE_*`` env vars.

Precedence: explicit overrides > environment (``FAIRGATE_REDIS_URL``,
``FAIRGATE_LISTEN__PORT``, …) > YAML file (``--config`` or ``FAIRGATE_CONFIG``) > defaults.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from gateway.core.backend_names import BackendUrl, check_backend_name
from policies.classes import CLASS_ORDER, CLASSES, DEFAULT_CLASS, ClassSpec, default_floors
from policies.fairness import POLICIES
from policies.fleet import factor_of
from policies.gates import GatePolicy
from policies.pacing import PacingTargets
from policies.preemption import PreemptRule
from policies.prefill import PromptRange


class Listen(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 8000


def _host_port(node: str) -> str:
    host, _, port = node.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"node {node!r} is not host:port")
    return node


HostPort = Annotated[str, AfterValidator(_host_port)]  # a Redis node: "host:port"


def addresses(nodes: list[str]) -> list[tuple[str, int]]:
    """(host, port) of each "host:port" node; an IPv6 host loses its brackets."""
    return [(host.strip("[]"), int(port))
            for host, _, port in (node.rpartition(":") for node in nodes)]


class RedisCluster(BaseModel):
    """A Redis (or Valkey) Cluster as the store (``redis_cluster``; env
    ``FAIRGATE_REDIS_CLUSTER__NODES='["10.0.0.1:6379", …]'``): any of its nodes, the rest
    is discovered. Each model's keys live in one slot (its hash tag), so models spread
    over the shards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: list[HostPort] = Field(min_length=1)  # any of the cluster's nodes
    username: str | None = None
    password: SecretStr | None = None
    ssl: bool = False

    def env(self) -> str:
        """The JSON of ``FAIRGATE_REDIS_CLUSTER`` that gives a worker process this
        cluster (the password included)."""
        return json.dumps({**self.model_dump(exclude={"password"}), "password":
                           None if self.password is None else self.password.get_secret_value()})


class RedisSentinel(BaseModel):
    """The store behind Redis Sentinel (``gateway/storage/redis_client.py``
    connect_sentinel): the master of ``master_name`` as the sentinels at ``nodes``
    ("host:port", a list or one comma-separated string) name it, followed through a
    failover. Passwords and TLS as redis-py takes them; ``sentinel_*`` for the sentinels'
    own connections."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    master_name: str = Field(min_length=1)
    nodes: Annotated[list[HostPort], NoDecode] = Field(min_length=1)
    db: int = Field(0, ge=0)
    username: str | None = None
    password: SecretStr | None = None
    sentinel_username: str | None = None
    sentinel_password: SecretStr | None = None
    ssl: bool = False  # TLS to the master
    sentinel_ssl: bool = False  # TLS to the sentinels
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    @field_validator("nodes", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        """From the environment: a JSON list, or "host:port,host:port"."""
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            return json.loads(value)
        return [n.strip() for n in value.split(",") if n.strip()]

    def addresses(self) -> list[tuple[str, int]]:
        return addresses(self.nodes)


class PoolFields(BaseModel):
    """What a backend's pool takes, for a configured backend and a discovered one alike."""

    model_config = ConfigDict(extra="forbid")

    # the estimated prompt lengths it takes (policies/prefill.py): a short-context pool
    # and a long_context pool of one model, say; a request goes only where it fits, and
    # one that fits no backend of its model is refused with a 400
    min_prompt_tokens: int = Field(0, ge=0)
    max_prompt_tokens: int | None = Field(None, ge=1)
    pool: str | None = None  # a name for its range, shown to operators ("long_context")
    # its vLLM's --max-num-batched-tokens (a step's token budget): the default of the
    # classes' prefill-token gates (policies/prefill.class_limit)
    max_num_batched_tokens: int = Field(2048, ge=1)

    @model_validator(mode="after")
    def _range(self) -> PoolFields:
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < self.min_prompt_tokens:
            raise ValueError(f"{self.label()}: max_prompt_tokens is below min_prompt_tokens")
        return self

    def label(self) -> str:
        return "backend"

    def pool_fields(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in PoolFields.model_fields}


class Backend(PoolFields):
    # a configured one's is checked by Settings, a runtime one's by the admin API
    # (gateway/core/backend_names.py); DNS discovery names its own (name@address:port)
    name: str
    url: BackendUrl
    model: str

    def label(self) -> str:
        return f"backend {self.name}"

    def prompt_range(self) -> PromptRange:
        return PromptRange(self.min_prompt_tokens, self.max_prompt_tokens)

    @property
    def pool_name(self) -> str:
        """Its pool as autoscaling counts it (``gateway/ops/pools.py``): ``pool``, or the
        model's name when it names none."""
        return self.pool or self.model


class Adapter(BaseModel):
    """A LoRA adapter served on a base model (``adapters``; ``docs/adapters.md``):
    requests naming it are scheduled on ``base_model``'s queues and go to the backends of
    that model where it is available: ``backends`` (their names), or all of them when
    None. Backends' own ``/v1/models`` add the adapters they have loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    base_model: str = Field(min_length=1)
    path: str | None = None  # where the adapter's weights are (shown in /v1/models)
    backends: list[str] | None = None
    # True: the gateway loads it at runtime (vLLM's POST /v1/load_lora_adapter with
    # ``path``) on one of those backends when a request names it and it is resident
    # nowhere, and may unload it to make room for another; it is available only where
    # the backend lists it. False: the backends were started with it (--lora-modules).
    runtime: bool = False

    @model_validator(mode="after")
    def _runtime_has_a_path(self) -> Adapter:
        if self.runtime and not self.path:
            raise ValueError(f"adapter {self.name!r}: runtime: true needs its path")
        return self


class Autoscale(BaseModel):
    """The pools' desired replicas (``policies/autoscale.py``, ``docs/autoscaling.md``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    interval_s: float = Field(default=2.0, gt=0)  # how often the pools' demand is read
    headroom: float = Field(default=0.2, ge=0)  # hysteresis: down only when need × (1 + this) fits
    # the share of a backend's measured rate the targeted classes' load may use: below 1,
    # spare capacity for a burst of 1/this × the load while new backends start
    target_utilization: float = Field(default=1.0, gt=0, le=1)
    # > 0: that room is kept over the pool's usual load (a low quantile of its load over
    # this many seconds) instead of over the load now, so a burst does not ask for room
    # for another burst on top of itself; 0: over the load now
    burst_baseline_s: float = Field(default=0.0, ge=0)
    scale_down_delay_s: float = Field(default=300.0, ge=0)
    min_replicas: int = Field(default=0, ge=0)  # per pool
    max_replicas: int | None = Field(default=None, ge=0)  # per pool; None: no bound
    # the queue-wait target of a class without ttft_slo_ms; a class in neither (batch)
    # only fills idle backends, unless its completion window is at risk
    queue_target_s: dict[str, float] = Field(
        default_factory=lambda: {"interactive": 2.0, "default": 10.0})
    # one backend's service rate (tokens/s) until one was measured; None: unknown
    backend_tokens_per_s: float | None = Field(default=None, gt=0)
    output_tokens: int = Field(default=256, ge=1)  # a request's expected output until measured
    sample_requests: int = Field(default=256, ge=1)  # queued requests read per class and tick

    @field_validator("queue_target_s")
    @classmethod
    def _known_classes(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = set(value) - set(CLASS_ORDER)
        if unknown:
            raise ValueError(f"unknown priority classes: {sorted(unknown)}")
        if any(v <= 0 for v in value.values()):
            raise ValueError("a queue-wait target must be above 0")
        return value


class Discovery(PoolFields):
    """Backends found by a DNS name (``discovery``; gateway/backends/discovery.py): each
    address its A/AAAA records hold is a backend at ``scheme://address:port`` — a
    Kubernetes headless Service's ready pods. Resolved every ``refresh_s`` by the event
    loop's resolver; an address that leaves the answer is drained (its running answers
    move) and then removed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dns_name: str = Field(min_length=1, max_length=253)
    port: int = Field(ge=1, le=65535)
    model: str = Field(min_length=1)
    scheme: Literal["http", "https"] = "http"
    refresh_s: float = Field(10.0, gt=0)

    def label(self) -> str:
        return f"discovery {self.dns_name}"

    @property
    def source(self) -> str:
        """What the backends it found name as their source: ``dns_name:port``."""
        return f"{self.dns_name}:{self.port}"


MAX_LIMIT = 10**15  # exact in Lua's numbers (doubles)


class UsageLimits(BaseModel):
    """Optional limits of a key or a tenant (policies/limits.py); tokens are prompt +
    completion as vLLM reports them. None: no limit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rpm: int | None = Field(None, ge=1, le=MAX_LIMIT)  # requests per minute
    tpm: int | None = Field(None, ge=1, le=MAX_LIMIT)  # tokens per minute
    max_concurrent: int | None = Field(None, ge=1, le=MAX_LIMIT)  # admitted, not finished
    daily_tokens: int | None = Field(None, ge=1, le=MAX_LIMIT)  # budget per UTC day
    monthly_tokens: int | None = Field(None, ge=1, le=MAX_LIMIT)  # budget per UTC calendar month

    def any(self) -> bool:
        return any(v is not None for v in self.model_dump().values())


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(1.0, gt=0)
    limits: UsageLimits | None = None
    # guaranteed share: with a request queued, at least this part of its model's last
    # `starvation_window` dispatches, whatever the weights (policies/fairness.owed_tenant);
    # 0: none. The tenants' shares are at most 1 in all.
    min_share: float = Field(0.0, ge=0, le=1)


def _shares_fit(tenants: dict[str, Tenant]) -> dict[str, Tenant]:
    """The tenants' guaranteed shares add up to at most 1 (more cannot all be given)."""
    total = sum(t.min_share for t in tenants.values())
    if total > 1 + 1e-9:
        named = ", ".join(f"{name} {t.min_share:g}" for name, t in sorted(tenants.items())
                          if t.min_share > 0)
        raise ValueError(f"the tenants' min_share add up to {total:g} ({named}): at most 1")
    return tenants


# the configured tenants, by name
Tenants = Annotated[dict[str, Tenant], AfterValidator(_shares_fit)]


# ':' joins the parts of a Redis key name (a user's queue is ``q:<class>:<tenant>:<user>``,
# gateway/storage/keys.py) and '/' a trusted key's user to its end user ("app/alice"), so
# neither may be part of a key's user or tenant: ("a", "b:c") and ("a:b", "c") would share
# one queue, and a key of user "app/alice" would be an end user of the trusted key "app".
NAME_SEPARATORS = (":", "/")
END_USER_SEPARATOR = "/"
OWNER_SEPARATOR = "/"  # a named tenant's user as an owner: "research/alice"


def end_user_name(key_user: str, end_user: str) -> str:
    """The scheduler's user for ``end_user`` of a trusted key of ``key_user``."""
    return f"{key_user}{END_USER_SEPARATOR}{end_user}"


def owner_id(user: str, tenant: str | None) -> str:
    """Who owns what a key of ``user`` in ``tenant`` stores (files, batches): the user
    qualified by its tenant, ``tenant/user``, so the same user name in two tenants owns
    two things. A key of the default tenant (none, or the one named after its user) owns
    as ``user``, the name every record was stored under before tenants qualified it, so
    single-tenant data stays its own. Neither part holds '/' (``check_name``): an owner
    with one is a named tenant's user, one without the user of its own tenant."""
    if not tenant or tenant == user:
        return user
    return f"{tenant}{OWNER_SEPARATOR}{user}"


def is_end_user(user: str) -> bool:
    """Whether a scheduler's user is an end user of a trusted key (no key's own user holds
    the separator), the users whose state is forgotten once idle (``end_user_idle_s``)."""
    return END_USER_SEPARATOR in user


def check_name(value: str) -> str:
    """A user or tenant name of a key, else ValueError naming the separator it holds (a
    control character such as TAB separates the fields of stored entries, as in an end
    user's name from a request body, which must be printable too)."""
    held = [c for c in NAME_SEPARATORS if c in value]
    if held:
        raise ValueError(f"must not contain {' or '.join(map(repr, held))}: it separates "
                         "the parts of Redis key names")
    if not value.isprintable():
        raise ValueError("must be printable text, without control characters: TAB "
                         "separates the fields of stored entries")
    return value


class ApiKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str
    user: str
    tenant: str | None = None  # None: a tenant named after the user
    priority_class: str = DEFAULT_CLASS.name
    weight: float = Field(1.0, gt=0)
    trusted_end_users: bool = False
    limits: UsageLimits | None = None
    # the key's stable id (limits, usage); None: derived from the key (gateway/access/auth.py).
    # Keys created at runtime (POST /admin/keys) have theirs from the key store.
    id: str | None = None

    @property
    def tenant_name(self) -> str:
        return self.tenant or self.user

    @property
    def owner(self) -> str:
        """What this key's files and batches are stored under (:func:`owner_id`)."""
        return owner_id(self.user, self.tenant)

    @field_validator("priority_class")
    @classmethod
    def _known_class(cls, value: str) -> str:
        if value not in CLASS_ORDER:
            raise ValueError(f"priority_class must be one of {', '.join(CLASS_ORDER)}")
        return value


class ClassConfig(BaseModel):
    """A class's settings; a class named in the config starts from its row of the class
    table (``policies/classes.py``), the only place defaults are written."""

    model_config = ConfigDict(extra="forbid")

    # each bound below keeps the class servable: a negative max_waiting or queue wait,
    # or a TPOT or KV bound of 0, would leave every request of the class to time out
    max_waiting: int = Field(ge=0)
    max_tpot_ms: float = Field(gt=0)
    max_kv_usage: float | None = Field(gt=0, le=1)
    max_queue_wait_s: float = Field(gt=0)
    priority_base: int
    # default first-token deadline of the class's requests (X-Fairgate-Deadline-Ms wins)
    ttft_slo_ms: int | None = Field(gt=0)
    # uncached prompt tokens a backend may have pending (dispatched, not yet scheduled)
    # before it takes more of this class (policies/prefill.py); None: the backend's
    # max_num_batched_tokens × PREFILL_GATE_STEPS; 0: no limit
    max_waiting_prefill_tokens: int | None = Field(ge=0)
    # preemption (policies/preemption.py): its running requests may be preempted for a
    # higher class; its waiting requests may preempt after preempt_after_ms (None: never);
    # one request is preempted at most max_preemptions times
    preemptible: bool
    preempt_after_ms: int | None = Field(ge=0)
    max_preemptions: int = Field(ge=0, le=10)

    @classmethod
    def of(cls, spec: ClassSpec) -> ClassConfig:
        """The class table's row as settings."""
        return cls(**{f: getattr(spec, f) for f in cls.model_fields})

    def gate(self) -> GatePolicy:
        return GatePolicy(self.max_waiting, self.max_tpot_ms, self.max_kv_usage)

    def preempt_rule(self) -> PreemptRule:
        after_s = None if self.preempt_after_ms is None else self.preempt_after_ms / 1000.0
        return PreemptRule(self.preemptible, after_s, self.max_preemptions, self.max_kv_usage)

    def pacing_targets(self) -> PacingTargets:
        ttft_slo_s = None if self.ttft_slo_ms is None else self.ttft_slo_ms / 1000.0
        return PacingTargets(self.max_waiting, self.max_tpot_ms / 1000.0, ttft_slo_s)


def _default_classes() -> dict[str, ClassConfig]:
    return {c.name: ClassConfig.of(c) for c in CLASSES}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="FAIRGATE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    redis_url: str | None = None  # None → embedded Valkey server (or redis_sentinel)
    redis_sentinel: RedisSentinel | None = None  # the store behind Sentinel, not redis_url
    # a Redis Cluster instead of redis_url (gateway/storage/redis_client.py connect_cluster)
    redis_cluster: RedisCluster | None = None
    # with redis_sentinel or redis_cluster: how long queued clients (and newcomers) wait
    # for the store to come back (a failover: the master's down-after-milliseconds, or
    # the cluster-node-timeout, plus the promotion) before they get a 503; 0: at once, as
    # with a single Redis
    store_failover_wait_s: float = Field(10.0, ge=0)
    # a store that keeps its connections open but answers nothing (a frozen process, a
    # node cut off without a reset) fails each command after this long instead of holding
    # it forever: clients get the 503 of a store that is down, loops back off. Above the
    # dispatcher's 1 s blocking read (STORE_BLOCK_S); a timed-out command is not sent again
    redis_socket_timeout_s: float = Field(5.0, ge=2.0)
    data_dir: Path = Path(".fairgate")
    replica_id: str | None = None  # None → random per process
    listen: Listen = Listen()
    # `fairgate serve` processes on the listen port (gateway/runtime/workers.py); None: one per
    # core; 1: the gateway in the serving process itself
    workers: int | None = Field(None, ge=1)
    backends: list[Backend] = []
    adapters: list[Adapter] = []  # LoRA adapters on the backends' models (docs/adapters.md)
    # how often a backend with LoRA (vLLM's vllm:lora_requests_info gauge) has its
    # /v1/models read again by its scraper, for the adapters loaded or unloaded since
    adapter_refresh_s: float = Field(5.0, gt=0)
    # runtime adapters (``runtime: true``): an adapter the gateway loaded is not unloaded
    # for another within its minimum residency (no thrash): nine times its measured load,
    # at least 1 s (policies/adapters.residency_s), or adapter_min_residency_s when set; a
    # request for one resident nowhere waits at most adapter_load_wait_s for its load (a
    # 503 after; past a quarter of it, its adapter goes before those with more demand); a
    # load that failed is not tried again for adapter_load_retry_s (requests get its error
    # meanwhile)
    adapter_min_residency_s: float | None = Field(None, ge=0)
    adapter_load_wait_s: float = Field(60.0, gt=0)
    adapter_load_retry_s: float = Field(30.0, gt=0)
    # backends found by DNS names (a Kubernetes headless Service per pool), beside the
    # configured ones and those added with POST /admin/backends (docs/operations.md)
    discovery: list[Discovery] = []
    # how often each process reads the backends added at runtime (admin API, DNS) from
    # Redis: a new or removed one is in force everywhere within this time
    backends_refresh_s: float = Field(1.0, gt=0)
    api_keys: list[ApiKey] = []
    admin_keys: list[str] = []
    # a key's tenant not listed here: weight 1, no limits; a key naming no tenant belongs
    # to the tenant named after its user, weighing the key's weight unless listed
    # (policies/fairness.tenant_of), so configs without tenants schedule as before
    tenants: Tenants = {}
    # HMAC pepper of the API keys created at runtime (gateway/access/keyring.py);
    # set it (FAIRGATE_KEY_PEPPER) outside Redis in production. None: a random pepper
    # kept in Redis, shared by the replicas.
    key_pepper: SecretStr | None = None
    key_cache_s: float = Field(0.5, gt=0, le=1.0)  # runtime keys: local cache lifetime
    key_rotate_grace_s: float = Field(3600.0, ge=0)  # old secret valid this long by default
    quota_lease_s: float = Field(30.0, gt=0)  # a concurrency slot expires unless renewed
    usage_retention_days: int = Field(400, ge=1)  # daily usage records kept in Redis
    # A trusted key's end user idle this long (nothing queued or in flight) has its
    # fairness state forgotten; it returns as a new user (docs/scheduling.md). A day:
    # Redis holds only the end users of the last day, and no one waits a day for a reset.
    end_user_idle_s: float = Field(86400.0, gt=0)
    classes: dict[str, ClassConfig] = Field(default_factory=_default_classes)
    fairness: str = "vtc"
    # Fair share per model ("model": each model's queues count only their own service) or
    # across the fleet ("fleet": a tenant's and a user's service counters span every
    # model, each model's charges multiplied by its cost factor), docs/scheduling.md
    # "Fair share across models". Needs one Redis (or Sentinel), not a Redis Cluster.
    fairness_scope: Literal["model", "fleet"] = "model"
    # fleet scope: what a model's service counts for against the others' (relative
    # GPU-seconds per token, say: 8 for a 70B model beside 8B ones at 1); a model not
    # listed counts 1.0; no effect in model scope. Read per request (a reload applies it).
    cost_factors: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = {}
    # Sessions, a third fairness level (tenant -> user -> session, docs/scheduling.md):
    # within a user, its sessions (X-Fairgate-Session, or a Responses API conversation;
    # requests without one form its default session) share its service fairly; its share
    # against other users is unchanged. Off: one queue per user, as before.
    sessions: bool = False
    vtc_input_weight: float = 1.0
    vtc_output_weight: float = 2.0
    # VTC's optional KV-occupancy term: cost per token-second of KV cache a request held
    # (its prompt for as long as it ran, its output half of that; policies/cost.py
    # kv_token_seconds), charged at settle; 0: off
    vtc_kv_weight: float = Field(0.0, ge=0)
    priority_class_gap: int = 1000
    # Starvation protection (policies/starvation.py): a class backlogged this long is owed
    # its floor share of the last `starvation_window` dispatches.
    starvation_after_s: float = 30.0
    class_floors: dict[str, float] = Field(default_factory=default_floors)
    starvation_window: int = 100

    # One process scrapes each backend (a lease in Redis, gateway/backends/scrape.py) every
    # `scrape_interval_s` while it is busy or work is queued for its model, every
    # `idle_scrape_interval_s` while idle (never more than half of `snapshot_stale_s`, so
    # an idle backend's snapshot stays fresh); the next enqueue brings it back at once.
    scrape_interval_s: float = Field(0.1, gt=0)
    idle_scrape_interval_s: float = Field(0.5, gt=0)
    scrape_timeout_s: float = 1.0
    # a request that finds no healthy backend of its model before each was scraped (or
    # failed) once, right after the start, waits for that at most this long (then 503)
    first_scrape_wait_s: float = Field(5.0, ge=0)
    snapshot_stale_s: float = 1.0
    # Scale from zero: a request whose pool has no healthy backend stays queued this long
    # for one to become ready (a backend started on demand, docs/autoscaling.md) before its
    # 503; 0: the 503 at once
    cold_start_wait_s: float = Field(0.0, ge=0)
    autoscale: Autoscale = Autoscale()
    unhealthy_after_failures: int = 3
    tpot_window_s: float = 5.0
    # "adaptive": each class's max_waiting is the ceiling of an allowance tuned per backend
    # from its TPOT, TTFT and batch room (policies/pacing.py); "fixed": max_waiting as is
    pacing: Literal["adaptive", "fixed"] = "adaptive"
    # Where work goes (policies/locality.py). "least_loaded": backends least loaded first,
    # each takes requests in strict fairness order. "locality": each backend's prefix
    # index (Redis) records what it was sent, and among the users within `locality_slack`
    # (service units: VTC tokens, or requests under round_robin) of the least-served one,
    # the head whose prompt prefix is best cached there goes first; 0 = strict order. The
    # fairness bound grows by the slack (policies/fairness.py). "auto" (the default):
    # locality for a model with two or more backends, least_loaded for one (nothing to
    # choose; policies/locality.py routing_for).
    routing: Literal["auto", "least_loaded", "locality"] = "auto"
    locality_slack: float = Field(4096.0, ge=0)
    locality_candidates: int = Field(8, ge=1, le=64)  # users compared within the slack
    prefix_index_size: int = Field(8192, ge=1)  # block hashes kept per backend (≈ 64 tokens each)
    prefix_index_ttl_s: float = Field(600.0, gt=0)  # a hash not sent again this long is dropped
    # a request whose prefix another backend holds waits for that one unless it has more
    # than this many requests in flight beyond the backend with room (bounded load)
    locality_max_imbalance: int = Field(4, ge=0)
    # a request the prefill-token gate holds (policies/prefill.py) may be passed by smaller
    # ones that fit for this long; then its backend takes no more of the class until the
    # request gets in (0: it blocks its class at once)
    prefill_backfill_s: float = Field(1.0, ge=0)

    # Client connections (gateway/http/server.py): a cap with a clear 503, and a deadline for
    # a connection to complete a request's headers (also closes idle keep-alives) or for
    # a body to keep arriving (gateway/http/client_guard.py), then at least this rate.
    max_client_connections: int = Field(10000, ge=1)
    client_idle_timeout_s: float = Field(30.0, gt=0)
    min_body_bytes_per_s: int = Field(1024, ge=0)
    # connections on which no request authenticated yet; None: half the cap
    max_unauthenticated_connections: int | None = Field(None, ge=1)
    session_ttl_s: float = Field(12 * 3600, gt=0)  # a dashboard login lasts this long
    # a client address that failed this many dashboard logins within the window (opened
    # at its first failure) gets 429 too_many_login_failures until the window ends
    login_max_failures: int = Field(10, ge=1)
    login_failure_window_s: float = Field(60.0, gt=0)
    metrics_auth: bool = False  # true: GET /metrics needs an admin key (Bearer)
    # the Grafana dashboard (deploy/grafana/dashboards/fairgate.json) as operators reach
    # it: the live dashboard links to it (None: no link)
    grafana_url: str | None = None
    # a streamed request sent with X-Fairgate-Queue-Status: 1 gets its 200 at once and an
    # SSE comment with its place in the queue this often (gateway/http/queue_status.py)
    queue_status_interval_s: float = Field(1.0, gt=0)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1)
    # /tokenize and /detokenize (not queued): their own body limit, and how many of one
    # user's may be at the backends at once on a replica (beyond: 429)
    max_unqueued_body_bytes: int = Field(1024 * 1024, ge=1)
    max_unqueued_per_user: int = Field(4, ge=1)
    max_queued_per_user: int = Field(1000, ge=1)
    upstream_timeout_s: float = 600.0  # the backend sends nothing for this long → 502
    max_request_s: float = Field(3600.0, gt=0)  # one answer, streamed or not, at most
    # a stream under way that brings no whole frame for this long is cut: continued
    # elsewhere when it can be, else ended with an error event (bytes trickled in do not
    # count: they reset aiohttp's sock_read timer, so upstream_timeout_s never fires)
    stream_idle_timeout_s: float = Field(60.0, gt=0)
    upstream_keepalive_s: float = 4.0  # below uvicorn's 5 s idle close (vLLM's server)
    # A chat or completion whose backend fails mid-answer (connection reset, an error
    # event, a broken frame) continues on another backend of its model from the tokens
    # generated so far (gateway/proxy/continuation.py), at most this many times (0: the
    # stream ends with an error event, as before); each continuation waits in the
    # scheduler at most `continue_wait_s`.
    continue_attempts: int = Field(2, ge=0, le=10)
    continue_wait_s: float = Field(60.0, gt=0)
    # Preemption for fairness (policies/preemption.py, docs/scheduling.md): a request of a
    # higher class that waited its class's preempt_after_ms while the model's backends are
    # full takes the slot of a running request of a preemptible lower class, which
    # continues later from its token ids. false: never.
    preemption: bool = True
    # also within a preemptible class: a waiting user whose fairness score is this far
    # (service units) below a running user's may take its slot; None: only across classes
    preempt_fair_gap: float | None = Field(None, gt=0)
    # A running answer moved on purpose (a drain with migrate, preemption) continues the
    # same way; one request is moved at most this many times (its own budget, apart from
    # `continue_attempts`; 0: nothing is ever moved).
    max_moves: int = Field(4, ge=0, le=100)
    replica_heartbeat_s: float = 1.0
    # A replica silent this long is dead: its queued requests are dropped and what it
    # held in flight is released (sooner when it leaves a grant unread for 2 s). Three
    # heartbeats: a killed replica's slots must not hold the survivors' gates for long.
    replica_ttl_s: float = 3.0
    # A Redis outage: "fail_closed" answers queued and new requests 503 until it is back;
    # "local" keeps serving each replica's own clients from its own fair queues, pacing each
    # backend with its share of the gate (gateway/scheduling/local.py, docs/reliability.md)
    store_outage: Literal["fail_closed", "local"] = "fail_closed"
    retry_after_s: int = 1

    # Batch API
    max_file_bytes: int = 200 * 1024 * 1024
    batch_max_in_flight: int = 64  # lines of one batch queued or running at once
    batch_lease_s: float = 10.0  # a runner silent this long loses its batch to another
    batch_poll_s: float = 1.0

    metrics_top_users: int = Field(20, ge=0)  # per-user series: this many users, rest "other"
    metrics_user_idle_s: float = 3600.0  # an idle user's series give way to an active one
    config_file: Path | None = None  # the YAML this was loaded from (POST /admin/reload)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # `fairgate serve`'s event loop: uvloop when installed (extra `fast`), else asyncio's
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    # above this many per-request info lines a second, keep about this many (whole
    # requests); errors and rejections always logged. None: every line (gateway/core/logs.py)
    log_sample_above_per_s: float | None = Field(None, gt=0)

    # Hostile input: bounds on what one client may send, each refused with a clear 400
    # (413 for the file quota) instead of reaching Redis, the metrics or vLLM.
    max_json_depth: int = Field(64, ge=2)  # nesting of a request body or batch line body
    max_output_tokens: int = Field(131072, ge=1)  # max_tokens / max_completion_tokens
    max_end_user_chars: int = Field(256, ge=1)  # body field `user`, printable text only
    max_files_bytes_per_user: int = Field(2 * 1024**3, ge=0)  # all of a user's files → 413

    @field_validator("redis_url", mode="before")
    @classmethod
    def _empty_url_is_none(cls, value: Any) -> Any:
        return None if value == "" else value  # FAIRGATE_REDIS_URL="" unsets a file's

    @model_validator(mode="after")
    def _names_without_separators(self) -> Settings:
        """The config's names (a key's are checked here, not by :class:`ApiKey`, which
        also holds names read back from Redis and batch records)."""
        named = [(f"api_keys.{i}.{field}", getattr(key, field))
                 for i, key in enumerate(self.api_keys) for field in ("user", "tenant")]
        named += [(f"tenants.{name}", name) for name in self.tenants]
        for where, name in named:
            if name is not None:
                try:
                    check_name(name)
                except ValueError as exc:
                    raise ValueError(f"{where}: {name!r} {exc}") from None
        return self

    @model_validator(mode="after")
    def _backends_named_once(self) -> Settings:
        """Each configured backend by a safe name of its own (a second of one name was
        dropped, unsaid)."""
        first: dict[str, int] = {}
        for i, backend in enumerate(self.backends):
            where = f"backends.{i}.name"
            try:
                check_backend_name(backend.name)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if backend.name in first:
                raise ValueError(f"{where}: {backend.name!r} is also the name of "
                                 f"backends.{first[backend.name]}: a name is one backend")
            first[backend.name] = i
        return self

    @model_validator(mode="after")
    def _one_key_per_secret(self) -> Settings:
        """A secret (and a key's id) names one key: a second of the same was kept in
        place of the first, so one of the two users was served as the other."""
        secrets: dict[str, int] = {}
        ids: dict[str, int] = {}
        for i, key in enumerate(self.api_keys):
            if key.key in secrets:
                raise ValueError(f"api_keys.{i}.key: the same secret as "
                                 f"api_keys.{secrets[key.key]}: one secret is one key")
            secrets[key.key] = i
            if key.id is not None and key.id in ids:
                raise ValueError(f"api_keys.{i}.id: {key.id!r} is also the id of "
                                 f"api_keys.{ids[key.id]}")
            if key.id is not None:
                ids[key.id] = i
        return self

    @model_validator(mode="after")
    def _adapters_on_models(self) -> Settings:
        models, seen = set(self.models()), set()
        for i, adapter in enumerate(self.adapters):
            where = f"adapters.{i}"
            if adapter.base_model not in models:
                raise ValueError(f"{where}: base_model {adapter.base_model!r} is not a "
                                 f"served model ({', '.join(sorted(models)) or 'none'})")
            if adapter.name in models or adapter.name in seen:
                raise ValueError(f"{where}: the name {adapter.name!r} is taken")
            seen.add(adapter.name)
        return self

    @model_validator(mode="after")
    def _cost_factors_of_models(self) -> Settings:
        models = set(self.models())
        adapters = {a.name: a.base_model for a in self.adapters}
        for name in self.cost_factors:
            if name in adapters:
                raise ValueError(f"cost_factors: {name!r} is an adapter: its requests count "
                                 f"at its base model's factor ({adapters[name]!r})")
            if name not in models:
                raise ValueError(f"cost_factors: {name!r} is not a served model "
                                 f"({', '.join(sorted(models)) or 'none'})")
        if self.fairness_scope == "fleet" and self.redis_cluster is not None:
            raise ValueError("fairness_scope fleet needs one Redis (redis_url or "
                             "redis_sentinel): its counters span models, whose keys a Redis "
                             "Cluster keeps in separate slots")
        return self

    def cost_factor(self, model: str) -> float:
        """What one unit of the model's service counts for in a fair-share counter: its
        ``cost_factors`` entry (1.0 when absent) in fleet scope, 1.0 in model scope."""
        if self.fairness_scope != "fleet":
            return 1.0
        return factor_of(self.cost_factors, model)

    def fleet_models(self) -> list[str]:
        """The models whose fair-share counters are one (fleet scope: every model served;
        model scope: none)."""
        return self.models() if self.fairness_scope == "fleet" else []

    @model_validator(mode="after")
    def _one_store(self) -> Settings:
        stores = [name for name, value in (("redis_url", self.redis_url),
                                           ("redis_sentinel", self.redis_sentinel),
                                           ("redis_cluster", self.redis_cluster))
                  if value is not None]
        if len(stores) > 1:
            raise ValueError(f"set one of redis_url, redis_sentinel and redis_cluster, not "
                             f"{' and '.join(stores)}")
        return self

    def embedded_store(self) -> bool:
        """No store configured: the process runs an embedded Valkey server."""
        return (self.redis_url is None and self.redis_sentinel is None
                and self.redis_cluster is None)

    def failover_wait_s(self) -> float:
        """How long a client waits through a store outage: a Sentinel failover's or a
        cluster shard's bound; 0 with a single Redis (its outage answers 503 at once)."""
        failover = self.redis_sentinel is not None or self.redis_cluster is not None
        return self.store_failover_wait_s if failover else 0.0

    @field_validator("fairness")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"fairness must be one of {', '.join(POLICIES)}")
        return value

    @field_validator("classes", mode="before")
    @classmethod
    def _merge_class_defaults(cls, value: Any) -> Any:
        """A partial class entry overrides only the fields it names."""
        if not isinstance(value, dict):
            return value
        unknown = set(value) - set(CLASS_ORDER)
        if unknown:
            raise ValueError(f"unknown priority classes: {sorted(unknown)}")
        merged = {name: cfg.model_dump() for name, cfg in _default_classes().items()}
        for name, given in value.items():
            given = given.model_dump(exclude_unset=True) if isinstance(given, BaseModel) else given
            merged[name].update(given or {})
        return merged

    def models(self) -> list[str]:
        """The models served: those of the configured backends and of the discovery
        names (a backend added at runtime serves one of these)."""
        return sorted({b.model for b in self.backends} | {d.model for d in self.discovery})

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # a YAML file, when load_settings names one, ranks below the environment
        if settings_cls.model_config.get("yaml_file"):
            return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls))
        return (init_settings, env_settings)


def load_settings(config_path: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from a YAML file (or ``FAIRGATE_CONFIG``), env and overrides."""
    path = config_path or os.environ.get("FAIRGATE_CONFIG")
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"config file not found: {path}")

    class _FromFile(Settings):
        model_config = SettingsConfigDict(yaml_file=path)

    if path is not None:
        overrides.setdefault("config_file", Path(path))
    return _FromFile(**overrides)


class SettingsHolder:
    """The settings in force: the one object every collaborator reads (``.current``).

    Built once in the composition root (``gateway/services.py``); a reload
    (``gateway/http/admin/reload.py``) swaps it once, and the collaborators that derive state from
    the settings (gate policies, the starvation floors, …) re-derive it in ``on_swap``.
    """

    __slots__ = ("_derive", "current")

    def __init__(self, settings: Settings) -> None:
        self.current = settings
        self._derive: list[Callable[[Settings], None]] = []

    def on_swap(self, derive: Callable[[Settings], None]) -> None:
        """Run ``derive`` with the new settings after every swap."""
        self._derive.append(derive)

    def swap(self, new: Settings) -> None:
        self.current = new
        for derive in self._derive:
            derive(new)


class ReadsSettings:
    """A collaborator's ``self.settings``: always the holder's current settings, never a
    copy of its own."""

    holder: SettingsHolder

    @property
    def settings(self) -> Settings:
        return self.holder.current
