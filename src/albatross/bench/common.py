"""Shared output of benchmarks: an aligned table on stdout and a JSON file."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30


def machine() -> dict[str, Any]:
    import os

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}


def print_table(title: str, rows: list[tuple[str, Any]]) -> None:
    width = max((len(k) for k, _ in rows), default=0)
    print(f"\n{title}\n" + "-" * (width + 16))
    for key, value in rows:
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")


def write_json(path: str | Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**data, "machine": machine()}, indent=2) + "\n")
    print(f"written: {path}")


def status_bytes(pid: int, field: str) -> int:
    """A memory field of /proc/PID/status (VmRSS: resident now, VmHWM: peak resident), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def run_watched(cmd: list[str], limit_gib: float | None, timeout_s: float, watch_rss: bool = True,
                poll_s: float = 0.1, oom_marker: str | None = None, tail_chars: int = 200,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a benchmark child that prints one JSON line last; with ``watch_rss``, kill it when its resident set
    passes ``limit_gib`` (None: no limit). ``status`` is ``ok`` (with the child's keys), ``over N GiB`` (also when ``oom_marker``
    is in its stderr), ``timed out after Ns`` or ``failed: <last stderr line>``. ``env``: added to the child's."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env} if env else None)
    over = threading.Event()

    def watch() -> None:
        while proc.poll() is None and watch_rss and limit_gib:
            try:
                if status_bytes(proc.pid, "VmRSS") > limit_gib * GIB:
                    over.set()
                    proc.kill()
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(poll_s)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"status": f"timed out after {timeout_s:.0f}s"}
    watcher.join()
    if over.is_set() or (oom_marker is not None and oom_marker in err):
        return {"status": f"over {limit_gib:g} GiB"}
    if proc.returncode != 0:
        return {"status": "failed: " + (err.strip().splitlines() or ["?"])[-1][:tail_chars]}
    return {"status": "ok", **json.loads(out.strip().splitlines()[-1])}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, int(round(q / 100 * len(ordered) + 0.5 - 1e-9)))
    return ordered[min(rank, len(ordered)) - 1]


def to_ms(seconds: float) -> float:
    """Seconds as milliseconds, rounded to the microsecond (the tables' unit)."""
    return round(seconds * 1000, 3)
