"""The proxies ``overhead`` measures beside fairgate (loadtest/bench/peers.py): each one
installed serves a streamed and a non-streamed request to the simulator through its config;
one that is not installed is skipped with the reason. And the profile summary's arithmetic
(loadtest/bench/profile.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.bench import peers, profile
from loadtest.bench.client import Spec, Target, new_session, send
from loadtest.bench.env import MODEL
from loadtest.bench.overhead import SIM
from loadtest.bench.procs import start_sim


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer", peers.PEERS, ids=peers.NAMES)
async def test_an_installed_peer_relays_streamed_and_whole_answers(peer: peers.Peer,
                                                                   tmp_path: Path) -> None:
    if not peers.installed(peer):
        pytest.skip(f"{peer.name} not installed (the `peers` extra)")
    sim = await start_sim(SIM, MODEL, tmp_path, "sim")
    try:
        proc = await peers.start(peer, sim.url, tmp_path)
        try:
            target = Target(peer.name, proc.url, MODEL, via_gateway=False)
            async with new_session() as session:
                for stream in (True, False):
                    result = await send(session, target, Spec("u", "t", 8, 4, stream=stream))
                    assert result.ok and result.output_tokens == 4, (stream, result)
                    assert len(result.token_times) == (4 if stream else 1), result
            assert proc.cpu_seconds() > 0
        finally:
            proc.stop()
    finally:
        sim.stop()


async def test_a_peer_not_installed_is_unavailable_with_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "installed", lambda peer: False)
    with pytest.raises(peers.Unavailable, match=r"not installed.*fairgate\[peers\]"):
        await peers.start(peers.PEERS[0], "http://127.0.0.1:9", tmp_path)


async def test_a_peer_that_exits_at_start_is_unavailable_with_its_log(tmp_path: Path) -> None:
    broken = peers.Peer("broken", "broken", "json",
                        lambda backend, port, log_dir: ["sh", "-c", "echo no luck; exit 3"],
                        "/health")
    with pytest.raises(peers.Unavailable, match=r"did not start.*exited with 3.*no luck"):
        await peers.start(broken, "http://127.0.0.1:9", tmp_path)


def test_envoy_config_routes_everything_to_the_backend_without_timeouts() -> None:
    config = peers.envoy_config(8001, "http://127.0.0.1:9000")
    listener = config["static_resources"]["listeners"][0]  # type: ignore[index]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8001}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["codec_type"] == "HTTP1"
    assert hcm["stream_idle_timeout"] == hcm["request_timeout"] == "0s", hcm
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    assert route == {"match": {"prefix": "/"}, "route": {"cluster": "backend", "timeout": "0s"}}
    cluster = config["static_resources"]["clusters"][0]  # type: ignore[index]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {"address": "127.0.0.1",
                                                     "port_value": 9000}


def test_profile_summary_splits_samples_by_owner_then_leaf_layer() -> None:
    files = ["/x/gateway/runtime/cli.py", "/x/redis/asyncio/client.py",
             "/x/structlog/_log.py", "/x/json/encoder.py", "/x/aiohttp/web_protocol.py",
             "/x/asyncio/streams.py", "/x/gateway/scheduling/admission.py",
             "/x/asyncio/runners.py"]
    frames = [{"name": f"f{i}", "file": f} for i, f in enumerate(files)]
    speedscope = {"shared": {"frames": frames}, "profiles": [{
        "samples": [[0, 4, 6, 1],  # redis under admission under the server: redis's
                    [0, 4, 2, 3],  # JSON written for a log line: logging's
                    [0, 4, 5],  # an asyncio write by the server: the server's
                    [0, 4, 6, 5],  # ... by admission: admission's
                    [0, 7]],  # the loop itself, nothing of the gateway's above it
        "weights": [0.04, 0.02, 0.02, 0.01, 0.01]}]}
    summary = profile.summarize(speedscope)
    assert summary["samples"] == 5 and summary["seconds"] == 0.1, summary
    assert dict(summary["categories_pct"]) == {
        "redis": 40.0, "logging": 20.0, "aiohttp server": 20.0,
        "admission and scheduling": 10.0, profile.EVENT_LOOP: 10.0}, summary
    assert summary["top_self_pct"][0] == ("f1 (/x/redis/asyncio/client.py)", 40.0), summary
    text = profile.summary_text("t", summary)
    assert "40.0 %  redis" in text and "5 samples (0.1 s)" in text, text


def test_profile_frames_lose_the_machines_prefix() -> None:
    assert profile.short_path("/v/lib/python3.11/site-packages/aiohttp/client.py") == (
        "aiohttp/client.py")
    assert profile.short_path("/p/lib/python3.11/asyncio/runners.py") == "asyncio/runners.py"
    assert profile.short_path("/src/fairgate/gateway/proxy/relay.py") == "gateway/proxy/relay.py"
    assert profile.short_path("<string>") == "<string>"
