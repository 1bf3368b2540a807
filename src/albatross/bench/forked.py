"""Benchmark children forked from one process that imported the heavy modules once (``--quick`` runs).

A fresh ``python`` spends most of a quick child's life importing torch and transformers (6-7 s of a 10 s row
of ``bench trainer --study --quick`` on a 2-core CPU) before it measures anything. ``run_forked`` forks each child
from multiprocessing's fork server instead, a single-threaded process that imported ``preload`` once and ran no
torch operation, so every child is still a new process with its own fresh model, threads and peak resident set
(its ``VmHWM`` starts at what the server's imports hold, as a fresh process's starts at what its own imports hold).
It answers as ``bench.common.run_watched`` does, for children that need no limit on their resident set.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def _serve(target: Callable[[dict[str, Any]], dict[str, Any]], spec: dict[str, Any], conn: Any) -> None:
    """In the child: ``target(spec)``, sent back as ``("ok", result)`` or ``("failed", last line of the error)``."""
    try:
        conn.send(("ok", target(spec)))
    except BaseException as e:  # the parent reports it; the child exits either way
        conn.send(("failed", f"{type(e).__name__}: {e}".strip().splitlines()[-1]))
    finally:
        conn.close()


def run_forked(target: Callable[[dict[str, Any]], dict[str, Any]], spec: dict[str, Any], timeout_s: float,
               preload: list[str], tail_chars: int = 200) -> dict[str, Any]:
    """``target(spec)`` (a module-level function) in a child forked from the fork server, which imports
    ``preload`` when it starts (the first call). ``status``: ``ok`` (with the result's keys), ``timed out after
    Ns`` or ``failed: <the error>``."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_serve, args=(target, spec, send), daemon=True)
    proc.start()
    send.close()
    try:
        answer = _answer(recv, proc, time.monotonic() + timeout_s)
    finally:
        recv.close()
        if proc.is_alive():
            proc.kill()
        proc.join()
    if answer is None:
        return {"status": f"timed out after {timeout_s:.0f}s"}
    kind, value = answer
    if kind == "ok":
        return {"status": "ok", **value}
    return {"status": "failed: " + value[:tail_chars]}


def _answer(recv: Any, proc: Any, deadline: float) -> tuple[str, Any] | None:
    """The child's answer, ``("failed", ...)`` when it died without one, None past ``deadline``."""
    while time.monotonic() < deadline:
        if recv.poll(min(1.0, max(deadline - time.monotonic(), 0.0))):
            try:
                answer: tuple[str, Any] = recv.recv()
                return answer
            except EOFError:
                proc.join(10)
                return ("failed", f"the child died without an answer (exit code {proc.exitcode})")
    return None
