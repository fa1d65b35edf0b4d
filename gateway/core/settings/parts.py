"""The settings' parts that are values of their own: a backend, an adapter, a key, a
tenant, a class, the Redis topologies, autoscaling (lists and tables of the config)."""

from __future__ import annotations

import json
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
    NoDecode,
)

from gateway.core.backend_names import BackendUrl
from policies.classes import CLASS_ORDER, CLASSES, DEFAULT_CLASS, ClassSpec
from policies.gates import GatePolicy
from policies.pacing import PacingTargets
from policies.preemption import PreemptRule
from policies.prefill import PromptRange


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
    # higher class (preemptible), or for a user of the class below its fair share
    # (fair_preemption: false turns that off for the class); its waiting requests may
    # preempt after preempt_after_ms (None: never); one request is preempted at most
    # max_preemptions times, and never before it generated preempt_grace_tokens
    preemptible: bool
    preempt_after_ms: int | None = Field(ge=0)
    max_preemptions: int = Field(ge=0, le=10)
    fair_preemption: bool
    preempt_grace_tokens: int = Field(ge=0)

    @classmethod
    def of(cls, spec: ClassSpec) -> ClassConfig:
        """The class table's row as settings."""
        return cls(**{f: getattr(spec, f) for f in cls.model_fields})

    def gate(self) -> GatePolicy:
        return GatePolicy(self.max_waiting, self.max_tpot_ms, self.max_kv_usage)

    def preempt_rule(self) -> PreemptRule:
        after_s = None if self.preempt_after_ms is None else self.preempt_after_ms / 1000.0
        return PreemptRule(self.preemptible, after_s, self.max_preemptions, self.max_kv_usage,
                           self.fair_preemption, self.preempt_grace_tokens)

    def pacing_targets(self) -> PacingTargets:
        ttft_slo_s = None if self.ttft_slo_ms is None else self.ttft_slo_ms / 1000.0
        return PacingTargets(self.max_waiting, self.max_tpot_ms / 1000.0, ttft_slo_s)


def default_classes() -> dict[str, ClassConfig]:
    return {c.name: ClassConfig.of(c) for c in CLASSES}


