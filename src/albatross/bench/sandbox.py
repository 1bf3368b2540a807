"""Sandbox: fork-to-first-output and close latency, forks/s at 1, 8 and 64 attempts alive, vs sh -c
(``--tasks DIR --concurrent N``: forks of real task images with N attempts alive, ``sandbox_tasks.py``).

Every fork is of a real task parent (a Dockerfile with WORKDIR and COPY, built once) and runs
``echo ok`` in the fresh attempt, one after the other. Fork-to-first-output runs from ``fork()`` to the
first byte of ``ok`` reaching the host; fork-to-command-end to ``exec`` returning (the command has
exited and the holder has reported it). Close is ``close()`` returning with every process, mount and
cgroup of the attempt gone. Throughput runs N threads that each fork, run ``echo ok``, wait until all N
attempts are alive at once, close, and start over; any exception or wrong output counts as a failure.
The reference is ``sh -c 'echo ok'`` spawned and read the same way, unsandboxed. The machine's load
average is recorded with the figures: on a shared machine they move with it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albatross.bench.common import percentile, print_table, to_ms, write_json

ENV_DOCKERFILE = "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY data/ /app/\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--forks", type=int, default=300, help="forks for the latency figures (>= 200)")
    parser.add_argument("--concurrency", default="1,8,64", help="attempts alive at once, comma-separated")
    parser.add_argument("--per-level", type=int, default=192, help="forks per concurrency level")
    parser.add_argument("--warm", type=int, default=3, help="attempts kept ready per environment")
    parser.add_argument("--base", choices=["image", "debian", "host"], default="image",
                        help="base root: the Dockerfile's FROM image (default), debian, or the host's own root")
    from albatross.bench.sandbox_tasks import add_task_arguments

    add_task_arguments(parser)


def measure_sh(n: int) -> list[float]:
    """Seconds to spawn ``sh -c 'echo ok'`` and read its output, n times."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        proc = subprocess.run(["sh", "-c", "echo ok"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        out.append(time.perf_counter() - start)
        assert proc.stdout == b"ok\n"
    return out


@dataclass
class ForkTimes:
    first_output: list[float] = field(default_factory=list)  # fork() to the first byte of output
    done: list[float] = field(default_factory=list)  # fork() to exec() returning (command ended)
    close: list[float] = field(default_factory=list)
    failures: int = 0


def measure_forks(backend: Any, env_dir: Path, n: int) -> ForkTimes:
    """Seconds from fork to first output and to the end of ``echo ok``, and of close, n times in a row."""
    times = ForkTimes()
    for _ in range(n):
        start = time.perf_counter()
        try:
            attempt = backend.fork(env_dir)
        except Exception:  # noqa: BLE001 - a benchmark counts failures, it does not stop on them
            times.failures += 1
            continue
        try:
            ok = attempt.exec("echo ok").output == "ok\n"
            times.done.append(time.perf_counter() - start)
            times.first_output.append((attempt.first_output_at or time.perf_counter()) - start)
        except Exception:  # noqa: BLE001
            ok = False
        times.failures += not ok
        start = time.perf_counter()
        attempt.close()
        times.close.append(time.perf_counter() - start)
    return times


