"""Several engine replicas behind one ``Engine``: sticky sessions, least-loaded placement, restarts.

An attempt is a conversation of many turns whose prompts share their prefix, so it must stay on the
replica that holds that prefix's KV cache: ``EnginePool.session()`` binds an attempt to the live replica
with the fewest bound attempts, and every ``generate`` of the attempt goes there (the harness opens a
session per attempt when its engine has ``session``). ``generate`` without a session goes to the least
loaded replica.

Replicas are in-process engines or clients of servers someone else runs (``LocalReplica``), ``albatross serve``
processes the pool started (``ProcessReplica``), or vLLM / SGLang servers it launched (``ServerReplica``, see
``engine/launch.py``). A supervisor thread checks them every ``check_s``; a replica process that died
(SIGKILL, OOM) is started again, loads the newest weights the pool was given, then serves new sessions.
Requests in flight on the dead process fail with ``EngineError`` after the HTTP client's retries; the
harness turns that into an infrastructure error and the attempt is re-run (on a live replica).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from albatross.config import EngineConfig
from albatross.engine.base import Completion, Engine, EngineError, EngineMetrics, SamplingParams, SingleEngine
from albatross.engine.remote import AlbatrossEngine, RemoteEngine, RemoteError, stop_server

URL_PREFIX = "albatross serve: "
Newest = Callable[[], tuple[str, int] | None]
"""The newest weights a (re)started replica must load: ``(directory, version)``, or None before any."""
E = TypeVar("E", bound=Engine)


class Replica(Protocol):
    """One engine of a pool, and the process behind it when the pool started one."""

    url: str  # the server's base URL ("" for an in-process engine)

    @property
    def engine(self) -> Engine | None:
        """The engine requests go to; None while the replica (re)starts."""
        ...

    @property
    def pid(self) -> int | None:
        """The server process this replica started, if any."""
        ...

    @property
    def start_timeout_s(self) -> float:
        """Seconds a start may take (0: never started by the pool)."""
        ...

    def exit_code(self) -> int | None:
        """The exit code of this replica's process once it exited, else None."""
        ...

    def alive(self) -> bool: ...

    def start(self, newest: Newest) -> None:
        """Start (again), load ``newest()``'s weights, then serve; ``EngineError`` when it cannot."""
        ...

    def close(self) -> None: ...


class LocalReplica:
    """An engine in this process (built-in or a client of a server someone else runs): never restarted."""

    pid: int | None = None
    start_timeout_s = 0.0

    def __init__(self, engine: Engine, url: str = "") -> None:
        self.engine: Engine | None = engine
        self.url = url  # the server's base URL when ``engine`` is a client of one

    def alive(self) -> bool:
        return True

    def exit_code(self) -> int | None:
        return None

    def start(self, newest: Newest) -> None:
        raise EngineError("an in-process replica cannot be restarted")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class _LaunchedReplica:
    """A server process this pool started (in its own process group), its log and its client."""

    stop_timeout_s = 10.0

    def __init__(self, log_path: str | Path, start_timeout_s: float) -> None:
        self.log_path, self.start_timeout_s = Path(log_path), start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.engine: RemoteEngine | None = None
        self.url = ""

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def _spawn(self, cmd: list[str], env: dict[str, str] | None = None) -> int:
        """Start ``cmd`` with its output appended to the log; the log's offset before it started."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            offset = log.tell()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return offset

    def _exited(self) -> EngineError:
        return EngineError(f"engine server exited with code {self.exit_code()} while starting; "
                           f"see {self.log_path}")

    def close(self) -> None:
        """Close the client, then stop the server's process group (by the pid this replica started)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.proc is not None:
            try:
                stop_server(self.proc, timeout=self.stop_timeout_s)
            except ProcessLookupError:  # its process group is gone already
                self.proc.wait()


class ProcessReplica(_LaunchedReplica):
    """``albatross serve MODEL_DIR`` in its own process (and process group), on a free loopback port, with the
    ``engine`` section's threads, batch size and start-up timeout."""

    def __init__(self, model_dir: str | Path, log_path: str | Path, ec: EngineConfig, version: int = 0) -> None:
        super().__init__(log_path, ec.start_timeout_s)
        self.model_dir = Path(model_dir)
        self.version, self.threads, self.max_batch_size = version, ec.threads, ec.max_batch_size

    def start(self, newest: Newest = lambda: None) -> None:
        """Start the server, load the weights ``newest()`` names (asked again if a version is pruned
        meanwhile), then serve: no session binds to this replica before its weights are current."""
        self.engine = None
        version = self.version
        offset = self._spawn([sys.executable, "-m", "albatross.cli", "serve", str(self.model_dir), "--port", "0",
                              "--weight-version", str(version), "--threads", str(self.threads),
                              "--max-batch-size", str(self.max_batch_size)])
        self.url = url = self._wait_url(offset)
        self.engine = load_newest(AlbatrossEngine(url, version=version, connect_timeout=30.0, retries=2), newest)

    def _wait_url(self, offset: int) -> str:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            with self.log_path.open("rb") as f:
                f.seek(offset)
                for line in f.read().decode(errors="replace").splitlines():
                    if line.startswith(URL_PREFIX) and " on http" in line:
                        return line.rsplit(" on ", 1)[1].strip()
            if not self.alive():
                raise self._exited()
            time.sleep(0.1)
        self.close()
        raise EngineError(f"engine server did not start within {self.start_timeout_s:.0f}s; see {self.log_path}")


