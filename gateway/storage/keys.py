"""Every Redis key fairgate uses, built in this module and nowhere else.

Per-model keys share the hash tag ``{model}`` (prefix ``fg:{model}:``), so a pool's keys
live in one Redis Cluster slot and the multi-key Lua scripts stay legal. A script that
must reach a key named by data it reads (a user's queue, a request, a replica's grant
list) builds it with the functions of :func:`lua_prelude`, generated from the patterns
below, from the model prefix passed in ARGV. The schema, with each key's type, writer and
lifetime, is in ``docs/redis-schema.md``.

Every other key that a script or a MULTI changes together with another shares a hash
tag too, so on a Redis Cluster each script call and each transaction stays in one slot:
a model's usage hash is under the model's tag, batch records under ``{batches}``, file
records under ``{files}``, runtime API keys under ``{keys}``, a tenant's limit counters
under ``{q:<tenant>}``. ``tests/store/test_cluster_slots.py`` checks every call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "fg"

# Keys under a model's prefix, by name: the pattern after ``fg:{model}:``.
MODEL_PATTERNS: dict[str, str] = {
    "queue": "q:{klass}:{tenant}:{user}",  # list: one user's queued request ids (FIFO)
    "active": "active:{klass}",           # zset: tenant -> tenant score, tenants with a queue
    "saved": "saved:{klass}",             # hash: tenant -> tenant score kept while idle
    "users": "users:{klass}:{tenant}",    # zset: user -> user score, a tenant's queued users
    "user_saved": "usaved:{klass}:{tenant}",  # hash: user -> user score kept while idle
    "user_floor": "ufloor:{klass}",       # hash: tenant -> user score its last user left at
    # sessions on (the third level): a user's queued sessions and their queues; the
    # default session ("") queues in the user's own queue above
    "sessions": "sess:{klass}:{tenant}:{user}",  # zset: session -> session score, queued ones
    "session_saved": "ssaved:{klass}:{tenant}:{user}",  # hash: session -> score kept while idle
    "session_queue": "sq:{klass}:{tenant}:{user}:{session}",  # list: one session's queued ids
    "user_queued": "uq:{klass}:{tenant}:{user}",  # string: requests queued in a user's sessions
    "request": "req:{request_id}",        # hash: one request's state (TTL)
    "depth": "depth",                     # hash: class -> queued requests
    "backlogged_since": "since",          # hash: class -> when its queue became non-empty
    "recent": "recent",                   # list: classes of the latest dispatches
    "recent_tenants": "rtenants",         # list: tenants of the latest dispatches (min_share)
    "drained": "drained",                 # set: backends no replica may dispatch to
    "migrate": "migrate",                 # hash: drained backend -> when its answers move
    "user_inflight": "inflight",          # hash: user -> dispatched, unsettled requests
    "replicas": "replicas",               # zset: replica -> last heartbeat (unix s)
    "scrapers": "scrapers",               # zset: scraping process -> its last lease tick (ms)
    "listened": "listened",               # hash: replica -> its grant listener's last turn
    "grants": "grants:{replica}",         # list: grants for requests a replica holds
    "running": "running:{replica}",       # set: dispatched ids whose client a replica holds
    "preempts": "preempts:{replica}",     # list: preemption orders for streams a replica holds
    "backend_sent": "bk:{backend}:sent",  # zset: id -> dispatch time, no first token yet
    "backend_started": "bk:{backend}:started",  # zset: id -> first token, since a snapshot
    "backend_snapshot": "bk:{backend}:snap",  # hash: last /metrics snapshot + "unseen"
    "backend_scraper": "bk:{backend}:scraper",  # string: the process scraping it (PX lease)
    "backend_inflight": "bk:{backend}:inflight",  # string: dispatched, unsettled requests
    "backend_dispatches": "bk:{backend}:dispatches",  # string: requests ever dispatched there
    "backend_prefixes": "bk:{backend}:prefixes",  # zset: prompt block hash -> last sent (LRU)
    "backend_prefill": "bk:{backend}:prefill",  # hash: id -> "tokens dispatched_at", unscheduled
    "backend_lora": "bk:{backend}:lora",  # hash: adapter -> "loaded_at load_s" (the gateway's)
    "lora_loading": "lora:loading",       # string: the process loading an adapter (PX lease)
    "lora_load": "lora:{adapter}:load",   # string: JSON outcome of the adapter's last load (TTL)
    "lora_demand": "lora:demand",         # hash: replica -> JSON requests waiting per adapter
    "backend_preempt": "bk:{backend}:preempt",  # string: when its last preemption was ordered
    "service": "service",                 # zset: user -> forward-decayed service, all replicas
    "service_epoch": "service:epoch",     # string: the unix time the service scores are scaled to
    "service_who": "service:who",         # hash: user -> JSON [tenant, weight, tenant weight]
    "usage": "usage:{day}",               # hash: usage row -> count, one UTC day (YYYYMMDD)
    "seen": "seen",                       # zset: end user (values.SEEN) -> last activity
}

# Batch records and their indexes: one hash tag, so a batch is created (record, its
# user's list, the active set) in one MULTI on a Redis Cluster too.
BATCHES_TAG = f"{ROOT}:{{batches}}:"
BATCH_PREFIX = BATCHES_TAG + "batch:"     # hash …batch:<id>; :out, :err hashes; :lease
USER_BATCHES_PREFIX = BATCHES_TAG + "user:"  # zset …user:<user>: batch id -> created
ACTIVE_BATCHES = BATCHES_TAG + "active"   # set: unfinished batch ids
# File records and their per-user index, likewise one hash tag.
FILES_TAG = f"{ROOT}:{{files}}:"
FILE_PREFIX = FILES_TAG + "file:"         # string …file:<id>: JSON metadata
USER_FILES_PREFIX = FILES_TAG + "user:"   # zset …user:<owner>: file id -> created
USER_FILE_BYTES_PREFIX = FILES_TAG + "bytes:"  # string …bytes:<owner>: bytes stored + reserved
SESSION_PREFIX = f"{ROOT}:session:"       # string fg:session:{sha256(token)}: admin key id
# The dashboard's last 15 minutes, one hash per interval, added to by every process
# (gateway/ops/history.py); one hash tag: small, written once per interval per process.
HISTORY_PREFIX = f"{ROOT}:{{history}}:"   # hash …:<unix ms of the interval's start> (TTL)
HISTORY_INDEX = HISTORY_PREFIX + "index"  # zset: bucket hash -> its start (unix ms)


def history_key(start_ms: int) -> str:
    return f"{HISTORY_PREFIX}{start_ms}"

# API keys created at runtime (gateway/access/keyring.py): one hash tag, so a key's records
# change in one MULTI/Lua call on a Redis Cluster too. Secrets only as HMAC digests.
KEYRING_PREFIX = f"{ROOT}:{{keys}}:"
KEY_IDS = KEYRING_PREFIX + "ids"          # zset: key id -> created (unix s)
KEY_PEPPER = KEYRING_PREFIX + "pepper"    # string: the HMAC pepper when none is configured
# Keys under the keyring's prefix that the key scripts derive from what they read (a
# record's digests, a digest's key id): the pattern after ``fg:{keys}:``.
KEYRING_PATTERNS: dict[str, str] = {
    "keyring_record": "id:{key_id}",      # hash: one runtime key
    "keyring_digest": "hash:{digest}",    # string: HMAC digest of a secret -> key id
}
# Backends added at runtime (POST /admin/backends, DNS discovery; gateway/backends/registry.py):
# one hash for every model, each change one compare-and-swap of a field.
RUNTIME_BACKENDS = f"{ROOT}:{{backends}}:runtime"  # hash: backend name -> JSON entry
# Usage is kept per model (``fg:{model}:usage:<day>``, written by settle.lua with the
# model's other keys); this set names the models the export reads.
USAGE_MODELS = f"{ROOT}:usage:models"     # set: models whose usage may be kept


def _one_field(pattern: str) -> str | None:
    fields = re.findall(r"{(\w+)}", pattern)
    return fields[0] if len(fields) == 1 else None


# The keys of one part at most that ModelKeys built, by (model, name, part).
_ONE_FIELD = {name: _one_field(p) for name, p in MODEL_PATTERNS.items()
              if len(re.findall(r"{(\w+)}", p)) <= 1}
_BUILT: dict[tuple[str, str, str], str] = {}
_BUILT_MAX = 4096
_REQUEST_HEAD, _request_tail = MODEL_PATTERNS["request"].split("{request_id}")
assert not _request_tail, "a request key ends with its id"


@dataclass(frozen=True, slots=True)
class ModelKeys:
    model: str

    @property
    def prefix(self) -> str:
        return f"{ROOT}:{{{self.model}}}:"

    def _key(self, name: str, **parts: str) -> str:
        return self.prefix + MODEL_PATTERNS[name].format(**parts)

    def _one(self, name: str, part: str = "") -> str:
        """A key of one part at most (a backend, a class, a replica), built once: every
        call to the store names several of them."""
        at = (self.model, name, part)
        found = _BUILT.get(at)
        if found is None:
            if len(_BUILT) >= _BUILT_MAX:  # names come and go (backends, replicas)
                _BUILT.clear()
            field = _ONE_FIELD[name]
            found = _BUILT[at] = self._key(name, **({field: part} if field else {}))
        return found

    def queue(self, klass: str, user: str, tenant: str | None = None,
              session: str | None = None) -> str:
        """A user's queue in its tenant (None: the tenant named after the user); with a
        session (sessions on, not the default session ""), that session's queue."""
        if session:
            return self._key("session_queue", klass=klass, tenant=tenant or user, user=user,
                             session=session)
        return self._key("queue", klass=klass, tenant=tenant or user, user=user)

    def sessions(self, klass: str, tenant: str, user: str) -> str:
        """A user's sessions with a queued request, by session score (sessions on)."""
        return self._key("sessions", klass=klass, tenant=tenant, user=user)

    def session_saved(self, klass: str, tenant: str, user: str) -> str:
        return self._key("session_saved", klass=klass, tenant=tenant, user=user)

    def user_queued(self, klass: str, tenant: str, user: str) -> str:
        return self._key("user_queued", klass=klass, tenant=tenant, user=user)

    def active(self, klass: str) -> str:
        """The class's tenants with a queued request, by tenant score (with no tenants
        configured every user is its own tenant, so these are the users)."""
        return self._one("active", klass)

    def saved(self, klass: str) -> str:
        return self._one("saved", klass)

    def users(self, klass: str, tenant: str) -> str:
        return self._key("users", klass=klass, tenant=tenant)

    def user_saved(self, klass: str, tenant: str) -> str:
        return self._key("user_saved", klass=klass, tenant=tenant)

    def user_floor(self, klass: str) -> str:
        return self._one("user_floor", klass)

    def request(self, request_id: str) -> str:
        return self.prefix + _REQUEST_HEAD + request_id  # one per request: not kept

    @property
    def request_prefix(self) -> str:
        """What every request hash's name starts with (for SCAN)."""
        return self.request("")

    @property
    def depth(self) -> str:
        return self._one("depth")

    @property
    def backlogged_since(self) -> str:
        return self._one("backlogged_since")

    @property
    def recent(self) -> str:
        return self._one("recent")

    @property
    def recent_tenants(self) -> str:
        return self._one("recent_tenants")

    @property
    def drained(self) -> str:
        return self._one("drained")

    @property
    def migrate(self) -> str:
        return self._one("migrate")

    @property
    def user_inflight(self) -> str:
        return self._one("user_inflight")

    @property
    def replicas(self) -> str:
        return self._one("replicas")

    @property
    def scrapers(self) -> str:
        return self._one("scrapers")

    @property
    def listened(self) -> str:
        return self._one("listened")

    def grants(self, replica: str) -> str:
        return self._one("grants", replica)

    def running(self, replica: str) -> str:
        return self._one("running", replica)

    def preempts(self, replica: str) -> str:
        return self._one("preempts", replica)

    def backend_preempt(self, backend: str) -> str:
        return self._one("backend_preempt", backend)

    def backend_lora(self, backend: str) -> str:
        return self._one("backend_lora", backend)

    @property
    def lora_loading(self) -> str:
        return self._one("lora_loading")

    def lora_load(self, adapter: str) -> str:
        return self._one("lora_load", adapter)

    @property
    def lora_demand(self) -> str:
        return self._one("lora_demand")

    def backend_started(self, backend: str) -> str:
        return self._one("backend_started", backend)

    def backend_dispatches(self, backend: str) -> str:
        return self._one("backend_dispatches", backend)

    def backend_sent(self, backend: str) -> str:
        return self._one("backend_sent", backend)

    def backend_snapshot(self, backend: str) -> str:
        return self._one("backend_snapshot", backend)

    def backend_scraper(self, backend: str) -> str:
        return self._one("backend_scraper", backend)

    def backend_inflight(self, backend: str) -> str:
        return self._one("backend_inflight", backend)

    def backend_prefixes(self, backend: str) -> str:
        return self._one("backend_prefixes", backend)

    def backend_prefill(self, backend: str) -> str:
        return self._one("backend_prefill", backend)

    @property
    def service(self) -> str:
        return self._one("service")

    @property
    def service_epoch(self) -> str:
        return self._one("service_epoch")

    @property
    def service_who(self) -> str:
        return self._one("service_who")

    @property
    def seen(self) -> str:
        """Trusted keys' end users, each (tenant, user) by its last enqueue or settle."""
        return self._one("seen")

    def usage(self, day: str) -> str:
        """The model's usage hash of one UTC day (``YYYYMMDD``)."""
        return self._one("usage", day)


