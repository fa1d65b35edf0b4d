"""API keys created at runtime (``/admin/keys``), held in Redis and seen by every replica.

A secret is shown once, when it is created or rotated; Redis holds only its HMAC-SHA256
digest under the server's pepper (``key_pepper``, or else one drawn once per store and
kept in Redis, the log saying at start whether this process drew it: every lookup puts
this replica's back when a Redis restarted empty, and adopts the store's when another
replica's got there first), and a lookup is one
hash-table read by digest, so no secret is compared in clear. Each replica caches what
it looked up (found or not) for ``key_cache_s`` (≤ 1 s):
a new key, a revocation or the end of a rotation's grace period takes effect on every
replica within that time, without a reload. Keys from the config file stay in
``gateway/access/auth.py`` and keep working alongside.

Schema (``docs/redis-schema.md``): ``fg:{keys}:id:<id>`` hash per key,
``fg:{keys}:hash:<digest>`` → id (a rotated-out secret's with a TTL), ``fg:{keys}:ids``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from typing import Any

import structlog

from gateway.core.settings import ApiKey, ReadsSettings, SettingsHolder, UsageLimits
from gateway.storage.keys import KEY_IDS, KEY_PEPPER, KEYRING_PREFIX, key_digest, key_record
from gateway.storage.redis_client import BoundaryRedis
from gateway.storage.scripts import load_script

log = structlog.get_logger("fairgate.keys")

SECRET_PREFIX = "sk-fg-"
SHOWN_PREFIX_CHARS = len(SECRET_PREFIX) + 4  # what listings show of a secret
MAX_CACHED = 100_000
PEPPER_HINT = ("no key_pepper configured: runtime keys are hashed with a pepper kept in "
               "Redis; set key_pepper (FAIRGATE_KEY_PEPPER) in production")
CHANGED = "another replica's pepper is the store's (Redis restarted empty): adopted"


def digest(pepper: bytes, secret: str) -> str:
    return hmac.new(pepper, secret.encode(), hashlib.sha256).hexdigest()


class RuntimeKeys(ReadsSettings):
    def __init__(self, client: BoundaryRedis, settings: SettingsHolder) -> None:
        self.client: Any = client  # redis-py's sync/async union types: untyped here
        self.holder = settings
        configured = settings.current.key_pepper  # a restart changes it, not a reload
        self._configured = configured is not None
        self._pepper = configured.get_secret_value().encode() if configured else None
        self._cache: dict[str, tuple[float, ApiKey | None]] = {}
        self._lookup = client.register_script(load_script("key_lookup"))
        self._rotate = client.register_script(load_script("key_rotate"))
        self._revoke = client.register_script(load_script("key_revoke"))

    async def pepper(self) -> bytes:
        """The HMAC pepper: from the settings, or else the store's, generated once per
        store (``SET NX``) and kept in Redis (settled at start, see :meth:`settle_pepper`,
        or when first needed if Redis was down then)."""
        if self._pepper is not None:
            return self._pepper
        return await self._store_pepper()

    async def settle_pepper(self) -> None:
        """At start, without ``key_pepper``: the store's pepper, the log saying whether
        this process generated it (StoreUnavailable while Redis is down)."""
        if not self._configured:
            await self._store_pepper()

    async def _store_pepper(self) -> bytes:
        """The store's pepper: this replica's kept there when it has none (a new store, or
        a Redis that restarted empty), adopted when another replica's got there first."""
        mine = self._pepper or secrets.token_hex(32).encode()
        held = await self.client.set(KEY_PEPPER, mine, nx=True, get=True)
        if held is None:
            log.warning("key_pepper_generated" if self._pepper is None else
                        "key_pepper_restored", where=KEY_PEPPER, hint=PEPPER_HINT)
        elif self._pepper is None:
            log.info("key_pepper_from_store", where=KEY_PEPPER, hint=PEPPER_HINT)
        stored = mine if held is None else str(held).encode()
        if stored != self._pepper:
            if self._pepper is not None:
                log.warning("key_pepper_changed", where=KEY_PEPPER, reason=CHANGED)
            self._pepper = stored
            self._cache.clear()
        return stored

    async def _writing_pepper(self) -> bytes:
        """The pepper a new digest is made with: the store's, checked before each write."""
        return await self.pepper() if self._configured else await self._store_pepper()

    async def lookup(self, secret: str) -> ApiKey | None:
        """The key of this secret, from the cache while it is fresh."""
        pepper = await self.pepper()
        digest_hex = digest(pepper, secret)
        now = time.monotonic()
        cached = self._cache.get(digest_hex)
        if cached is not None and cached[0] > now:
            return cached[1]
        fields = await self._lookup(keys=[key_digest(digest_hex), KEY_PEPPER], args=[
            KEYRING_PREFIX, round(time.time(), 3), b"" if self._configured else pepper])
        if fields and str(fields[0]) == "pepper":  # the store's pepper changed: adopt it
            log.warning("key_pepper_changed", where=KEY_PEPPER, reason=CHANGED)
            self._pepper = str(fields[1]).encode()
            self._cache.clear()
            return await self.lookup(secret)
        found = _api_key(_pairs(fields)) if fields else None
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[digest_hex] = (now + self.settings.key_cache_s, found)
        return found

    async def create(self, user: str, tenant: str | None, klass: str, weight: float,
                     limits: UsageLimits | None, trusted_end_users: bool = False
                     ) -> tuple[dict[str, Any], str]:
        """(the key's public record, its secret: shown to the caller once)."""
        key_id = "key_" + secrets.token_hex(8)
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        now = round(time.time(), 3)
        fields = {"id": key_id, "user": user, "tenant": tenant or user, "class": klass,
                  "weight": repr(weight), "trusted_end_users": "1" if trusted_end_users else "0",
                  "limits": limits.model_dump_json(exclude_none=True) if limits else "",
                  "created": repr(now), "prefix": secret[:SHOWN_PREFIX_CHARS],
                  "digest": digest(await self._writing_pepper(), secret)}
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key_record(key_id), mapping=fields)
            pipe.set(key_digest(fields["digest"]), key_id)
            pipe.zadd(KEY_IDS, {key_id: now})
            await pipe.execute()
        log.info("api_key_created", key_id=key_id, user=user, tenant=fields["tenant"])
        return public(fields), secret

    async def rotate(self, key_id: str, grace_s: float) -> tuple[dict[str, Any], str] | None:
        """A new secret; the current one keeps working for ``grace_s``. None: no key."""
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        new = digest(await self._writing_pepper(), secret)
        done = await self._rotate(keys=[key_record(key_id), key_digest(new)],
                                  args=[KEYRING_PREFIX, key_id, new,
                                        secret[:SHOWN_PREFIX_CHARS], round(grace_s * 1000),
                                        round(time.time(), 3)])
        if not done:
            return None
        if grace_s <= 0:
            self._cache.clear()
        log.info("api_key_rotated", key_id=key_id, grace_s=grace_s)
        record = await self.get(key_id)
        return (record, secret) if record is not None else None

    async def revoke(self, key_id: str) -> bool:
        done = bool(await self._revoke(keys=[key_record(key_id), KEY_IDS],
                                       args=[KEYRING_PREFIX, key_id]))
        if done:
            self._cache.clear()  # this replica at once; the others within key_cache_s
            log.info("api_key_revoked", key_id=key_id)
        return done

    async def get(self, key_id: str) -> dict[str, Any] | None:
        fields: dict[str, str] = await self.client.hgetall(key_record(key_id))
        return public(fields) if fields else None

    async def records(self) -> list[dict[str, Any]]:
        """Every runtime key's public record (no secret, no digest), oldest first."""
        ids = await self.client.zrange(KEY_IDS, 0, -1)
        async with self.client.pipeline(transaction=False) as pipe:
            for key_id in ids:
                pipe.hgetall(key_record(key_id))
            rows = await pipe.execute()
        return [public(r) for r in rows if r]

    async def api_key(self, key_id: str) -> ApiKey | None:
        fields: dict[str, str] = await self.client.hgetall(key_record(key_id))
        return _api_key(fields) if fields else None