def load_newest(engine: E, newest: Newest) -> E:
    """Load the weights ``newest()`` names into a freshly started server's client (asked again when a version is
    pruned meanwhile) and return the client; a replica takes no session before its weights are current."""
    last: Exception | None = None
    for _ in range(5):
        weights = newest()
        if weights is None or not weights[0]:  # nothing pushed yet, or pushed over NCCL (no directory)
            return engine
        try:
            engine.update_weights(*weights)
            return engine
        except (RemoteError, FileNotFoundError) as e:  # e.g. that version was pruned while the server started
            last = e
    engine.close()
    raise EngineError(f"the restarted replica could not load the newest weights: {last}")


def free_port() -> int:
    """A free TCP port on loopback (the server binds it a moment later)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerReplica(_LaunchedReplica):
    """A server this pool launches (vLLM, SGLang): ``command(port)`` in its own process group on a free loopback
    port, output appended to ``log_path``, reached through ``client(url)`` once it answers."""

    stop_timeout_s = 30.0

    def __init__(self, command: Callable[[int], list[str]], client: Callable[[str], RemoteEngine],
                 log_path: str | Path, env: dict[str, str] | None, start_timeout_s: float) -> None:
        super().__init__(log_path, start_timeout_s)
        self.command, self.client, self.env = command, client, env

    def start(self, newest: Newest = lambda: None) -> None:
        """Launch the server, wait until its client connects, load ``newest()``'s weights, then serve."""
        self.engine = None
        port = free_port()
        self._spawn(self.command(port), self.env)
        self.url = f"http://127.0.0.1:{port}"
        self.engine = load_newest(self._connect(), newest)

    def _connect(self) -> RemoteEngine:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if not self.alive():
                raise self._exited()
            try:
                return self.client(self.url)
            except RemoteError as e:
                if time.monotonic() > deadline:
                    self.close()
                    raise EngineError(f"engine server did not answer within {self.start_timeout_s:.0f}s ({e}); "
                                      f"see {self.log_path}") from None
                time.sleep(1.0)


