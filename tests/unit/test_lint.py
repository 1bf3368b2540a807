import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed (pip install -e '.[dev]')")
def test_ruff_clean():
    r = subprocess.run(["ruff", "check", "src", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("mypy") is None, reason="mypy not installed (pip install -e '.[dev]')")
@pytest.mark.background(["mypy", "--cache-dir", "{dir}/cache"], cwd=ROOT)
def test_mypy_strict_clean(background):
    """The type checker, strict on src/albatross as pyproject.toml configures it, on a cold cache, finds nothing
    (it runs while the session's other tests do: tests/background.py)."""
    r = background
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "Success: no issues found" in r.stdout
