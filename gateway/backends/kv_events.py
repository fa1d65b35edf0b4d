"""vLLM's KV-cache event wire format (vLLM 0.32, ``vllm/distributed/kv_events.py``): pure
encoding and decoding, no sockets.

A publisher sends ZMQ multipart messages ``(topic, sequence, payload)``: the topic as
configured (``--kv-events-config``'s ``topic``, default empty), the batch's sequence number
as 8 bytes big-endian (0, 1, 2, … from the publisher's start) and the payload, a msgpack
``KVEventBatch``: an array ``[ts, events, data_parallel_rank]`` whose events are maps
tagged by ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), fields left
out where they equal their default. The structs below are vLLM's, field for field and in
vLLM's order, so :func:`encode_batch` writes the bytes vLLM writes
(``tests/data/vllm-0.32-kv-events.json`` holds a real server's frames).

The replay socket (a ROUTER) answers a request ``(b"", start sequence as 8 bytes
big-endian)`` with one message ``(b"", topic, sequence, payload)`` per batch still in its
buffer from that number on, then the end marker ``(b"", b"", -1 as 8 bytes, b"")``.

:func:`decode_batch` turns a payload into ``policies.kv_index`` events.
"""

from __future__ import annotations

from typing import Any

import msgspec

from policies.kv_index import Cleared, Event, Removed, Stored

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SEQ_BYTES = 8

ExternalBlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_ENCODER = msgspec.msgpack.Encoder()


class KVEventsFormatError(ValueError):
    """A payload that is not a ``KVEventBatch``."""


def decode_seq(frame: bytes) -> int:
    """A message's sequence frame as an int (-1: the replay's end marker)."""
    if len(frame) != SEQ_BYTES:
        raise KVEventsFormatError(f"a sequence frame has {SEQ_BYTES} bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """``seq`` as a message's sequence frame."""
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_wire(payload: bytes) -> KVEventBatch:
    """A payload as vLLM's structs."""
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVEventsFormatError(f"not a KV event batch: {exc}") from exc


def to_event(event: WireEvent) -> Event:
    """One wire event as the index's plain event."""
    if isinstance(event, BlockStored):
        return Stored(
            hashes=tuple(event.block_hashes),
            parent=event.parent_block_hash,
            token_ids=tuple(event.token_ids),
            block_size=event.block_size,
            lora_name=event.lora_name,
            medium=event.medium,
            group=event.group_idx,
        )
    if isinstance(event, BlockRemoved):
        return Removed(hashes=tuple(event.block_hashes), medium=event.medium, group=event.group_idx)
    return Cleared()


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """A payload's timestamp and events."""
    batch = decode_wire(payload)
    return batch.ts, [to_event(event) for event in batch.events]


def encode_batch(batch: KVEventBatch) -> bytes:
    """A batch as a payload, byte for byte as vLLM's publisher writes it."""
    return _ENCODER.encode(batch)
