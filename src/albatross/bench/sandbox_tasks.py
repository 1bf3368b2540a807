"""Sandbox at scale on real task images: ``albatross bench sandbox --tasks DIR --concurrent 256``.

Every task under DIR whose environment builds here is one image (tasks sharing an environment count
once); each attempt is forked with its task's own memory and storage limits. First ``concurrent``
attempts are forked and kept alive (the ramp, round-robin over the images); after ``settle_s`` seconds, with all of them alive,
``workers`` threads each repeatedly close one of their attempts and fork a fresh attempt of the same task
in its place (pausing ``pace_ms`` between forks: attempts end and start at the pace of a population of
long attempts), ``forks`` times in all: the fork latency under that population is the figure
(``fork()`` to the first byte of ``echo ok`` reaching the host). A fork that raises, or whose ``echo
ok`` answers anything else, is a failure. Images are built before the clock starts (once per machine
with the layer cache). The machine's load average is recorded with the figures.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albatross.bench.common import percentile, print_table, to_ms, write_json


@dataclass
class _Image:
    task: Any  # tasks.format.Task
    limits: Any  # sandbox.base.Limits: the task's own memory and storage


@dataclass
class _Figures:
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, seconds: float | None, failure: str = "") -> None:
        with self.lock:
            if failure:
                self.failures.append(failure)
            elif seconds is not None:
                self.latencies.append(seconds)


def _fork_one(backend: Any, image: _Image, figures: _Figures) -> Any:
    """Fork an attempt of ``image``, run ``echo ok``; the attempt, or None when it failed (counted)."""
    start = time.perf_counter()
    try:
        attempt = backend.fork(image.task.env_dir, image.task.workdir, image.limits)
    except Exception as err:  # noqa: BLE001 - a benchmark counts failures, it does not stop on them
        figures.add(None, f"fork {image.task.id}: {err}")
        return None
    try:
        out = attempt.exec("echo ok").output
    except Exception as err:  # noqa: BLE001
        out = f"raised {err}"
    if out != "ok\n":
        figures.add(None, f"{image.task.id}: echo ok gave {out[:100]!r}")
        attempt.close()
        return None
    figures.add((attempt.first_output_at or time.perf_counter()) - start)
    return attempt


def images_of(backend: Any, dirs: list[str], log: Any = print) -> list[_Image]:
    """One image per distinct environment among the tasks under ``dirs`` that build here (built now if
    the layer cache does not have them), with the task's own limits."""
    from albatross.sandbox.base import Limits
    from albatross.tasks.buildable import dockerfile_problem
    from albatross.tasks.format import load_tasks

    found: dict[str, _Image] = {}
    task_dirs: list[str | Path] = list(dirs)
    for task in load_tasks(task_dirs):
        if dockerfile_problem(task):
            continue
        try:
            key = backend.prepare(task.env_dir, "none", task.build_timeout_s).key
        except Exception as err:  # noqa: BLE001 - a task that does not build is left out, said so
            log(f"[bench] {task.id}: left out, its environment does not build here ({str(err).splitlines()[0]})")
            continue
        if key not in found:
            limits = Limits(memory_mb=task.memory_mb, disk_mb=task.storage_mb, pids=256, command_timeout_s=60.0)
            found[key] = _Image(task, limits)
    return list(found.values())


def run_tasks(args: argparse.Namespace) -> dict[str, Any]:
    from albatross.errors import UserError
    from albatross.sandbox.local import LocalBackend, local_available, unavailable_reason

    if not local_available():
        raise UserError(f"bench sandbox needs the local sandbox: {unavailable_reason()}")
    for name, value, least in (("--concurrent", args.concurrent, 1), ("--forks", args.forks, 1),
                               ("--workers", args.workers, 1), ("--min-images", args.min_images, 1),
                               ("--pace-ms", args.pace_ms, 0), ("--settle-s", args.settle_s, 0)):
        if value < least:
            raise UserError(f"{name} must be at least {least}, got {value}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # two descriptors per live attempt, and more
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 16 * args.concurrent + 1024)), hard))
    backend = LocalBackend(warm=args.warm, layer_cache=True, warm_envs=64)
    try:
        images = images_of(backend, args.tasks)
        if len(images) < args.min_images:
            raise UserError(f"{' '.join(args.tasks)}: {len(images)} task images build here, fewer than "
                            f"--min-images {args.min_images}")
        result = _measure(backend, images, args)
    finally:
        backend.close()
    _report(result)
    write_json(args.json, result)
    return result


