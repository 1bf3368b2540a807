"""Slow self-contained commands of tests, started in the background when the session starts.

A test marked ``@pytest.mark.background([argv...])`` gets the result of that command from the ``background``
fixture. When the session starts (``conftest.py``), the command of every selected test so marked starts at the
lowest priority (nice 19): it runs on the CPU the tests before it leave idle, so its time overlaps theirs
instead of adding to the session, and it takes almost nothing from them when they need the CPU. Where it was
not started (its program missing, ``--collect-only``) the fixture runs it then. ``{dir}`` in an argument is a
fresh temporary folder of the command's own (its working directory), removed when the session ends.

Only commands that touch nothing the other tests share belong here: no sandbox, cgroup, server or port, no time
budget that a busy machine could exhaust, nothing written outside ``{dir}``. ``cwd``: where it runs instead of
``{dir}``."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    dir: Path  # the command's folder: ``{dir}``


def _argv(command: list[str], folder: Path) -> list[str]:
    return [arg.replace("{dir}", str(folder)) for arg in command]


class Job:
    """One command running in the background, its output in files in its folder."""

    def __init__(self, command: list[str], cwd: Path | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="albatross-background-"))
        self._out = open(self.dir / ".stdout", "w+")  # noqa: SIM115 - read back and closed in result/close
        self._err = open(self.dir / ".stderr", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(_argv(command, self.dir), cwd=cwd or self.dir, stdout=self._out,
                                     stderr=self._err, preexec_fn=lambda: os.nice(19))

    def result(self, timeout_s: float = 3600) -> Result:
        code = self.proc.wait(timeout=timeout_s)
        self._out.seek(0)
        self._err.seek(0)
        return Result(code, self._out.read(), self._err.read(), self.dir)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._err.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def startable(command: list[str]) -> bool:
    return shutil.which(command[0]) is not None


def run_now(command: list[str], folder: Path, cwd: Path | None = None) -> Result:
    """The same command in the foreground, ``{dir}`` being ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(_argv(command, folder), cwd=cwd or folder, capture_output=True, text=True, timeout=3600)
    return Result(r.returncode, r.stdout, r.stderr, folder)
