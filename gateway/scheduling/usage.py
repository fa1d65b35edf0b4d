"""Usage accounting: per UTC day, per (tenant, user, key, model, class), the requests,
prompt tokens, completion tokens and errors, in Redis for ``usage_retention_days``.

Each finished (or refused) request adds to one hash per model and day
(``fg:{model}:usage:<YYYYMMDD>``, under the model's hash tag so the settle that carries it
stays in one Redis Cluster slot): a dispatched request's counts ride on its settle
(``lua/settle.lua``), any other's take one pipelined round trip. The models read are the
configured ones and those named in ``fg:usage:models`` (each export and each pipelined
record adds its models), so a model taken out of the config stays in the export until
its hashes expire. The admin export (``GET /admin/usage``) reads the days asked for
and sums them along the chosen dimensions. The user is the key's owner (end users of a
``trusted_end_users`` key are counted under it), so the rows stay bounded by the keys.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Callable, Iterable
from datetime import date, timedelta
from typing import Any

from gateway.core.settings import ApiKey
from gateway.storage.keys import USAGE_MODELS, ModelKeys
from gateway.storage.redis_client import BoundaryRedis
from gateway.storage.values import UsageCounts

DIMENSIONS = ("day", "tenant", "user", "key", "model", "class")
# errors: requests that failed (refused, or the backend or fairgate failed them);
# cancelled: requests their caller ended (a client that hung up, a cancelled batch's lines)
# cached_prompt_tokens: of the prompt tokens, those the backend found in its prefix cache
# (vLLM's --enable-prompt-tokens-details); fairness charges only the others
COUNTERS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens",
            "errors", "cancelled")
MAX_CACHED_ROWS = 10_000  # rows (and models) whose hash fields are kept between requests


def day_of(now: float) -> str:
    return time.strftime("%Y%m%d", time.gmtime(now))


class UsageLedger:
    def __init__(self, client: BoundaryRedis, retention_days: int,
                 models: Callable[[], Iterable[str]] = tuple) -> None:
        self.client: Any = client  # redis-py's sync/async union types: untyped here
        self.retention_s = retention_days * 86400
        self.retention_days = retention_days
        self.models = models  # the configured models (read at each export)
        # what every request would compute again: the hash fields of a row's counters
        # (a row: tenant, user, key, model, class; bounded, emptied when full) and the
        # current UTC day's hash of each model, with the day's bounds
        self._fields: dict[tuple[str, ...], dict[str, str]] = {}
        self._day_keys: dict[str, str] = {}
        self._day = (0.0, 0.0, "")  # [start, end) of the day the keys are of, its name

    def counts(self, key: ApiKey, model: str, klass: str, prompt_tokens: int,
               completion_tokens: int, error: bool, now: float | None = None,
               cancelled: bool = False, cached_tokens: int = 0) -> UsageCounts:
        """What one request adds (for :meth:`record`, or folded into its settle)."""
        fields = self._row_fields((key.tenant_name, key.user, key.id or "", model, klass))
        amounts = {"requests": 1, "prompt_tokens": prompt_tokens,
                   "cached_prompt_tokens": cached_tokens,
                   "completion_tokens": completion_tokens, "errors": 1 if error else 0,
                   "cancelled": 1 if cancelled else 0}
        return UsageCounts(self._day_key(model, time.time() if now is None else now),
                           {fields[name]: amount for name, amount in amounts.items() if amount},
                           self.retention_s + 86400)

    def _row_fields(self, row: tuple[str, ...]) -> dict[str, str]:
        """Each counter's hash field of ``row``: ``["tenant", "user", "key", "model",
        "class", "counter"]`` in JSON."""
        fields = self._fields.get(row)
        if fields is None:
            if len(self._fields) >= MAX_CACHED_ROWS:
                self._fields.clear()
            fields = self._fields[row] = {name: json.dumps([*row, name]) for name in COUNTERS}
        return fields

    def _day_key(self, model: str, now: float) -> str:
        """``model``'s usage hash of the UTC day of ``now``."""
        start, end, name = self._day
        if not start <= now < end:
            start = now - now % 86400  # POSIX time: every UTC day is 86,400 s
            name = day_of(now)
            self._day, self._day_keys = (start, start + 86400, name), {}
        found = self._day_keys.get(model)
        if found is None:
            if len(self._day_keys) >= MAX_CACHED_ROWS:
                self._day_keys.clear()
            found = self._day_keys[model] = ModelKeys(model).usage(name)
        return found

    async def record(self, key: ApiKey, model: str, klass: str, prompt_tokens: int,
                     completion_tokens: int, error: bool, now: float | None = None,
                     cancelled: bool = False) -> None:
        usage = self.counts(key, model, klass, prompt_tokens, completion_tokens, error, now,
                            cancelled)
        async with self.client.pipeline(transaction=False) as pipe:
            for field, amount in usage.counts.items():
                pipe.hincrby(usage.key, field, amount)
            pipe.expire(usage.key, usage.ttl_s)
            pipe.sadd(USAGE_MODELS, model)
            await pipe.execute()

    async def rows(self, first: date, last: date) -> list[dict[str, Any]]:
        """Every (day, tenant, user, key, model, class) row with its counters."""
        days = [first + timedelta(days=i) for i in range((last - first).days + 1)]
        configured = sorted(self.models())
        async with self.client.pipeline(transaction=False) as pipe:
            if configured:
                pipe.sadd(USAGE_MODELS, *configured)
            pipe.smembers(USAGE_MODELS)
            models = sorted(set(configured) | set((await pipe.execute())[-1]))
        pairs = [(d, m) for d in days for m in models]
        async with self.client.pipeline(transaction=False) as pipe:
            for d, model in pairs:
                pipe.hgetall(ModelKeys(model).usage(d.strftime("%Y%m%d")))
            found = await pipe.execute() if pairs else []
        rows: dict[tuple[str, ...], dict[str, Any]] = {}
        for (d, _), fields in zip(pairs, found, strict=True):
            for field, value in fields.items():
                try:
                    *parts, counter = json.loads(field)
                except ValueError:
                    continue
                if counter not in COUNTERS or len(parts) != 5:
                    continue
                ident = (d.isoformat(), *map(str, parts))
                row = rows.setdefault(ident, {**dict(zip(DIMENSIONS, ident, strict=True)),
                                              **dict.fromkeys(COUNTERS, 0)})
                row[counter] += int(value)
        return list(rows.values())