def _measure(backend: Any, images: list[_Image], args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"tasks": [i.task.id for i in images], "images": len(images),
                              "concurrent": args.concurrent, "forks": args.forks, "workers": args.workers,
                              "pace_ms": args.pace_ms, "settle_s": args.settle_s,
                              "warm": args.warm, "memory_mb": sorted({i.limits.memory_mb for i in images}),
                              "load_avg_before": list(os.getloadavg())}
    slots: list[tuple[_Image, Any]] = []
    ramp = _Figures()
    start = time.perf_counter()
    lock = threading.Lock()

    def ramp_worker(offset: int) -> None:
        for n in range(offset, args.concurrent, args.workers):
            image = images[n % len(images)]
            attempt = _fork_one(backend, image, ramp)
            if attempt is not None:
                with lock:
                    slots.append((image, attempt))

    _threads([lambda k=k: ramp_worker(k) for k in range(args.workers)])
    result["ramp_s"] = round(time.perf_counter() - start, 2)
    result["alive_after_ramp"] = len(slots)
    time.sleep(args.settle_s)  # the population lives a while before attempts end: the warm pools fill
    steady = _Figures()
    alive = {"now": len(slots), "min": len(slots)}
    per_worker = [slots[k::args.workers] for k in range(args.workers)]
    quota = [args.forks // args.workers + (k < args.forks % args.workers) for k in range(args.workers)]

    def steady_worker(k: int) -> None:
        mine, rng = per_worker[k], random.Random(k)
        for _ in range(quota[k]):
            if not mine:
                return
            index = rng.randrange(len(mine))
            image, attempt = mine[index]
            attempt.close()
            with lock:
                alive["now"] -= 1
                alive["min"] = min(alive["min"], alive["now"])
            fresh = _fork_one(backend, image, steady)
            if fresh is None:
                mine.pop(index)
                continue
            mine[index] = (image, fresh)
            with lock:
                alive["now"] += 1
            if args.pace_ms:
                time.sleep(args.pace_ms / 1000)

    start = time.perf_counter()
    _threads([lambda k=k: steady_worker(k) for k in range(args.workers)])
    wall = time.perf_counter() - start
    for mine in per_worker:
        for _image, attempt in mine:
            attempt.close()
    result.update(
        fork_ms_p50=to_ms(percentile(steady.latencies, 50)), fork_ms_p99=to_ms(percentile(steady.latencies, 99)),
        fork_ms_max=to_ms(max(steady.latencies, default=float("nan"))),
        forks_over_50ms=sum(x > 0.05 for x in steady.latencies),
        ramp_fork_ms_p50=to_ms(percentile(ramp.latencies, 50)), ramp_fork_ms_p99=to_ms(percentile(ramp.latencies, 99)),
        forks_per_s=round(len(steady.latencies) / wall, 2) if wall > 0 else 0.0,
        failures=len(ramp.failures) + len(steady.failures), failure_examples=(ramp.failures + steady.failures)[:5],
        alive_min=alive["min"], load_avg_after=list(os.getloadavg()))
    return result


def _threads(targets: list[Any]) -> None:
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _report(result: dict[str, Any]) -> None:
    rows: list[tuple[str, Any]] = [
        ("images (distinct task environments)", result["images"]),
        ("memory limits (MiB)", ", ".join(str(m) for m in result["memory_mb"])),
        ("attempts alive after the ramp", result["alive_after_ramp"]),
        ("fewest alive while forking", result["alive_min"]),
        ("fork to first output p50 (ms)", result["fork_ms_p50"]),
        ("fork to first output p99 (ms)", result["fork_ms_p99"]),
        ("fork to first output max (ms)", result["fork_ms_max"]),
        ("forks over 50 ms", result["forks_over_50ms"]),
        ("ramp fork p50 / p99 (ms)", f"{result['ramp_fork_ms_p50']} / {result['ramp_fork_ms_p99']}"),
        ("forks/s while full", result["forks_per_s"]),
        ("failures", result["failures"]),
        ("load average before / after", f"{result['load_avg_before'][0]:.2f} / {result['load_avg_after'][0]:.2f}"),
    ]
    print_table(f"albatross bench sandbox --tasks ({result['concurrent']} concurrent, {result['forks']} forks, "
                f"{result['workers']} workers)", rows)
    for line in result["failure_examples"]:
        print(f"  failure: {line}")


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", nargs="+", metavar="DIR", help="real task directories (or folders of them): "
                        "measure forks of their images with this many attempts alive (--concurrent)")
    parser.add_argument("--concurrent", type=int, default=256, help="with --tasks: attempts kept alive")
    parser.add_argument("--workers", type=int, default=8, help="with --tasks: threads that close and fork")
    parser.add_argument("--min-images", type=int, default=10, help="with --tasks: fewest distinct task "
                        "images to measure across")
    parser.add_argument("--pace-ms", type=float, default=500.0, help="with --tasks: pause of each worker "
                        "between forks (default 500: 8 workers fork up to 16 attempts a second, the turnover of 256 "
                        "attempts of 16 s each)")
    parser.add_argument("--settle-s", type=float, default=10.0, help="with --tasks: seconds the full population "
                        "lives before the forks are measured (default 10)")


def tasks_requested(args: argparse.Namespace) -> bool:
    return bool(args.tasks)

