"""The simulator's KV-event publisher: vLLM's ``ZmqEventPublisher`` on asyncio
(``docs/vllm-pd-and-kv-events.md``; the wire format is ``gateway/backends/kv_events.py``).

A PUB socket sends ``(topic, sequence, payload)`` per batch, numbered from 0; an endpoint
with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, any other is connected to (the
subscriber binds), as vLLM does. An optional ROUTER socket serves replays: a request
``(b"", start sequence)`` gets every buffered batch from there, then the end marker.
pyzmq is imported here only (the ``sim`` extra), when a server is given
``--kv-events-config``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.backends.kv_events import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireEvent,
    encode_batch,
    encode_seq,
)
from loadtest.sim.prefix_cache import PoolEvent, StoredBlocks
from policies.kv_blocks import external

if TYPE_CHECKING:
    import zmq.asyncio


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (the fields the simulator honours)."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig | None:
        """The flag's JSON; None when events are not enabled."""
        raw: dict[str, Any] = json.loads(text)
        if not raw.get("enable_kv_cache_events") or raw.get("publisher", "zmq") != "zmq":
            return None
        known = {"endpoint", "replay_endpoint", "buffer_steps", "topic"}
        return cls(**{k: v for k, v in raw.items() if k in known})


def wire_events(events: list[PoolEvent], block_size: int) -> list[WireEvent]:
    """A block pool's events as vLLM's structs (the device tier, group 0, no LoRA)."""
    wire: list[WireEvent] = []
    for event in events:
        if isinstance(event, StoredBlocks):
            wire.append(BlockStored(
                block_hashes=[external(h) for h in event.hashes],
                parent_block_hash=None if event.parent is None else external(event.parent),
                token_ids=list(event.token_ids), block_size=block_size, lora_id=None,
                medium="GPU", lora_name=None, extra_keys=[None] * len(event.hashes),
                group_idx=0, kv_cache_spec_kind="full_attention",
            ))  # fmt: skip
        else:
            wire.append(BlockRemoved(
                block_hashes=[external(event.block_hash)], medium="GPU", group_idx=0
            ))  # fmt: skip
    return wire


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Numbered batches on a PUB socket, the last ``buffer_steps`` kept for replay."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq  # the sim extra's, only for a server that publishes
        import zmq.asyncio

        self._zmq = zmq
        self.config = config
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None

    def endpoint(self) -> str:
        """The PUB socket's last bound or connected endpoint (the port of a ``:0``)."""
        return str(self._pub.getsockopt_string(self._zmq.LAST_ENDPOINT))

    def replay_endpoint(self) -> str | None:
        """The replay socket's bound endpoint."""
        if self._replay is None:
            return None
        return str(self._replay.getsockopt_string(self._zmq.LAST_ENDPOINT))

    def start(self) -> None:
        """Serve replays on the running loop."""
        if self._replay is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replays())

    def publish(self, events: list[WireEvent]) -> None:
        """Send one batch (never blocks: a PUB socket drops past its high-water mark)."""
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(self._zmq.Again):
            self._pub.send_multipart(
                (self._topic, encode_seq(seq), payload), flags=self._zmq.NOBLOCK
            )

    async def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart(
                        (client, b"", self._topic, encode_seq(seq), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        """Stop serving replays and close the sockets."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
