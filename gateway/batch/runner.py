"""Runs Batch API jobs through the same fair scheduler as interactive traffic.

Every replica runs a :class:`BatchRunner`; a batch is run by whichever replica holds its
lease. Lines enter the owner's ``batch`` class queue, at most ``batch_max_in_flight`` at a
time and never more than the user's queue cap (``max_queued_per_user``), so even a
100,000-line file adds only a handful of Redis entries. A line that finds the user's queue
full anyway (other batches or requests of the same user) waits and tries again: a full
queue is back-pressure, never a failed line. Each result is
recorded once (HSETNX on ``custom_id``); after a crash another runner takes the lease and
runs only the lines without a result. A line that was at the backend when its runner died
was aborted there (the connection closed) and runs again; only a line whose answer had
arrived but was not yet recorded at the moment of the crash (a window of one Redis
round trip) can have been executed twice — at-least-once there, exactly once elsewhere.

A line whose reservation does not fit what is left of its owner's budget fails alone
(``insufficient_quota`` in the error file); the others still run within the budget. While
other lines of the batch are in admission (their reservations may be refunded down to
what they used), a refused line waits for one to settle and tries again
(:class:`Reservations`).

A batch whose key is revoked (or taken out of the config) is cancelled at its next line:
the lines under way are aborted, those that finished stay in its files, and its
``errors`` say ``api_key_revoked``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import structlog

from gateway.batch.files import FileStore
from gateway.batch.input import BatchLine, load_file
from gateway.batch.records import FINAL, BatchStore
from gateway.batch.results import BatchResults, output_line
from gateway.core.errors import (
    FairgateError,
    InsufficientQuota,
    RateLimited,
    RateLimitExceeded,
    StoreUnavailable,
    Unavailable,
)
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ApiKey, ReadsSettings, SettingsHolder
from gateway.core.waits import event_set
from gateway.proxy.completion_request import Limits
from gateway.proxy.upstream import Upstream
from gateway.scheduling.admission import Admission

log = structlog.get_logger("fairgate.batch")

RETRY_PAUSE_S = 1.0
QUEUE_FULL_PAUSE_S = 0.25  # one enqueue attempt per line this often while the queue is full
MAX_ATTEMPTS = 5


class Reservations:
    """One batch's lines in admission, whose reservations against the owner's limits may
    be refunded when they settle: a line refused ``insufficient_quota`` tries again once
    one of them settled (the refund may make room), and fails alone when none is left
    that could."""

    def __init__(self) -> None:
        self.inside = 0  # lines in admission (queued, running, or being checked)
        self.settles = 0  # lines that left admission having held a reservation
        self._left = asyncio.Event()  # set (and replaced) when a line leaves admission

    @contextlib.contextmanager
    def entering(self) -> Iterator[None]:
        """A line in admission; one refused by a limit held no reservation."""
        self.inside += 1
        held = True
        try:
            yield
        except RateLimitExceeded:  # refused by a limit (a budget too): nothing held
            held = False
            raise
        finally:
            self.inside -= 1
            self.settles += held
            self._left.set()
            self._left = asyncio.Event()

    async def settled_since(self, seen: int) -> bool:
        """Whether a line settled its reservation since ``self.settles`` was ``seen``,
        waiting for it while other lines are still in admission."""
        while self.settles == seen and self.inside > 0:
            await self._left.wait()
        return self.settles != seen


class BatchRunner(ReadsSettings):
    def __init__(self, settings: SettingsHolder, admission: Admission, upstream: Upstream,
                 files: FileStore, batches: BatchStore, results: BatchResults,
                 metrics: GatewayMetrics, replica_id: str,
                 account_of: Callable[[str], Awaitable[ApiKey | None]] | None = None) -> None:
        self.holder = settings
        self.admission = admission
        self.upstream = upstream
        self.files = files
        self.batches = batches
        self.results = results
        self.metrics = metrics
        self.replica_id = replica_id
        self.running: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        # the owner's key by id, for its limits and budgets (None: none known)
        self.account_of = account_of

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await self._claim_new()
            except StoreUnavailable as exc:
                log.warning("batch_poll_failed", error=str(exc))
            await event_set(self._wake, self.settings.batch_poll_s)
            self._wake.clear()

    async def _claim_new(self) -> None:
        active = await self.batches.active()
        statuses = Counter(raw["status"] for raw in
                           [await self.batches.raw(b) for b in active] if raw is not None)
        for status in ("validating", "in_progress", "finalizing", "cancelling"):
            self.metrics.batch.jobs.labels(status).set(statuses.get(status, 0))
        for batch_id in active:
            if batch_id in self.running:
                continue
            if await self.batches.lease(batch_id, self.replica_id,
                                        self.settings.batch_lease_s):
                task = asyncio.create_task(self._run_batch(batch_id), name=batch_id)
                self.running[batch_id] = task
                task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self.running.pop(task.get_name(), None)

    async def stop(self) -> None:
        for task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)

    async def _run_batch(self, batch_id: str) -> None:
        keeper = asyncio.create_task(self._keep_lease(batch_id))
        try:
            await self._execute_batch(batch_id)
        except Exception:
            log.exception("batch_failed", batch_id=batch_id)
        finally:
            keeper.cancel()

    async def _keep_lease(self, batch_id: str) -> None:
        me = asyncio.current_task()
        while True:
            await asyncio.sleep(self.settings.batch_lease_s / 3)
            try:
                held = await self.batches.lease(batch_id, self.replica_id,
                                                self.settings.batch_lease_s)
            except StoreUnavailable:
                continue  # nobody can take it meanwhile; renew once Redis is back
            if not held:
                log.warning("batch_lease_lost", batch_id=batch_id)
                task = self.running.get(batch_id)
                if task is not None and task is not me:
                    task.cancel()
                return

    async def _execute_batch(self, batch_id: str) -> None:
        raw = await self.batches.raw(batch_id)
        if raw is None:
            await self.batches.forget(batch_id)
            return
        if raw["status"] in FINAL:
            await self.batches.retire(batch_id)
            return
        doc = json.loads(raw["doc"])
        try:  # parsing takes seconds for a large file: off the event loop
            lines = await asyncio.to_thread(load_file, self.files.path(doc["input_file_id"]),
                                            self.settings.models(),
                                            Limits.of(self.settings))
        except (FairgateError, OSError) as exc:
            await self.results.fail(batch_id, str(exc))
            return
        await self.batches.transition(batch_id, ("validating",), "in_progress", "in_progress_at")
        while True:  # until every line has a result (a pass may leave some: Redis blips)
            done = await self.batches.done_ids(batch_id)
            pending = [line for line in lines if line.custom_id not in done]
            if not pending:
                outcome = "completed"
                break
            log.info("batch_running", batch_id=batch_id, total=len(lines), pending=len(pending))
            outcome = await self._feed(batch_id, doc, pending)
            if outcome != "completed":
                break
        if outcome == "lost":  # Redis restarted empty: there is no batch to finish
            log.warning("batch_record_lost", batch_id=batch_id, total=len(lines))
            await self.batches.forget(batch_id)
            return
        await self.results.finish(batch_id, doc, lines, outcome)

    async def _feed(self, batch_id: str, doc: dict[str, Any], pending: list[BatchLine]) -> str:
        """Run the pending lines; returns "completed", "cancelled", "expired", "revoked"
        (its key) or "lost" (the record is gone)."""
        slots = asyncio.Semaphore(self.feed_limit())
        tasks: set[asyncio.Task[None]] = set()
        outcome = "completed"
        account = await self._account(doc)
        reservations = Reservations()
        for line in pending:
            outcome = await self._interruption(batch_id)
            if outcome != "completed":
                break
            await slots.acquire()
            task = asyncio.create_task(self._execute_line(batch_id, doc, line, account,
                                                          reservations))
            tasks.add(task)

            def finished(t: asyncio.Task[None]) -> None:
                tasks.discard(t)
                slots.release()
                if not t.cancelled() and t.exception() is not None:
                    # its line has no result yet: the next pass of _execute_batch runs it
                    log.warning("batch_line_unrecorded", batch_id=batch_id,
                                error=str(t.exception()))

            task.add_done_callback(finished)
        try:
            while tasks and outcome == "completed":
                await asyncio.wait(tasks, timeout=self.settings.batch_poll_s)
                outcome = await self._interruption(batch_id)
        finally:
            for task in tasks:
                task.cancel()  # cancel or expiry: queued lines leave the queue, running abort
            await asyncio.gather(*tasks, return_exceptions=True)
        return outcome

    async def _account(self, doc: dict[str, Any]) -> ApiKey:
        """Whose limits and budgets the lines count against: the owner's key (as it is
        now), or its tenant's until a revoked key's batch is cancelled (its next line)."""
        key_id = doc.get("key_id")
        found = None
        if key_id and self.account_of is not None:
            found = await self.account_of(key_id)
        return found or ApiKey(key="", user=doc["user"], tenant=doc.get("tenant"), id=key_id,
                               weight=doc.get("weight", 1.0))

    def feed_limit(self) -> int:
        """Lines of one batch queued or running at once: never more than the user may
        queue, so a batch alone cannot fill its own user's queue."""
        return max(1, min(self.settings.batch_max_in_flight, self.settings.max_queued_per_user))

    async def _interruption(self, batch_id: str) -> str:
        try:
            raw = await self.batches.raw(batch_id)
        except StoreUnavailable:
            return "completed"  # cannot tell while Redis is down: go on, ask again later
        if raw is None:
            return "lost"
        if raw["status"] == "cancelling":
            return "cancelled"
        doc = json.loads(raw["doc"])
        if time.time() >= doc["expires_at"]:
            return "expired"
        if await self._revoked(doc):
            return "revoked"
        return "completed"

    async def _revoked(self, doc: dict[str, Any]) -> bool:
        """Was the key that created the batch revoked (or taken out of the config)?"""
        key_id = doc.get("key_id")
        if not key_id or self.account_of is None:
            return False
        try:
            return await self.account_of(key_id) is None
        except StoreUnavailable:
            return False  # cannot tell while Redis is down: go on, ask again later

    async def _execute_line(self, batch_id: str, doc: dict[str, Any], line: BatchLine,
                            account: ApiKey | None = None,
                            reservations: Reservations | None = None) -> None:
        """Run one line until it has a result in the output or the error file."""
        creq = line.request
        reservations = reservations or Reservations()
        attempt = 0
        answer: tuple[int, bytes] | None = None  # received: recorded, never run again
        while True:
            attempt += 1
            seen = reservations.settles
            try:
                if answer is not None:
                    await self._record_answer(batch_id, line, *answer)
                    return
                with reservations.entering():
                    async with self.admission.admitted(line.model, doc["user"], "batch",
                                                       doc.get("weight", 1.0), creq,
                                                       account=account) as ticket:
                        # a whole answer nobody saw yet: moved (drain, preemption) or
                        # failing it is sent again elsewhere, recorded once below
                        answer = await self.upstream.fetch(ticket.backend, creq,
                                                           ticket.priority, ticket,
                                                           ticket.continuation, ticket.mover)
                        # record before releasing: the crash window that would run the
                        # line again (answer received, not yet recorded) stays short
                        await self._record_answer(batch_id, line, *answer)
                return
            except StoreUnavailable:
                pass  # Redis is down: no result can be recorded either; wait for it
            except InsufficientQuota as exc:
                if await reservations.settled_since(seen):  # a refund may make room
                    attempt -= 1
                    continue
                # its reservation does not fit what is left: this line fails, alone
                await self._record_error(batch_id, line, "insufficient_quota", exc.message)
                return
            except RateLimited as exc:
                # the user's queue is full (their other batches or requests), or a rate
                # limit of the owner's key or tenant: wait for room
                attempt -= 1
                await asyncio.sleep(max(QUEUE_FULL_PAUSE_S,
                                        min(float(exc.retry_after_s or 0), 5.0)))
                continue
            except Unavailable as exc:
                if attempt >= MAX_ATTEMPTS:
                    await self._record_error(batch_id, line, exc.code or exc.type, exc.message)
                    return
            except FairgateError as exc:
                await self._record_error(batch_id, line, exc.code or exc.type, exc.message)
                return
            except Exception:
                log.exception("batch_line_crashed", batch_id=batch_id, custom_id=line.custom_id)
                await self._record_error(batch_id, line, "internal_error",
                                         "the gateway failed to run this request")
                return
            await asyncio.sleep(RETRY_PAUSE_S)

    async def _record_error(self, batch_id: str, line: BatchLine, code: str,
                            message: str) -> None:
        result = output_line(line.custom_id, None, None, {"code": code, "message": message})
        if await self.batches.record(batch_id, line.custom_id, result, ok=False):
            self.metrics.batch.requests.labels("failed").inc()

    async def _record_answer(self, batch_id: str, line: BatchLine, status: int,
                             data: bytes) -> None:
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):
            body = {"raw": data.decode(errors="replace")}
        result = output_line(line.custom_id, status, body, None)
        if await self.batches.record(batch_id, line.custom_id, result, ok=status == 200):
            self.metrics.batch.requests.labels("completed" if status == 200 else "failed").inc()
