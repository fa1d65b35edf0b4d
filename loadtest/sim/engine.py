"""``SimEngine``: the asyncio step loop around the pure ``Scheduler``.

Each step: plan (``Scheduler.schedule``), price it with the profile's roofline model,
sleep until an absolute deadline, then apply it (``Scheduler.update``) and hand the
sampled tokens to their streams. Deadlines chain from one step to the next while the
engine stays busy, so Python's own time per step is absorbed instead of accumulating; the
loop waits on an event when idle.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from loadtest.sim.disagg import KVTransfer
from loadtest.sim.kv_publisher import KVEventPublisher, KVEventsConfig, wire_events
from loadtest.sim.prefix_cache import BlockTable, hash_blocks
from loadtest.sim.profiles import DEFAULT_PROFILE, PROFILES, Profile
from loadtest.sim.records import RequestRecord, RequestStream, Token
from loadtest.sim.scheduler import Scheduler, SchedulerLimits, StepPlan
from loadtest.sim.sequence import Sequence
from loadtest.sim.timing import StepStats, StepTiming, summarize

# Further behind schedule than this, the loop restarts its deadline chain rather than
# compressing the following steps to catch up.
MAX_LAG_S = 0.25
STEP_LOG_LEN = 200_000


@dataclass
class EngineConfig:
    """Engine flags, named like vLLM's. ``profile`` may be a ``Profile`` or its name."""

    model: str
    profile: Profile | str = DEFAULT_PROFILE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"
    kv_blocks: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens
    enable_prompt_tokens_details: bool = False
    # LoRA, as vLLM's --enable-lora, --max-loras (adapters per step), --max-lora-rank and
    # --lora-modules (name, path: loaded at start); lora_load_s: how long a runtime
    # POST /v1/load_lora_adapter takes (the simulator's own knob)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    lora_load_s: float = 0.0
    # disaggregated prefill/decode: the server's role and its modelled KV transfer
    kv_transfer: KVTransfer = field(default_factory=KVTransfer)
    # vLLM's --kv-events-config: publish the block pool's events over ZMQ
    kv_events: KVEventsConfig | None = None
    cost: Profile = field(init=False)
    num_kv_blocks: int = field(init=False)
    model_len: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_blocks", "block_size",
                     "max_model_len", "max_lora_rank"):
            value = getattr(self, name)
            if value is not None and value < 1:  # an engine of no size serves nothing
                raise ValueError(f"{name} must be at least 1, got {value}")
        if isinstance(self.profile, str):
            if self.profile not in PROFILES:
                raise ValueError(f"unknown profile {self.profile!r}; known: {sorted(PROFILES)}")
            self.cost = PROFILES[self.profile]
        else:
            self.cost = self.profile
        self.num_kv_blocks = self.kv_blocks or self.cost.default_kv_blocks
        cache_tokens = self.num_kv_blocks * self.block_size
        self.model_len = self.max_model_len or min(self.cost.max_model_len, cache_tokens)
        if self.model_len > cache_tokens:
            raise ValueError(
                f"max_model_len {self.model_len} exceeds the KV cache ({cache_tokens} tokens)"
            )
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora")
        if self.lora_load_s < 0:
            raise ValueError(f"lora_load_s must not be negative, got {self.lora_load_s}")

    def limits(self) -> SchedulerLimits:
        """The scheduler's view of these flags."""
        return SchedulerLimits(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            policy=self.scheduling_policy,
            kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            max_loras=self.max_loras if self.enable_lora else 0,
            kv_cache_events=self.kv_events is not None and self.enable_prefix_caching,
        )


class EngineObserver(Protocol):
    """Receives engine events (the metrics module implements it)."""

    def token(self, record: RequestRecord, emit_s: float, prev_emit_s: float | None) -> None: ...
    def finished(self, record: RequestRecord) -> None: ...
    def preempted(self, record: RequestRecord) -> None: ...
    def step(self, batch_tokens: int) -> None: ...

    def prefix_cache(self, queries: int, hits: int) -> None: ...


