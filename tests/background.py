"""Slow self-contained commands of tests, started in the background when the session starts.

A test marked ``@pytest.mark.background([argv...])`` gets the result of that command from the ``background``
fixture. When the session starts (``conftest.py``), the command of every selected test so marked starts at the
lowest priority (nice 19): it runs on the CPU the tests before it leave idle, so its time overlaps theirs
instead of adding to the session, and it takes almost nothing from them when they need the CPU. It is detached
(its own session, adopted by init): no process of it is a descendant of the test process, which tests of what a
run leaves behind compare before and after. ``{dir}`` in an argument is a fresh temporary folder of the command's
own (its working directory unless ``cwd`` is given), removed when the session ends. A command whose program is
missing does not start (its test skips on its own, or fails saying so).

Only commands that touch nothing the other tests share belong here: no sandbox, cgroup, server or port, no time
budget that a busy machine could exhaust, nothing written outside ``{dir}``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# run by a short-lived child: fork, the child (adopted by init when the parent exits) starts a session, runs the
# command at nice 19 and writes its exit code last
_DETACHED = """
import os, subprocess, sys
folder, cwd, argv = sys.argv[1], sys.argv[2] or sys.argv[1], sys.argv[3:]
if os.fork():
    os._exit(0)
os.setsid()
os.nice(19)
with open(os.path.join(folder, ".stdout"), "w") as out, open(os.path.join(folder, ".stderr"), "w") as err:
    with open(os.path.join(folder, ".pgid"), "w") as f:
        f.write(str(os.getpid()))
    code = subprocess.run(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err).returncode
with open(os.path.join(folder, ".rc.tmp"), "w") as f:
    f.write(str(code))
os.replace(os.path.join(folder, ".rc.tmp"), os.path.join(folder, ".rc"))
"""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    dir: Path  # the command's folder: ``{dir}``


def _argv(command: list[str], folder: Path) -> list[str]:
    return [arg.replace("{dir}", str(folder)) for arg in command]


class Job:
    """One command running detached in the background, its output and exit code in files in its folder."""

    def __init__(self, command: list[str], cwd: Path | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="albatross-background-"))
        subprocess.run([sys.executable, "-c", _DETACHED, str(self.dir), str(cwd or ""), *_argv(command, self.dir)],
                       stdin=subprocess.DEVNULL, check=True)

    def result(self, timeout_s: float = 3600) -> Result:
        rc, deadline = self.dir / ".rc", time.monotonic() + timeout_s
        while not rc.exists():
            assert time.monotonic() < deadline, f"background command still running after {timeout_s:.0f}s"
            time.sleep(0.2)
        return Result(int(rc.read_text()), (self.dir / ".stdout").read_text(), (self.dir / ".stderr").read_text(),
                      self.dir)

    def close(self) -> None:
        """Stop the command if it still runs (its whole session), and remove its folder."""
        pgid, deadline = self.dir / ".pgid", time.monotonic() + 10
        while not pgid.exists() and time.monotonic() < deadline:  # a session that ends as it starts
            time.sleep(0.05)
        if pgid.exists() and not (self.dir / ".rc").exists():
            try:
                os.killpg(int(pgid.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


def startable(command: list[str]) -> bool:
    return shutil.which(command[0]) is not None