@dataclass(frozen=True, slots=True)
class BatchKeys:
    batch_id: str

    @property
    def hash(self) -> str:
        return BATCH_PREFIX + self.batch_id

    @property
    def out(self) -> str:
        return f"{BATCH_PREFIX}{self.batch_id}:out"

    @property
    def err(self) -> str:
        return f"{BATCH_PREFIX}{self.batch_id}:err"

    @property
    def lease(self) -> str:
        return f"{BATCH_PREFIX}{self.batch_id}:lease"


def user_batches(user: str) -> str:
    return USER_BATCHES_PREFIX + user


def file_meta(file_id: str) -> str:
    return FILE_PREFIX + file_id


def user_files(owner: str) -> str:
    return USER_FILES_PREFIX + owner


def user_file_bytes(owner: str) -> str:
    return USER_FILE_BYTES_PREFIX + owner


def session(token_hash: str) -> str:
    return SESSION_PREFIX + token_hash


def key_record(key_id: str) -> str:
    """Hash: one runtime key (user, tenant, class, weight, limits, digest, created, …)."""
    return KEYRING_PREFIX + KEYRING_PATTERNS["keyring_record"].format(key_id=key_id)


def key_digest(digest_hex: str) -> str:
    """String: HMAC digest of a secret -> key id (with a TTL for a rotated-out secret)."""
    return KEYRING_PREFIX + KEYRING_PATTERNS["keyring_digest"].format(digest=digest_hex)