class SimEngine:
    """A simulated vLLM engine core."""

    def __init__(self, config: EngineConfig, observer: EngineObserver | None = None) -> None:
        self.config = config
        self.scheduler = Scheduler(config.limits())
        self.records: dict[str, RequestRecord] = {}
        self.step_log: deque[StepTiming] = deque(maxlen=STEP_LOG_LEN)
        self._observer = observer
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reported_queries = 0
        self._reported_hits = 0
        self.kv_publisher: KVEventPublisher | None = None

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.scheduler.running)

    @property
    def kv_usage(self) -> float:
        """KV-cache usage, 0..1."""
        return self.scheduler.kv_usage

    def lora_activity(self) -> dict[str, tuple[int, int]]:
        """Adapters with live requests: name -> (waiting, running)."""
        return self.scheduler.lora_activity()

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache so far."""
        return self.scheduler.pool.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found in the prefix cache so far."""
        return self.scheduler.pool.hits

    def start(self) -> None:
        """Start the step loop on the running event loop."""
        if self._task is None:
            if self.config.kv_events is not None and self.kv_publisher is None:
                self.kv_publisher = KVEventPublisher(self.config.kv_events)
                self.kv_publisher.start()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Stop the loop and end every open stream as aborted."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for request_id in list(self._streams):
            self.abort(request_id)
        if self.kv_publisher is not None:
            await self.kv_publisher.close()
            self.kv_publisher = None

    def add_request(
        self,
        request_id: str,
        *,
        prompt_tokens: int,
        max_tokens: int,
        output_tokens: int | Seq[int] | None = None,
        priority: int = 0,
        pooling: bool = False,
        prompt_ids: Seq[int] | None = None,
        lora: str | None = None,
        remote_tokens: int = 0,
    ) -> RequestStream:
        """Queue a request that will generate ``output_tokens`` (default ``max_tokens``).

        A sequence of output lengths queues one engine request per choice (vLLM's ``n``),
        with ids ``"{i}_{request_id}"``, all feeding the one returned stream.

        ``pooling`` (an embedding): prefill only, like vLLM's pooling requests (there
        ``max_tokens`` is 1): the request finishes when its prompt is computed; the one
        token its stream delivers then is the pooled output, not a generated token.

        ``prompt_ids`` (the prompt's token ids, one per prompt token) make the request's
        full blocks findable in the prefix cache; without them it is computed in full.

        ``lora`` names the LoRA adapter the request runs with (the engine needs LoRA on).

        ``remote_tokens``: prompt tokens whose KV came from a prefill server (a decode
        server's P/D request): computed already when the request is first admitted.
        """
        if lora is not None and not self.config.enable_lora:
            raise ValueError("LoRA is not enabled on this engine")
        if pooling:
            max_tokens = output_tokens = 1
            if prompt_tokens > self.config.model_len:
                raise ValueError(
                    f"prompt ({prompt_tokens}) tokens exceed max_model_len {self.config.model_len}"
                )
        if isinstance(output_tokens, Seq):
            targets = [min(t, max_tokens) for t in output_tokens]
        else:
            targets = [max_tokens if output_tokens is None else min(output_tokens, max_tokens)]
        if prompt_tokens < 1 or not targets or min(targets) < 1:
            raise ValueError("a request needs at least one prompt and one output token")
        if not pooling and prompt_tokens + max(targets) > self.config.model_len:
            raise ValueError(
                f"prompt ({prompt_tokens}) + output ({max(targets)}) tokens exceed "
                f"max_model_len {self.config.model_len}"
            )
        now = asyncio.get_running_loop().time()
        n = len(targets)
        ids = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
        records = [
            RequestRecord(
                rid, priority, prompt_tokens, max_tokens, now, choice=i, n=n, pooling=pooling,
                lora=lora,
            )
            for i, rid in enumerate(ids)
        ]
        stream = RequestStream(records)
        hashes: list[bytes] = []
        cache = self.scheduler.pool
        if cache.enable_caching and prompt_ids is not None and len(prompt_ids) == prompt_tokens:
            hashes = hash_blocks(prompt_ids, cache.block_size)
        for rid, record, target in zip(ids, records, targets, strict=True):
            table = BlockTable(hashes, token_ids=prompt_ids if hashes and prompt_ids else ())
            self.scheduler.add(
                Sequence(
                    rid, priority, now, prompt_tokens, target, table=table, lora=lora,
                    remote_tokens=min(remote_tokens, prompt_tokens - 1),
                )
            )
            self.records[rid] = record
            self._streams[rid] = stream
        self._wake.set()
        self._signal_change()
        return stream

    def abort_stream(self, stream: RequestStream) -> None:
        """Abort every choice of ``stream`` that has not finished."""
        for request_id in stream.request_ids:
            self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request and free its KV blocks."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        self.scheduler.abort(request_id)
        record = self.records[request_id]
        record.aborted = True
        record.finish_reason = "abort"
        record.finished_s = asyncio.get_running_loop().time()
        stream.close()
        if self._observer is not None:
            self._observer.finished(record)
        self._wake.set()
        self._signal_change()
        return True

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; re-checked whenever a request arrives or ends."""
        while not predicate():
            await self._changed.wait()

    def _signal_change(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def step_stats(self) -> StepStats:
        """Modelled vs wall-clock step durations since start."""
        return summarize(self.step_log)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = step_start = loop.time()
        while True:
            plan = self.scheduler.schedule() if self.scheduler.has_work() else None
            if plan is None or not plan.chunks:
                if plan is not None:
                    self._note_preemptions(plan)
                self._wake.clear()
                await self._wake.wait()
                deadline = step_start = loop.time()
                continue
            now = loop.time()
            self._note_schedule(plan, now)
            modelled = self.config.cost.step_time_s(
                plan.batch_tokens, plan.context_tokens
            ) + self.config.cost.lora_time_s(len(plan.loras), self.config.max_lora_rank)
            if now - deadline > MAX_LAG_S:
                deadline = step_start = now
            deadline += modelled
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            end = loop.time()
            self.step_log.append(
                StepTiming(
                    modelled, end - step_start, plan.batch_tokens, len(plan.chunks), end - deadline
                )
            )
            step_start = end
            if self._observer is not None:
                self._observer.step(plan.batch_tokens)
            self._emit(self.scheduler.update(plan), end)
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """The step's block-pool events as one batch, as vLLM's scheduler publishes them."""
        events = self.scheduler.pool.take_events()
        if events and self.kv_publisher is not None:
            self.kv_publisher.publish(wire_events(events, self.config.block_size))

    def _note_schedule(self, plan: StepPlan, now: float) -> None:
        self._note_preemptions(plan)
        for chunk in plan.chunks:
            if chunk.first_schedule:
                record = self.records[chunk.seq.request_id]
                record.first_scheduled_s = now
                record.cached_tokens = chunk.seq.num_cached_tokens
        queries, hits = self.prefix_cache_queries, self.prefix_cache_hits
        if queries != self._reported_queries and self._observer is not None:
            self._observer.prefix_cache(
                queries - self._reported_queries, hits - self._reported_hits
            )
        self._reported_queries, self._reported_hits = queries, hits

    def _note_preemptions(self, plan: StepPlan) -> None:
        for seq in plan.preempted:
            record = self.records[seq.request_id]
            record.num_preemptions += 1
            if self._observer is not None:
                self._observer.preempted(record)

    def _emit(self, sampled: list[Sequence], now: float) -> None:
        observer = self._observer
        for seq in sampled:
            stream = self._streams.get(seq.request_id)
            if stream is None:
                continue
            record = self.records[seq.request_id]
            prev = record.last_token_s
            if prev is None:
                record.first_token_s = now
            record.last_token_s = now
            finished = seq.output_tokens >= seq.target_output_tokens
            if finished:
                record.finish_reason = (
                    "length" if seq.output_tokens >= record.max_tokens and not record.pooling
                    else "stop"
                )  # fmt: skip
            stream.push(Token(record.output_tokens, now, record.choice, record.finish_reason))
            record.output_tokens += 1
            if observer is not None:
                observer.token(record, now, prev)
            if finished:
                record.finished_s = now
                del self._streams[seq.request_id]
                stream.close()
                if observer is not None:
                    observer.finished(record)
                self._signal_change()
