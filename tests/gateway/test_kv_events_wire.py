"""vLLM's KV-event wire format (gateway/backends/kv_events.py) against a real vLLM 0.32
server's frames (tests/data/vllm-0.32-kv-events.json)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from gateway.backends.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    KVEventsFormatError,
    decode_batch,
    decode_seq,
    decode_wire,
    encode_batch,
    encode_seq,
)
from policies.kv_index import Cleared, Removed, Stored

FIXTURE = json.loads((Path(__file__).parents[1] / "data" / "vllm-0.32-kv-events.json").read_text())


def frames() -> list[list[bytes]]:
    return [[base64.b64decode(part) for part in frame] for frame in FIXTURE["frames"]]


def test_real_payloads_decode_and_encode_to_the_same_bytes() -> None:
    for topic, seq, payload in frames():
        assert topic == b"kv", topic
        batch = decode_wire(payload)
        assert batch.data_parallel_rank == 0, batch
        assert encode_batch(batch) == payload, decode_seq(seq)
    assert [decode_seq(seq) for _t, seq, _p in frames()] == list(range(7))


def test_decoded_events_are_the_index_events() -> None:
    (_t, _s, first), (_t2, _s2, second), (_t3, _s3, third) = frames()[:3]
    _ts, events = decode_batch(first)
    [stored] = events
    assert isinstance(stored, Stored), stored
    assert stored.block_size == 128 and len(stored.token_ids) == 256, stored.block_size
    assert stored.parent is None and stored.medium == "GPU" and stored.group == 0, stored
    assert list(stored.token_ids[:3]) == FIXTURE["prompts"]["a"][:3], stored.token_ids[:3]
    _ts, events = decode_batch(second)
    assert isinstance(events[0], Stored) and events[0].parent == stored.hashes[0], events
    _ts, events = decode_batch(third)
    assert isinstance(events[0], Removed) and events[0].hashes == (stored.hashes[1],), events


def test_replay_messages_and_the_end_marker() -> None:
    replies = [[base64.b64decode(part) for part in m] for m in FIXTURE["replay_from_1"]]
    *batches, end = replies
    assert [decode_seq(m[2]) for m in batches] == list(range(1, 7)), batches
    assert all(m[0] == b"" and m[1] == b"kv" for m in batches), batches[0][:2]
    assert end == [b"", b"", END_SEQ, b""] and decode_seq(end[2]) == -1, end
    assert [m[3] for m in batches] == [f[2] for f in frames()[1:]]  # the same payloads


def test_an_encoded_batch_round_trips_every_event_kind() -> None:
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[5] * 32,
                    block_size=16, lora_id=None, medium="GPU", lora_name=None,
                    extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention"),
        AllBlocksCleared(),
    ], data_parallel_rank=0)
    ts, events = decode_batch(encode_batch(batch))
    assert ts == 1.5 and isinstance(events[1], Cleared), events
    assert isinstance(events[0], Stored) and events[0].hashes == (1, 2), events
    assert decode_seq(encode_seq(7)) == 7


@pytest.mark.parametrize("payload", [b"", b"\x93\x01", b"not msgpack", encode_seq(3)])
def test_a_payload_that_is_not_a_batch_is_one_error(payload: bytes) -> None:
    with pytest.raises(KVEventsFormatError):
        decode_wire(payload)


def test_a_sequence_frame_has_eight_bytes() -> None:
    with pytest.raises(KVEventsFormatError):
        decode_seq(b"\x00" * 4)
