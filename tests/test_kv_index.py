"""The prefix index from KV events (policies/kv_index.py) and vLLM's block hashes
(policies/kv_blocks.py): against a real vLLM's events, and against a reference model
under any delivery of a publisher's batches (drops, duplicates, replays, restarts)."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.kv_blocks import DEFAULT_SEED, block_hashes, external, external_hashes, none_hash
from policies.kv_index import Cleared, Event, KVBlockIndex, Removed, Stored

FIXTURE = Path(__file__).parent / "data" / "vllm-0.32-kv-events.json"


def _fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def _fixture_batches() -> list[tuple[int, list[Event]]]:
    """The real server's batches, decoded field by field from msgpack without the gateway's
    codec (that has its own test): (sequence, events)."""
    import msgspec  # the payloads are msgpack; the codec under test is not used here

    batches = []
    for _topic, seq, payload in _fixture()["frames"]:
        _ts, events, _rank = msgspec.msgpack.decode(base64.b64decode(payload))
        plain: list[Event] = []
        for e in events:
            if e["type"] == "BlockStored":
                plain.append(Stored(tuple(e["block_hashes"]), e["parent_block_hash"],
                                    tuple(e["token_ids"]), e["block_size"], e["lora_name"],
                                    e["medium"], e.get("group_idx")))
            elif e["type"] == "BlockRemoved":
                plain.append(Removed(tuple(e["block_hashes"]), e["medium"], e.get("group_idx")))
            else:
                plain.append(Cleared())
        batches.append((int.from_bytes(base64.b64decode(seq), "big"), plain))
    return batches


# --- vLLM's block hashes ------------------------------------------------------------

def test_hashes_match_a_real_servers_events() -> None:
    """Every prompt's block hashes, computed here, are the ones the real server published
    (the chain, the 64-bit external form, the cache salt on the first block)."""
    fx = _fixture()
    stored = [e for _seq, events in _fixture_batches() for e in events if isinstance(e, Stored)]
    size = fx["block_size"]
    mine = {name: external_hashes(ids, size, cache_salt=fx["cache_salt"].get(name))
            for name, ids in fx["prompts"].items()}
    published = [list(e.hashes) for e in stored]
    # a: both blocks; b: its second block only (the first was a hit), parent a's first
    assert published[0] == mine["a"], (published[0], mine["a"])
    assert stored[1].parent == mine["a"][0], (stored[1], mine["a"])
    assert published[1] == mine["b"][1:], (published[1], mine["b"])
    for i, name in enumerate("cdef", start=2):
        assert published[i] == mine[name], (name, published[i], mine[name])
    assert published[6] == mine["salted"] and mine["salted"] != mine["a"], (published[6], mine)
    for e in stored[:6]:  # an unsalted prompt's own blocks: its token ids give its hashes
        if e.parent is None:
            assert external_hashes(e.token_ids, size) == list(e.hashes), e.hashes


def test_hash_chain_shape() -> None:
    ids = list(range(100, 140))
    digests = block_hashes(ids, 16)
    assert len(digests) == 2, len(digests)  # the 8-token tail has none
    assert block_hashes(ids[:32] + [1] * 8, 16) == digests
    assert block_hashes([7, *ids[1:]], 16)[1] != digests[1]  # a change reaches every later block
    assert block_hashes(ids, 16, seed="42") != digests  # PYTHONHASHSEED on the server
    assert none_hash() == none_hash(DEFAULT_SEED)
    assert external(digests[0]) == int.from_bytes(digests[0][-8:], "big")
    assert external_hashes(ids, 16, lora=("ad", "/p"))[0] != external(digests[0])
    with pytest.raises(ValueError):
        block_hashes(ids, 0)


# --- the index on the real server's stream -----------------------------------------

def test_index_of_a_real_stream_scores_what_the_server_holds() -> None:
    fx = _fixture()
    index = KVBlockIndex()
    for seq, events in _fixture_batches():
        index.receive("p", seq, events)
    assert index.state("p") == "exact"
    size = fx["block_size"]
    view = index.view("p")
    assert view is not None and view.block_size == size, view
    # 5 usable blocks: after a..f and the salted a, the cache holds f's and the salted a's
    # blocks (the server evicted the rest, as its BlockRemoved events said)
    def tokens(name: str) -> int | None:
        salt = fx["cache_salt"].get(name)
        return index.cached_tokens(
            lambda s: external_hashes(fx["prompts"][name], s, cache_salt=salt), ["p"])["p"]
    assert tokens("salted") == 256, tokens("salted")
    assert tokens("f") == 256, tokens("f")
    assert [tokens(n) for n in "abcde"] == [0, 0, 0, 0, 0], [tokens(n) for n in "abcde"]


# --- state machine examples ---------------------------------------------------------

def s(*hashes: int) -> Stored:
    return Stored(tuple(hashes), block_size=1, token_ids=tuple(range(len(hashes))))


def r(*hashes: int) -> Removed:
    return Removed(tuple(hashes))


def test_gap_makes_the_view_unknown_until_the_replay_fills_it() -> None:
    index = KVBlockIndex()
    index.receive("b", 0, [s(1, 2)])
    index.receive("b", 2, [s(3)])  # 1 lost
    assert index.state("b") == "unknown" and index.replay_from("b") == 1
    assert index.held_blocks("b", [1, 2]) is None
    index.receive("b", 1, [r(2)], replayed=True)
    index.receive("b", 2, [s(3)], replayed=True)  # the replay overlaps what was kept
    index.replay_done("b")
    assert index.state("b") == "exact", index.view("b")
    assert index.held_blocks("b", [1, 2]) == 1 and index.held_blocks("b", [1, 3]) == 2
    assert index.view("b").holders == {1: 1, 3: 1}  # type: ignore[union-attr]


def test_a_replay_that_cannot_fill_the_gap_leaves_a_lower_bound() -> None:
    index = KVBlockIndex()
    index.receive("b", 0, [s(1, 2)])
    index.receive("b", 3, [s(4)])
    index.receive("b", 2, [s(3)], replayed=True)  # the server's buffer starts at 2
    assert index.state("b") == "partial", index.view("b")
    assert index.view("b").holders == {3: 1, 4: 1}  # type: ignore[union-attr]
    assert index.held_blocks("b", [3]) == 1  # partial views are scored (a lower bound)
    index.receive("b", 4, [r(1), r(4)])  # removing an unseen block is ignored
    assert index.view("b").holders == {3: 1}  # type: ignore[union-attr]


def test_replay_done_without_the_missing_batch_gives_up() -> None:
    index = KVBlockIndex()
    index.receive("b", 0, [s(1)])
    index.receive("b", 5, [s(5)])
    index.replay_done("b")
    assert index.state("b") == "partial" and index.view("b").holders == {5: 1}  # type: ignore[union-attr]
    assert index.replay_from("b") is None


def test_a_clear_after_a_gap_makes_the_view_exact() -> None:
    index = KVBlockIndex()
    index.receive("b", 0, [s(1)])
    index.receive("b", 4, [s(9), Cleared(), s(2)])
    assert index.state("b") == "exact" and index.view("b").holders == {2: 1}  # type: ignore[union-attr]
    index.receive("b", 5, [s(3)])
    assert index.view("b").holders == {2: 1, 3: 1}  # type: ignore[union-attr]


def test_sequence_zero_again_is_a_restart() -> None:
    index = KVBlockIndex()
    index.receive("b", 0, [s(1)])
    index.receive("b", 1, [s(2)])
    index.receive("b", 0, [s(7)])
    assert index.state("b") == "exact" and index.view("b").holders == {7: 1}  # type: ignore[union-attr]
    index.receive("b", 0, [s(8)], replayed=True)  # a replay's 0 is not a restart
    assert index.view("b").holders == {7: 1}  # type: ignore[union-attr]


def test_joining_late_waits_for_the_replay_from_zero() -> None:
    index = KVBlockIndex()
    index.receive("b", 7, [s(1)])
    assert index.state("b") == "unknown" and index.replay_from("b") == 0


def test_too_many_kept_batches_give_up() -> None:
    index = KVBlockIndex(max_pending=2)
    index.receive("b", 0, [s(1)])
    for seq in (2, 3, 4):
        index.receive("b", seq, [s(seq)])
    assert index.state("b") == "partial", index.view("b")
    assert index.view("b").holders == {2: 1, 3: 1, 4: 1}  # type: ignore[union-attr]


def test_holders_are_counted_and_other_tiers_ignored() -> None:
    index = KVBlockIndex()
    index.receive("b", 0, [s(1), s(1), r(1)])  # two physical blocks, one evicted
    assert index.held_blocks("b", [1]) == 1
    index.receive("b", 1, [Stored((5,), medium="CPU"), Stored((6,), group=1), r(1)])
    assert index.view("b").holders == {}  # type: ignore[union-attr]
    assert index.cached_tokens(lambda size: [1], ["b", "absent"]) == {"b": 0, "absent": None}


def test_reset_and_forget() -> None:
    index = KVBlockIndex()
    index.receive("b", 0, [s(1)])
    index.receive("b", 3, [s(2)])
    index.reset("b")
    assert index.state("b") == "exact" and index.held_blocks("b", [1]) == 0
    index.forget("b")
    assert index.state("b") is None and index.backends() == []


# --- the reference model ------------------------------------------------------------

@st.composite
def publisher_logs(draw: st.DrawFn) -> list[list[Event]]:
    """A consistent event log: removals only of held blocks, as vLLM publishes them."""
    held: Counter[int] = Counter()
    log: list[list[Event]] = []
    for _ in range(draw(st.integers(1, 25))):
        batch: list[Event] = []
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(["store", "store", "remove", "remove", "clear"]))
            if kind == "store":
                hashes = draw(st.lists(st.integers(0, 5), min_size=1, max_size=2))
                held.update(hashes)
                batch.append(s(*hashes))
            elif kind == "remove" and +held:
                victim = draw(st.sampled_from(sorted(+held)))
                held[victim] -= 1
                batch.append(r(victim))
            elif kind == "clear":
                held.clear()
                batch.append(Cleared())
        log.append(batch)
    return log


def truth(log: list[list[Event]], upto: int) -> Counter[int]:
    held: Counter[int] = Counter()
    for batch in log[:upto]:
        for event in batch:
            if isinstance(event, Cleared):
                held.clear()
            elif isinstance(event, Stored):
                held.update(event.hashes)
            else:
                held.subtract(event.hashes)
    return +held


def check(index: KVBlockIndex, log: list[list[Event]], newest: int) -> None:
    """``newest``: the highest sequence number delivered so far."""
    view = index.view("b")
    assert view is not None
    if view.state != "unknown":  # a scored view is never behind a batch it was given
        assert view.next_seq > newest and not view.pending, (view, newest)
    if view.state == "unknown":
        assert index.held_blocks("b", [0]) is None
        return
    real = truth(log, view.next_seq)
    mine = Counter(view.holders)
    if view.state == "exact":
        assert mine == real, (view, real)
    else:  # partial: never claims a block the server does not hold
        assert not mine - real, (view, real)


@settings(max_examples=300, deadline=None)
@given(log=publisher_logs(), data=st.data())
def test_index_equals_the_reference_under_any_delivery(log: list[list[Event]],
                                                       data: st.DataObject) -> None:
    index = KVBlockIndex(max_pending=data.draw(st.integers(1, 8)))
    buffer_steps = data.draw(st.integers(1, 30))  # the publisher's replay buffer
    dropped = False
    newest = -1
    for seq, batch in enumerate(log):
        fate = data.draw(st.sampled_from(["deliver", "deliver", "deliver", "drop", "twice"]))
        dropped |= fate == "drop"
        for _ in range({"deliver": 1, "drop": 0, "twice": 2}[fate]):
            index.receive("b", seq, batch)
            newest = seq
            check(index, log, newest)
        start = index.replay_from("b")
        if start is not None and data.draw(st.booleans()):
            for old in range(max(start, seq + 1 - buffer_steps), seq + 1):
                index.receive("b", old, log[old], replayed=True)
                newest = max(newest, old)
                check(index, log, newest)
            index.replay_done("b")
            check(index, log, newest)
    if index.view("b") is None:  # nothing was delivered
        assert newest == -1
        return
    start = index.replay_from("b")
    if start is not None:  # a final replay with everything still buffered
        for old in range(start, len(log)):
            index.receive("b", old, log[old], replayed=True)
            newest = max(newest, old)
        index.replay_done("b")
    check(index, log, newest)
    view = index.view("b")
    # caught up with every batch it was given (a lost last batch shows only with the next)
    assert view is not None and view.state != "unknown" and view.next_seq == newest + 1, view
    if view.state == "exact":
        assert Counter(view.holders) == truth(log, view.next_seq), view
    if not dropped:
        assert view.state == "exact", view