def quota_prefix(tenant: str) -> str:
    """The prefix of a tenant's limit counters and of its keys' (one hash tag: a request's
    check of its key and its tenant is one Lua call)."""
    return f"{ROOT}:{{q:{tenant}}}:"


def quota_keys(tenant: str, scope: str) -> tuple[str, str, str]:
    """(rpm bucket hash, tpm bucket hash, concurrency zset) of a scope: ``t`` for the
    tenant, ``k:<key id>`` for a key."""
    p = quota_prefix(tenant) + scope
    return f"{p}:rpm", f"{p}:tpm", f"{p}:conc"


def quota_budget(tenant: str, scope: str, period: str) -> str:
    """String: tokens spent in ``period`` (``d20261129`` or ``m202611``), with a TTL."""
    return f"{quota_prefix(tenant)}{scope}:{period}"


def _lua_function(name: str, pattern: str) -> str:
    params = re.findall(r"{(\w+)}", pattern)
    pieces = [f"'{lit}'" if i % 2 == 0 else lit
              for i, lit in enumerate(re.split(r"{(\w+)}", pattern)) if lit]
    body = " .. ".join(["prefix", *pieces])
    return (f"local function key_{name}({', '.join(['prefix', *params])})\n"
            f"  return {body}\nend\n")


def lua_prelude() -> str:
    """Lua functions ``key_<name>(prefix, …)`` for the keys scripts derive: per model, and
    the keyring's."""
    return "".join(_lua_function(name, pattern)
                   for name, pattern in {**MODEL_PATTERNS, **KEYRING_PATTERNS}.items())
