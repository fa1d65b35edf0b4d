"""The values the store's concern classes take and return: a queued request, a grant,
a start, what a dispatch decided, a backend's state and scrape view, a preemption order, the
read models' rows. Plain frozen dataclasses, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from policies.fairness import predicted_cost
from policies.gates import BackendSnapshot
from policies.prefill import PromptRange


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    request_id: str
    user: str
    klass: str
    owner: str
    cost: float  # the fairness policy's dispatch cost, at the user level
    enqueued_at: float
    prefix: tuple[str, ...] = ()  # the prompt's block-hash chain (policies/locality.py)
    tenant: str = ""  # "": the tenant named after the user
    tenant_cost: float | None = None  # the dispatch cost at the tenant level (None: cost)
    deadline_at: float | None = None  # first-token deadline (unix s): EDF in its user's queue
    prompt_tokens: int = 0  # estimated: where it fits, and the prefill-token gate
    whole: bool = False  # a whole answer (not streamed): it never reports a first token
    session: str | None = None  # sessions on: its session ("" the user's default); None: off
    adapter: str | None = None  # the LoRA adapter it names: only backends having it take it
    # taken off cost (tenant_cost) per prompt token the backend's prefix index predicts
    # cached (the policy's cached_credit; kept only with a prefix chain)
    credit: float = 0.0
    tenant_credit: float | None = None  # None: credit
    # a continuation: the (request id, backend) of the segment it continues, which leaves
    # that backend as it is queued (leave_inflight in lua/lib/inflight.lua)
    leaves: tuple[str, str] | None = None

    @property
    def tenant_name(self) -> str:
        return self.tenant or self.user

    @property
    def tenant_charge(self) -> float:
        return self.cost if self.tenant_cost is None else self.tenant_cost

    @property
    def tenant_hit(self) -> float:
        return self.credit if self.tenant_credit is None else self.tenant_credit

    def charged(self, charged_prompt: int | None) -> tuple[float, float]:
        """(user-level, tenant-level) dispatch cost charged when its grant charged
        ``charged_prompt`` prompt tokens (None: the whole estimate)."""
        if charged_prompt is None or not self.prefix:
            return self.cost, self.tenant_charge
        return (predicted_cost(self.cost, self.credit, self.prompt_tokens, charged_prompt),
                predicted_cost(self.tenant_charge, self.tenant_hit, self.prompt_tokens,
                               charged_prompt))


@dataclass(frozen=True, slots=True)
class Who:
    """A user's tenant ("": its own) and weights, as the share ratio reads them (the
    ``service:who`` hash, a JSON array per user)."""

    tenant: str = ""
    weight: float = 1.0
    tenant_weight: float = 1.0

    def encode(self) -> str:
        return json.dumps([self.tenant, self.weight, self.tenant_weight])

    @classmethod
    def decode(cls, text: str | None) -> Who:
        """An entry; a missing or unreadable one (a user served by an older replica)
        reads as weight 1 in its own tenant."""
        try:
            tenant, weight, tenant_weight = json.loads(text or "")
            return cls(str(tenant), float(weight), float(tenant_weight))
        except (ValueError, TypeError):
            return cls()


@dataclass(frozen=True, slots=True)
class Grant:
    request_id: str
    klass: str
    user: str
    rank: int
    owner: str
    backend: str
    enqueued_at: float
    # known where it was dispatched (dispatch.lua), not on a grant read back from Redis:
    matched_blocks: int = 0  # leading blocks of its chain the backend's prefix index held
    prompt_blocks: int = 0  # blocks of its chain (0: no index, routing least_loaded)
    reason: str = "load"  # why it went there: policies.locality.DISPATCH_REASONS
    local: bool = False  # granted by this replica alone while the store was unreachable
    # the prompt tokens its dispatch cost charged (predicted uncached there); None: the
    # whole estimate (granted by this replica alone)
    charged_prompt: int | None = None


@dataclass(frozen=True, slots=True)
class Start:
    """A request's first token on ``backend`` at ``at`` (unix s), as the scripts mark it
    (``start_each`` in ``lua/lib/inflight.lua``)."""

    request_id: str
    backend: str
    at: float


@dataclass(frozen=True, slots=True)
class Locality:
    """Locality-aware dispatch (``routing: locality``): the fairness slack (service
    units), how many users within it are compared, the bounds of each backend's prefix
    index (block hashes kept, seconds an unused hash lives), and the bounded-load
    affinity (the model's backends, the in-flight imbalance a request waits out)."""

    slack: float
    candidates: int
    index_size: int
    index_ttl_s: float
    max_imbalance: int = 0  # a head whose prefix another backend holds waits for it unless
    others: tuple[str, ...] = ()  # that one has more in flight than this one + this
    lookahead: int = 4  # requests of each user's queue compared (its oldest first)
    # what each of the others takes (its prompt range, its adapters): a request is never
    # left to one that does not take it (one not listed takes any)
    fits: Mapping[str, BackendFit] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BackendFit:
    """What one backend takes, for dispatch.lua (``policies/prefill.py``): its prompt
    range and each class's prefill-token limit (0: none)."""

    prompt_range: PromptRange = field(default_factory=PromptRange)
    prefill_limits: Mapping[str, int] = field(default_factory=dict)
    backfill_s: float = 0.0  # smaller requests may pass one the gate holds this long
    # the LoRA adapters it has (docs/adapters.md); None: its model has none anywhere, so
    # no request names one
    adapters: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class BackendState:
    snapshot: BackendSnapshot | None
    sent_since_snapshot: int
    inflight: int
    unseen: int  # on the way at the snapshot, not yet registered by the server
    pending_prefill_tokens: int = 0  # dispatched, maybe not yet scheduled (uncached tokens)
    started_since_snapshot: int = 0  # first token since the snapshot: in a slot it saw free


class Stored(NamedTuple):
    """What storing a snapshot did (``lua/snapshot.lua``)."""

    stored: bool  # False: an equal or newer snapshot was there
    drained: bool  # an operator drained the backend
    pending: int  # its pending prefill tokens after the trim (0 when not stored)
    version: str  # the snapshot hash's version after it ("0" when not stored)


@dataclass(frozen=True, slots=True)
class LeaseWish:
    """A backend's scrape lease as one process wants it: held (taken or renewed) or given
    up, and the version of its published snapshot the process read last."""

    backend: str
    want: bool
    seen: str = ""


@dataclass(frozen=True, slots=True)
class ScrapeView:
    """One backend as ``lua/scrapers.lua`` saw it for one process."""

    held: bool  # this process holds the scrape lease now
    drained: bool
    inflight: int  # dispatched, unsettled requests at it (all replicas)
    pending_prefill_tokens: int
    published: dict[str, str] | None  # the snapshot hash, when changed since ``seen``
    dispatches: int = 0  # requests ever dispatched to it, by every replica


# A replica's grant listener waits on its grant list all the time: a grant unread this long
# means the replica died (scripts: replica_alive in gateway/storage/lua/_lib.lua).
GRANT_PICKUP_S = 2.0


@dataclass(frozen=True, slots=True)
class Preempt:
    """An order to preempt a running stream: its segment's id (a continuation's, or the
    original's), the original request's id, the backend it runs on."""

    request_id: str
    original: str
    backend: str


@dataclass(frozen=True, slots=True)
class PreemptView:
    """What ``lua/preempt_view.lua`` read: each backlogged class's next request, and the
    dispatched requests of the live replicas (plain dicts, its JSON)."""

    queued: list[dict[str, Any]]
    inflight: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Dispatched:
    """What a dispatch decision (``dispatch_for`` in ``lua/lib/dispatch.lua``) returned,
    whichever script ran it: the grants, the requests still queued for the model, and the
    class service picture ``policies/starvation.py`` reads."""

    grants: list[Grant]
    depth: int
    backlogged_since: dict[str, float]
    recent: list[str]
    backend: str = ""  # the backend decided for
    # the decision's gates came from a snapshot older than the one before the stored one:
    # it admitted nothing (its process is behind the backend's snapshots)
    stale_view: bool = False


@dataclass(frozen=True, slots=True)
class QueuedUser:
    klass: str
    user: str
    score: float
    queued: int
    oldest_request_id: str | None
    oldest_enqueued_at: float | None
    tenant: str = ""  # "": the tenant named after the user (score: the tenant's)


@dataclass(frozen=True, slots=True)
class QueuedSample:
    """One queued request as the pools' demand reads it (``gateway/ops/pools.py``)."""

    klass: str
    prompt_tokens: int  # estimated
    enqueued_at: float
    deadline_at: float | None  # its first-token deadline (unix s), if it has one


def grant_from(request_id: str, raw: Mapping[str, str]) -> Grant:
    charged = raw.get("ctok")
    return Grant(request_id, raw["class"], raw["user"], int(raw["rank"]), raw["owner"],
                 raw["backend"], float(raw["enqueued_at"]),
                 charged_prompt=None if charged is None else int(charged))


def snapshot_from(raw: Mapping[str, str]) -> BackendSnapshot | None:
    """A snapshot hash's numbers (None: no scrape of the backend ever succeeded)."""
    if "taken_at" not in raw:
        return None
    tpot = raw.get("tpot", "")
    return BackendSnapshot(
        waiting=int(float(raw["waiting"])),
        running=int(float(raw["running"])),
        kv_usage=float(raw["kv"]),
        tpot_s=float(tpot) if tpot else None,
        taken_at_s=float(raw["taken_at"]),
    )