def group(rows: Iterable[dict[str, Any]], by: list[str]) -> list[dict[str, Any]]:
    """Rows summed along ``by`` (a subset of :data:`DIMENSIONS`), most tokens first."""
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    for row in rows:
        ident = tuple(row[d] for d in by)
        into = out.setdefault(ident, {**dict(zip(by, ident, strict=True)),
                                      **dict.fromkeys(COUNTERS, 0)})
        for counter in COUNTERS:
            into[counter] += row[counter]
    for row in out.values():
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
    return sorted(out.values(), key=lambda r: (-r["total_tokens"], -r["requests"],
                                               [r[d] for d in by]))


def to_csv(rows: list[dict[str, Any]], by: list[str]) -> str:
    buffer = io.StringIO()
    # RFC 4180 rows: with CRLF as the terminator a CR inside a cell is quoted too
    writer = csv.writer(buffer, lineterminator="\r\n")
    columns = [*by, *COUNTERS, "total_tokens"]
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_cell(row[c]) for c in columns])
    return buffer.getvalue()


FORMULA_LEADS = ("=", "+", "-", "@", "\t", "\r")  # OWASP's CSV-injection list


def _cell(value: Any) -> Any:
    """A text cell a spreadsheet will not run as a formula."""
    if isinstance(value, str) and value[:1] in FORMULA_LEADS:
        return "'" + value
    return value
