"""Backends and gateways as separate processes, so the load generator (this process)
never shares an event loop or a GIL with what it measures.

- a simulated vLLM: ``python -m loadtest sim …`` (``fairgate sim``);
- fairgate: ``python -m loadtest serve --config FILE`` (``fairgate serve``), on a
  Redis shared by the whole bench run (embedded Valkey unless ``--redis-url``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import yaml

from gateway.storage.embedded_redis import free_port

# a process up and its first scrape healthy: generous, a loaded CI runner starts slowly (30 s
# was seen to time out at load 6 on 2 cores)
START_TIMEOUT_S = 120.0


@dataclass
class Proc:
    """A child process serving HTTP at ``url``."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: IO[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        """User + system CPU seconds used so far by the process and its live children
        (``fairgate serve --workers N``: the supervisor and its workers; Linux /proc)."""
        return sum(self.cpu_split().values())

    def cpu_split(self) -> dict[int, float]:
        """CPU seconds so far of each process of the tree, by pid."""
        return {pid: _cpu_seconds(pid) for pid in _tree(self.pid)}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            with open(f"/proc/{current}/task/{current}/children") as handle:
                todo.extend(int(x) for x in handle.read().split())
        except OSError:
            pass
    return found


def _spawn(name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None,
           module: str = "loadtest") -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    return spawn_command([sys.executable, "-m", module, *args], log_path, env)


def executable(name: str) -> str | None:
    """A console script of this interpreter's environment (or else one on PATH)."""
    here = str(Path(sys.executable).parent)
    return shutil.which(name, path=os.pathsep.join([here, os.environ.get("PATH", "")]))


def spawn_command(argv: list[str], log_path: Path, env: dict[str, str] | None = None
                  ) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    """Start ``argv`` with its output in ``log_path`` (the caller stops it)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            env={**os.environ, **(env or {})})
    return proc, log


async def wait_http(url: str, path: str, proc: subprocess.Popen[bytes] | None,
                    timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll ``url + path`` until it answers 200 (a process we do not control)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{url}: process exited with {proc.returncode}")
            try:
                async with http.get(url + path, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{url}{path} not ready within {timeout_s}s")


@dataclass(frozen=True)
class SimSpec:
    """Flags of a simulated backend (named like vLLM's)."""

    profile: str = "h100-llama3.1-8b"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "priority"
    # usage.prompt_tokens_details.cached_tokens, as deploy/ runs vLLM: the gateway's
    # charge is corrected at the settle to the uncached prompt vLLM reports
    enable_prompt_tokens_details: bool = True
    # LoRA (vLLM's --enable-lora --max-loras, runtime loading on): 0 leaves it off
    max_loras: int = 0
    lora_load_s: float = 0.0  # how long a runtime load takes (the simulator's own flag)
    metrics: str = "all"  # "gateway": /metrics shows only what fairgate reads (fairgate sim)

    def flags(self) -> list[str]:
        """The ``fairgate sim`` flags of this spec (besides port, count and model)."""
        flags = ["--profile", self.profile, "--max-num-seqs", str(self.max_num_seqs),
                 "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                 "--scheduling-policy", self.scheduling_policy, "--metrics", self.metrics,
                 *(["--enable-prompt-tokens-details"] if self.enable_prompt_tokens_details
                   else [])]
        if self.max_loras:
            flags += ["--enable-lora", "--max-loras", str(self.max_loras),
                      "--allow-runtime-lora-updating", "--lora-load-s", str(self.lora_load_s)]
        return flags


async def serving(label: str, port: int, proc: subprocess.Popen[bytes], log: IO[bytes],
                  path: str, timeout_s: float = START_TIMEOUT_S) -> Proc:
    """The process spawned to serve on ``port``, once ``path`` answers 200 (stopped if it
    does not)."""
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http(url, path, proc, timeout_s)
    except BaseException:
        Proc(label, url, proc, log).stop()
        raise
    return Proc(label, url, proc, log)


async def start_sim(spec: SimSpec, model: str, log_dir: Path, label: str,
                    port: int | None = None) -> Proc:
    """A simulator on ``port`` (default: a free one); waits for /health. A caller that
    names the port knows its URL before it runs (to start a gateway beside it)."""
    port = port or free_port()
    args = ["sim", "--port", str(port), "--model", model, *spec.flags()]
    proc, log = _spawn(label, args, log_dir / f"{label}.log")
    return await serving(label, port, proc, log, "/health")


async def start_sims(spec: SimSpec, model: str, count: int, log_dir: Path, label: str
                     ) -> tuple[Proc, list[str]]:
    """``count`` simulators in one process (``fairgate sim --count``), each on a free port;
    returns the process and their URLs (from the lines naming them)."""
    log_path = log_dir / f"{label}.log"
    args = ["sim", "--port", "0", "--count", str(count), "--model", model, *spec.flags()]
    proc, log = _spawn(label, args, log_path)
    sims = Proc(label, "", proc, log)
    try:
        deadline, urls = time.monotonic() + START_TIMEOUT_S, list[str]()
        while len(urls) < count:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{label}: {len(urls)} of {count} simulators started")
            await asyncio.sleep(0.05)
            urls = [line.rsplit(" on ", 1)[1] for line in log_path.read_text().splitlines()
                    if line.startswith("fairgate sim: serving")]
        for url in urls:
            await wait_http(url, "/health", proc)
    except BaseException:
        sims.stop()
        raise
    return sims, urls


FROM_SOURCE = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
               "from loadtest.cli import main; sys.argv[0] = 'fairgate'; sys.exit(main())")


