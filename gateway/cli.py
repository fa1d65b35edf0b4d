"""``fairgate serve``: the gateway's own command line.

The ``fairgate`` console script (``loadtest.cli``) adds the test rig's subcommands
(``demo``, ``sim``, ``bench``) through ``build_parser(*commands)``; this module knows only
the gateway, so ``python -m gateway.cli serve`` runs without the rig installed.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from gateway import event_loop
from gateway.errors import FairgateError
from gateway.logs import configure_logging
from gateway.reload import reload_settings
from gateway.server import GatewayServer
from gateway.settings import Settings, load_settings
from gateway.worker_signals import RELOAD_SIGNAL

log = structlog.get_logger("fairgate.cli")

DESCRIPTION = "fairgate: a fair-scheduling, OpenAI-compatible gateway in front of vLLM."

AddCommand = Callable[[Any], object]
"""Registers one subcommand on an argparse subparsers object."""


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
    missing = [name for name, value in (("backends", settings.backends),
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
    """Serve until SIGINT/SIGTERM (0); a port taken at bind time → one line, 2.

    ``ready`` is called once the server listens (default: print where); a worker of
    ``gateway/workers.py`` passes its own ``server`` and ``ready``."""
    server = server or GatewayServer(settings)
    try:
        await server.start()
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


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except FileNotFoundError as exc:
        return fail(str(exc))
    problem = missing_setup(settings)
    if problem is not None:
        return fail(problem)
    if port_taken(settings.listen.host, settings.listen.port):
        return fail(port_taken_message(settings.listen.host, settings.listen.port,
                                       SERVE_PORT_CHANGE))
    workers = args.workers or settings.workers
    if workers is None:
        from gateway.workers import default_workers

        workers = default_workers()
    configure_logging(settings.log_level, settings.log_sample_above_per_s)
    if workers > 1:
        from gateway.workers import serve_workers

        return serve_workers(settings, args.config, workers)
    return event_loop.run(run_gateway(settings), settings.event_loop)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def add_serve(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "serve", help="run the gateway (config: --config or FAIRGATE_CONFIG)")
    parser.add_argument("--config", help="YAML config file; FAIRGATE_* env vars override it")
    parser.add_argument(
        "--workers", type=_positive, default=None,
        help="gateway processes on the port (default: setting `workers`, else one per "
             "core; 1: serve in this process)")
    parser.set_defaults(run=_serve)
    return parser


def build_parser(*commands: AddCommand) -> argparse.ArgumentParser:
    """``fairgate serve`` plus ``commands``, in that order."""
    parser = argparse.ArgumentParser(prog="fairgate", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub)
    for add in commands:
        add(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand."""
    args = parser.parse_args(argv)
    configure_logging()
    result: int = args.run(args)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
