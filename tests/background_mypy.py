"""The strict type check, started in the background when the session starts (``conftest.py``), so its minute on a
cold cache overlaps the slow tests' idle CPU instead of adding to the session; ``test_lint`` waits for its result.

It runs at a lower priority (nice 10), so it takes mostly the CPU the other tests leave idle. It starts only when
its test is selected; where it was not started the test's fixture runs the same command in the foreground."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_ID = "tests/unit/test_lint.py::test_mypy_strict_clean"


@dataclass
class MypyResult:
    returncode: int
    stdout: str
    stderr: str


class BackgroundMypy:
    """``mypy`` over the project (``pyproject.toml``'s files and settings) with a cache in a fresh temporary folder."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="albatross-mypy-"))
        self.out, self.err = open(self.dir / "stdout", "w+"), open(self.dir / "stderr", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(["mypy", "--cache-dir", str(self.dir / "cache")], cwd=ROOT, stdout=self.out,
                                     stderr=self.err, preexec_fn=lambda: os.nice(10))

    def result(self, timeout_s: float = 1800) -> MypyResult:
        code = self.proc.wait(timeout=timeout_s)
        self.out.seek(0)
        self.err.seek(0)
        return MypyResult(code, self.out.read(), self.err.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_mypy(cache_dir: Path) -> MypyResult:
    """The same check in the foreground."""
    r = subprocess.run(["mypy", "--cache-dir", str(cache_dir)], cwd=ROOT, capture_output=True, text=True)
    return MypyResult(r.returncode, r.stdout, r.stderr)