class _Session(SingleEngine):
    """One attempt's handle: every call goes to the replica chosen when the session opened."""

    def __init__(self, pool: EnginePool, index: int) -> None:
        self.pool, self.index, self._open = pool, index, True

    @property
    def version(self) -> int:
        return self.pool.version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.pool._generate_on(self.index, prompts, params)

    def update_weights(self, path: str, version: int) -> None:
        self.pool.update_weights(path, version)

    def close(self) -> None:
        if self._open:
            self._open = False
            self.pool._release(self.index)

    def __enter__(self) -> _Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EnginePool:
    """Replicas behind one engine; ``restarts`` counts replica processes started again after dying."""

    def __init__(self, replicas: Sequence[Replica], version: int = 0, log: Callable[[str], None] = print,
                 check_s: float = 0.5, place_timeout_s: float = 300.0) -> None:
        if not replicas:
            raise ValueError("an engine pool needs at least one replica")
        self.replicas, self.version, self.log = list(replicas), version, log
        self.place_timeout_s = place_timeout_s
        self.weights: tuple[str, int] | None = None
        self.restarts = 0
        self.sessions = [0] * len(replicas)  # attempts bound to each replica now
        self.requests = [0] * len(replicas)
        self._applied: list[tuple[str, int] | None] = [None] * len(replicas)
        self._locks = [threading.Lock() for _ in replicas]  # held while a replica loads weights or restarts
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._stop = threading.Event()
        self.on_restart: Callable[[EnginePool], None] | None = None  # called after a replica restarted
        self._supervisor = threading.Thread(target=self._supervise, args=(check_s,), daemon=True,
                                            name="albatross-engine-supervisor")
        self._supervisor.start()

    @classmethod
    def of_processes(cls, model_dir: str | Path, ec: EngineConfig, log_dir: str | Path, version: int = 0,
                     log: Callable[[str], None] = print) -> EnginePool:
        """Start ``engine.replicas`` ``albatross serve`` processes of ``model_dir`` (logs in ``log_dir``)."""
        return cls.started([ProcessReplica(model_dir, Path(log_dir) / f"engine-{i}.log", ec, version)
                            for i in range(ec.replicas)], version, log)

    @classmethod
    def started(cls, replicas: Sequence[Replica], version: int = 0,
                log: Callable[[str], None] = print) -> EnginePool:
        """Start every replica (``ProcessReplica``, ``ServerReplica``) and pool them; on a failure the ones
        already started are stopped before the error propagates."""
        done: list[Replica] = []
        try:
            for r in replicas:
                r.start(lambda: None)
                done.append(r)
        except BaseException:
            for r in done:
                r.close()
            raise
        log(f"[engine] {len(replicas)} replica process(es): pids {[r.pid for r in done]}")
        return cls(done, version, log)

    # ---- placement ----------------------------------------------------------------------------------
    def session(self) -> _Session:
        """Bind a new attempt to the live replica with the fewest attempts (ties: round robin)."""
        deadline = time.monotonic() + self.place_timeout_s
        while True:
            with self._lock:
                live = [i for i, r in enumerate(self.replicas) if r.alive() and r.engine is not None]
                if live:
                    turn = next(self._turn)
                    n = len(self.replicas)
                    index = min(live, key=lambda i: (self.sessions[i], (i - turn) % n))
                    self.sessions[index] += 1
                    return _Session(self, index)
            if self._stop.is_set() or time.monotonic() > deadline:
                raise EngineError("no live engine replica")
            time.sleep(0.1)

    def _release(self, index: int) -> None:
        with self._lock:
            self.sessions[index] -= 1

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        with self.session() as s:
            return s.generate(prompts, params)

    def _generate_on(self, index: int, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        engine = self.replicas[index].engine
        if engine is None:
            raise EngineError(f"engine replica {index} is restarting")
        self.requests[index] += 1
        try:
            return engine.generate(prompts, params)
        except EngineError:
            raise
        except OSError as e:  # a connection torn down mid-read
            raise EngineError(f"engine replica {index}: {type(e).__name__}: {e}") from e

    # ---- weights and restarts -----------------------------------------------------------------------
    def update_weights(self, path: str, version: int) -> None:
        """Every live replica loads ``path``; one busy restarting loads it when its restart ends. An empty
        ``path``: the weights are in the servers already (``nccl`` transport); only the version label moves."""
        if not path:
            self.version = int(version)
            for r in self.replicas:
                if r.engine is not None:
                    r.engine.update_weights("", int(version))
            return
        self.weights, self.version = (str(path), int(version)), int(version)
        for i in range(len(self.replicas)):
            if self._locks[i].acquire(blocking=False):
                try:
                    self._sync(i)
                finally:
                    self._locks[i].release()

    def _sync(self, i: int) -> None:
        r, want = self.replicas[i], self.weights
        if want is None or self._applied[i] == want or not r.alive() or r.engine is None:
            return
        try:
            r.engine.update_weights(*want)
            self._applied[i] = want
        except EngineError as e:  # it died meanwhile: the supervisor restarts it with these weights
            self.log(f"[engine] replica {i} did not take version {want[1]}: {e}")

    def _supervise(self, check_s: float) -> None:
        while not self._stop.wait(check_s):
            for i, r in enumerate(self.replicas):
                with self._locks[i]:
                    if self._stop.is_set():
                        return
                    if not r.alive():
                        self._restart(i)
                    self._sync(i)

    def _restart(self, i: int) -> None:
        r = self.replicas[i]
        old = r.pid
        self.log(f"[engine] replica {i} (pid {old}) exited with code {r.exit_code()}; restarting it")
        r.close()
        loaded: list[tuple[str, int] | None] = [None]

        def newest() -> tuple[str, int] | None:
            loaded[0] = self.weights
            return loaded[0]

        try:
            r.start(newest)
        except EngineError as e:
            self.log(f"[engine] replica {i} failed to restart: {e}; trying again")
            r.close()
            return
        self._applied[i] = loaded[0]
        with self._lock:
            self.restarts += 1
        served = r.engine.version if r.engine is not None else self.version  # no weights pushed: its own
        at = loaded[0][1] if loaded[0] else served
        self.log(f"[engine] replica {i} restarted as pid {r.pid} at version {at}")
        if self.on_restart is not None:
            self.on_restart(self)

    @property
    def busy_seconds(self) -> float | None:
        """Forward-pass seconds summed over the replicas that measure them (a restarted replica counts from
        zero again); None when none does."""
        busy = [r.engine.busy_seconds for r in self.replicas if r.engine is not None and r.alive()]
        known = [float(b) for b in busy if b is not None]
        return sum(known) if known else None

    def urls(self) -> list[str]:
        """Base URLs of the replicas that are servers (empty strings for in-process ones)."""
        return [r.url for r in self.replicas]

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def metrics(self) -> EngineMetrics:
        """A pool measures nothing of its own (its replicas' servers answer ``/metrics`` themselves)."""
        return EngineMetrics()

    def pids(self) -> dict[str, int]:
        return {f"engine{i}": r.pid for i, r in enumerate(self.replicas) if r.pid is not None}

    def close(self) -> None:
        self._stop.set()
        # a restart under way finishes first (bounded by its start-up timeout), so nothing outlives us
        self._supervisor.join(timeout=max((r.start_timeout_s for r in self.replicas), default=0) + 30)
        for r in self.replicas:
            r.close()

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