def _pairs(flat: list[Any]) -> dict[str, str]:
    return {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _limits(raw: str) -> UsageLimits | None:
    return UsageLimits.model_validate_json(raw) if raw else None


def _api_key(fields: dict[str, str]) -> ApiKey:
    return ApiKey(key="", id=fields["id"], user=fields["user"], tenant=fields["tenant"],
                  priority_class=fields["class"], weight=float(fields["weight"]),
                  trusted_end_users=fields.get("trusted_end_users") == "1",
                  limits=_limits(fields.get("limits", "")))


def public(fields: dict[str, str]) -> dict[str, Any]:
    """What a listing shows of a key: never its secret or the secret's digest."""
    last = fields.get("last_used")
    limits = _limits(fields.get("limits", ""))
    return {"id": fields["id"], "object": "fairgate.api_key", "prefix": fields["prefix"],
            "user": fields["user"], "tenant": fields["tenant"],
            "priority_class": fields["class"], "weight": float(fields["weight"]),
            "trusted_end_users": fields.get("trusted_end_users") == "1",
            "limits": json.loads(limits.model_dump_json(exclude_none=True)) if limits else {},
            "source": "runtime", "created": float(fields["created"]),
            "rotated": float(fields["rotated"]) if fields.get("rotated") else None,
            "last_used": float(last) if last else None}