async def start_gateway(config: dict[str, Any], log_dir: Path, label: str, workers: int = 1,
                        source: Path | None = None) -> Proc:
    """``fairgate serve --workers N`` with ``config`` (YAML written next to its log); waits
    for /ready. ``source``: serve the fairgate of this source tree (first on its
    ``PYTHONPATH``, an absolute path) instead of the one installed."""
    port = free_port()
    config = {**config, "listen": {"host": "127.0.0.1", "port": port},
              "data_dir": str(log_dir / f"{label}-data")}
    path = log_dir / f"{label}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    args = ["serve", "--config", str(path), "--workers", str(workers)]
    if source is None:
        proc, log = _spawn(label, args, log_dir / f"{label}.log")
    else:
        # not ``-m loadtest``: that puts the working directory's tree first on sys.path,
        # before PYTHONPATH, and would serve this checkout's code under the other's name
        proc, log = spawn_command([sys.executable, "-c", FROM_SOURCE, str(source), *args],
                                  log_dir / f"{label}.log", {"PYTHONPATH": str(source)})
    return await serving(label, port, proc, log, "/ready")


async def start_bare_proxy(backend_url: str, log_dir: Path, label: str) -> Proc:
    """A bare aiohttp reverse proxy in front of ``backend_url``
    (:mod:`loadtest.bench.bare_proxy`: the HTTP floor under fairgate); waits for /health."""
    port = free_port()
    proc, log = _spawn(label, ["--port", str(port), "--backend", backend_url],
                       log_dir / f"{label}.log", module="loadtest.bench.bare_proxy")
    return await serving(label, port, proc, log, "/health")


async def start_together(starts: Mapping[str, Coroutine[Any, Any, Proc]]) -> list[Proc]:
    """Start processes side by side: each coroutine (by its label) spawns one and waits
    until it serves (:func:`start_sim`, :func:`start_gateway`); their boots overlap. Returns
    them in the order given. If one fails, the others are stopped (a start still waiting is
    cancelled, which stops its process) and the error names the one that failed."""
    tasks = {label: asyncio.ensure_future(start) for label, start in starts.items()}
    try:
        await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # cancelled while they start
        await _abandon(tasks.values())
        raise
    for label, task in tasks.items():
        if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
            await _abandon(tasks.values())
            raise RuntimeError(f"{label} did not start: {exc!r}") from exc
    return [task.result() for task in tasks.values()]


# a gateway's label and start, given the URLs of the simulators it fronts
GatewayStart = Callable[[list[str]], tuple[str, Coroutine[Any, Any, Proc]]]


@contextlib.asynccontextmanager
async def sim_fleet(spec: SimSpec, model: str, log_dir: Path, label: str, count: int,
                    gateway: GatewayStart | None = None) -> AsyncIterator[list[Proc]]:
    """``count`` fresh simulators (``label-b0``, …) started side by side; with ``gateway``
    (its start, given their URLs) the gateway after them, as the last process: its /ready
    waits for one healthy backend, not all, and a request only another could take (a
    length pool's, an adapter's) got a 503 while that one still booted. All stopped at
    the end."""
    procs = await start_together({f"{label}-b{i}": start_sim(spec, model, log_dir,
                                                             f"{label}-b{i}")
                                  for i in range(count)})
    try:
        if gateway is not None:
            _, start = gateway([proc.url for proc in procs])
            procs.append(await start)
        yield procs
    finally:
        for proc in procs:
            proc.stop()


async def _abandon(tasks: Iterable[asyncio.Future[Proc]]) -> None:
    """Cancel the starts still under way and stop every process that did start."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in pending:
        if task.done() and not task.cancelled() and task.exception() is None:
            task.result().stop()


async def backend_model(url: str) -> str:
    """The model an (external) vLLM server serves, from ``/v1/models``."""
    async with aiohttp.ClientSession() as http, http.get(url + "/v1/models") as resp:
        resp.raise_for_status()
        data = await resp.json()
    return str(data["data"][0]["id"])


async def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Wait until an external backend reports nothing waiting or running."""
    from gateway.backends.vllm_metrics import parse_metrics

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            async with http.get(url + "/metrics") as resp:
                raw = parse_metrics(await resp.text())
            if raw.waiting == 0 and raw.running == 0:
                return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} still busy after {timeout_s}s")