def measure_concurrent(backend: Any, env_dir: Path, workers: int, total: int) -> tuple[float, int, int]:
    """(forks per second, failures, most attempts alive at once): ``workers`` threads each fork, run
    ``echo ok``, wait until every other thread has done the same (all attempts alive at once), close,
    and start over, for ``total`` forks in all."""
    rounds = max(1, total // workers)
    barrier = threading.Barrier(workers)
    lock = threading.Lock()
    state = {"failures": 0, "alive": 0, "peak": 0}

    def one_round() -> None:
        attempt = None
        try:
            attempt = backend.fork(env_dir)
            ok = attempt.exec("echo ok").output == "ok\n"
        except Exception:  # noqa: BLE001 - a benchmark counts failures, it does not stop on them
            ok = False
        with lock:
            state["failures"] += not ok
            state["alive"] += attempt is not None
            state["peak"] = max(state["peak"], state["alive"])
        barrier.wait()
        if attempt is not None:
            attempt.close()
            with lock:
                state["alive"] -= 1
        barrier.wait()

    def loop() -> None:
        for _ in range(rounds):
            one_round()

    threads = [threading.Thread(target=loop) for _ in range(workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return rounds * workers / wall, state["failures"], state["peak"]


def _make_env(root: Path) -> Path:
    env = root / "task" / "environment"
    (env / "data").mkdir(parents=True)
    (env / "data" / "hello.txt").write_text("hello\n")
    (env / "Dockerfile").write_text(ENV_DOCKERFILE)
    return env


def run(args: argparse.Namespace) -> dict[str, Any]:
    from albatross.bench.sandbox_tasks import run_tasks, tasks_requested
    from albatross.errors import UserError
    from albatross.sandbox.local import LocalBackend, local_available, unavailable_reason, userns_available

    if tasks_requested(args):
        return run_tasks(args)

    if not local_available():
        raise UserError(f"bench sandbox needs the local sandbox: {unavailable_reason()}")
    try:
        levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--concurrency {args.concurrency!r}: comma-separated whole numbers") from None
    for name, value, least in (("--forks", args.forks, 1), ("--per-level", args.per_level, 1),
                               ("--warm", args.warm, 0), ("--concurrency", min(levels, default=0), 1)):
        if value < least:
            raise UserError(f"{name} must be at least {least}, got {value}")
    result: dict[str, Any] = {"forks": args.forks, "warm": args.warm, "base": args.base,
                              "userns": userns_available(), "load_avg_before": os.getloadavg()[0]}
    sh = measure_sh(args.forks)
    result.update(sh_ms_p50=to_ms(percentile(sh, 50)), sh_ms_p99=to_ms(percentile(sh, 99)))
    with tempfile.TemporaryDirectory(prefix="albatross-bench-") as tmp:
        env_dir = _make_env(Path(tmp))
        backend = LocalBackend(warm=args.warm, base=args.base, hide_paths=[tmp])
        try:
            start = time.perf_counter()
            backend.prepare(env_dir)
            result["parent_build_ms"] = to_ms(time.perf_counter() - start)
            _fill(result, backend, env_dir, args.forks, levels, args.per_level)
        finally:
            backend.close()
    result["load_avg_after"] = os.getloadavg()[0]
    _report(result, levels)
    write_json(args.json, result)
    return result


def _fill(result: dict[str, Any], backend: Any, env_dir: Path, n: int, levels: list[int], per_level: int
          ) -> None:
    measure_forks(backend, env_dir, 5)  # warm up: parent built, pool filled
    times = measure_forks(backend, env_dir, n)
    result.update(
        fork_ms_p50=to_ms(percentile(times.first_output, 50)), fork_ms_p99=to_ms(percentile(times.first_output, 99)),
        fork_ms_mean=to_ms(sum(times.first_output) / max(1, len(times.first_output))),
        fork_done_ms_p50=to_ms(percentile(times.done, 50)), fork_done_ms_p99=to_ms(percentile(times.done, 99)),
        close_ms_p50=to_ms(percentile(times.close, 50)), close_ms_p99=to_ms(percentile(times.close, 99)),
        sequential_failures=times.failures,
    )
    for workers in levels:
        rate, failed, peak = measure_concurrent(backend, env_dir, workers, max(per_level, workers))
        result[f"forks_per_s_{workers}"] = round(rate, 2)
        result[f"concurrent_{workers}_failures"] = failed
        result[f"concurrent_{workers}_peak_alive"] = peak


def _report(result: dict[str, Any], levels: list[int]) -> None:
    rows: list[tuple[str, Any]] = [
        ("fork to first output p50 (ms)", result["fork_ms_p50"]),
        ("fork to first output p99 (ms)", result["fork_ms_p99"]),
        ("fork to command end p50 (ms)", result["fork_done_ms_p50"]),
        ("fork to command end p99 (ms)", result["fork_done_ms_p99"]),
        ("close p50 (ms)", result["close_ms_p50"]),
        ("close p99 (ms)", result["close_ms_p99"]),
        ("sh -c 'echo ok' p50 (ms)", result["sh_ms_p50"]),
        ("sh -c 'echo ok' p99 (ms)", result["sh_ms_p99"]),
    ]
    for workers in levels:
        rows.append((f"forks/s with {workers} alive", result[f"forks_per_s_{workers}"]))
        rows.append((f"failures with {workers} alive", result[f"concurrent_{workers}_failures"]))
    rows += [("user namespace", result["userns"]), ("load average before", round(result["load_avg_before"], 2))]
    print_table(f"albatross bench sandbox ({result['forks']} forks, warm {result['warm']}, "
                f"base {result['base']})", rows)
