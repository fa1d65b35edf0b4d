"""Running one gateway process: the checks made before it starts (port, setup), serving
until a signal, SIGHUP's reload, and the one-line failures with exit status 2.

Shared by ``fairgate serve`` (``gateway/runtime/cli.py``) and each worker of
``gateway/runtime/workers.py``.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import signal
import socket
import sys
from collections.abc import Callable

import structlog

from gateway.core.errors import FairgateError
from gateway.core.settings import Settings
from gateway.core.worker_signals import RELOAD_SIGNAL
from gateway.http.server import GatewayServer
from gateway.reload import reload_settings
from gateway.storage.store_version import StoreTooOld

log = structlog.get_logger("fairgate.cli")


EXIT_USAGE = 2
"""Exit status of a command that cannot start as configured (as argparse's own errors)."""


def fail(message: str) -> int:
    """One line on stderr naming what to change; the caller exits with 2."""
    print(f"fairgate: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def port_in_use(exc: OSError) -> bool:
    return exc.errno == errno.EADDRINUSE


def port_taken(host: str, port: int) -> bool:
    """Whether another program listens on ``(host, port)``: binds there as the server will
    (SO_REUSEADDR) and lets go. Checked before anything starts, so the answer comes at once
    and alone; the server's own bind may still lose a race, see :func:`port_in_use`."""
    if port == 0:
        return False
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False  # the server's own bind reports a bad host
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if port_in_use(exc):
                    return True
    return False


def port_taken_message(host: str, port: int, change: str) -> str:
    return f"port {port} on {host} is already in use; {change}"


def missing_setup(settings: Settings) -> str | None:
    """Why a gateway with these settings would refuse every request, or None."""
    missing = [name for name, value in (("backends", settings.backends or settings.discovery),
                                        ("api_keys", settings.api_keys)) if not value]
    if not missing:
        return None
    where = (f"in {settings.config_file}" if settings.config_file
             else "and no config file given (--config or FAIRGATE_CONFIG)")
    env = " / ".join(f"FAIRGATE_{name.upper()}" for name in missing)
    return (f"no {' and no '.join(missing)} configured {where}; add them to the config "
            f"file or set {env} (JSON)")


SERVE_PORT_CHANGE = "choose another with listen.port in the config or FAIRGATE_LISTEN__PORT"


async def run_gateway(settings: Settings, server: GatewayServer | None = None,
                      ready: Callable[[GatewayServer], None] | None = None) -> int:
    """Serve until SIGINT/SIGTERM (0); a port taken at bind time, or a store older than
    fairgate needs (``gateway/storage/store_version.py``) → one line, 2.

    ``ready`` is called once the server listens (default: print where); a worker of
    ``gateway/runtime/workers.py`` passes its own ``server`` and ``ready``."""
    server = server or GatewayServer(settings)
    try:
        await server.start()
    except StoreTooOld as exc:
        await server.stop()
        return fail(str(exc))
    except OSError as exc:
        await server.stop()  # the embedded Redis and the loops started before the bind
        if not port_in_use(exc):
            raise
        return fail(port_taken_message(settings.listen.host, settings.listen.port,
                                       SERVE_PORT_CHANGE))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(RELOAD_SIGNAL, functools.partial(_reload, server))
    if ready is None:
        print(f"fairgate listening on {server.url}", flush=True)
    else:
        ready(server)
    try:
        await stop.wait()
    finally:
        await server.stop()
    return 0


def _reload(server: GatewayServer) -> None:
    """SIGHUP: re-read the config file, as ``POST /admin/reload`` does."""
    try:
        reload_settings(server.services)
    except FairgateError as exc:
        log.error("config_reload_failed", error=str(exc))
