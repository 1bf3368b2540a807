"""Runs a repository's tests inside an attempt (copied in as ``albatross_swe_run.py``, next to the plugin
``albatross_swe.py``). Standard library only, run by the image's python. Two modes:

``jobs JOBS.json OUT.json`` (the generator): for each job, write its files into the repository (a mutant), run
pytest on its test files (only the tests it names, when it names them) with a time limit, put the original files
back, and record every test's outcome.

``verify CONFIG.json`` (a task's verifier, ``tests/test.sh``): put the pristine test files back (the task's
``pristine.tar``: the repository's tests and pytest configuration as the task was made), remove any other file
of a test directory, any other ``conftest.py``, any ``sitecustomize.py`` and every ``__pycache__``, run the task's
test files once, and write
``/logs/verifier/reward.json``: ``fail_to_pass::<test>`` 1 or 0 for every FAIL_TO_PASS test and
``pass_to_pass::<test>`` 0 for every PASS_TO_PASS test that did not pass (the ones that pass are left out: they
pass untouched, so they weigh nothing in partial credit, and a broken one costs credit and success).

Both run pytest the same way (``pytest_argv``): ``python -s [-P] -m pytest -p albatross_swe -p no:cacheprovider
-p no:randomly --continue-on-collection-errors --rootdir REPO -c CONFIG``, from the repository, with no byte-code
written (a test module that fails to collect is a failed ``<path>::collect``; the other modules still run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REWARD_DIR = "/logs/verifier"


def pytest_argv(config_file: str, repo: str, tests: list[str], extra: list[str]) -> list[str]:
    flags = ["-s", "-P"] if sys.version_info >= (3, 11) else ["-s"]
    return [sys.executable, *flags, "-m", "pytest", "-p", "albatross_swe", "-p", "no:cacheprovider",
            "-p", "no:randomly", "--continue-on-collection-errors", "--rootdir", repo, "-c", config_file, "-q",
            *extra, *tests]


def run_pytest(repo: str, config_file: str, tests: list[str], extra: list[str], timeout: float,
               trace: str | None = None, only: list[str] | None = None) -> dict[str, Any]:
    """One pytest run; returns the plugin's results plus ``status`` (ok, timeout, no-results) and ``seconds``.
    ``only``: the test ids to run of those collected (the plugin deselects the others)."""
    fd, out = tempfile.mkstemp(prefix="albatross-swe-", suffix=".json")
    os.close(fd)
    os.unlink(out)
    env = dict(os.environ, ALBATROSS_SWE_RESULTS=out, PYTHONPATH=HERE, PYTHONDONTWRITEBYTECODE="1")
    for name in ("ALBATROSS_SWE_TRACE", "ALBATROSS_SWE_ONLY"):
        env.pop(name, None)
    if trace:
        env["ALBATROSS_SWE_TRACE"] = trace
    if only is not None:
        env["ALBATROSS_SWE_ONLY"] = out + ".only"
        with open(env["ALBATROSS_SWE_ONLY"], "w", encoding="utf-8") as f:
            json.dump(only, f)
    start = time.monotonic()
    proc = subprocess.Popen(pytest_argv(config_file, repo, tests, extra), cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        status = "ok"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = "timeout"
    result: dict[str, Any] = {"tests": {}, "failures": {}}
    try:
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        status = "no-results" if status == "ok" else status
    finally:
        for path in (out, out + ".only"):
            if os.path.exists(path):
                os.unlink(path)
    result.update(status=status, seconds=round(time.monotonic() - start, 3), returncode=proc.returncode,
                  output=output.decode("utf-8", "replace")[-3000:])
    return result


# ---- jobs (the generator) ---------------------------------------------------------------------------


def _write(repo: str, rel: str, content: str | None) -> None:
    path = os.path.join(repo, rel)
    if content is None:
        if os.path.exists(path):
            os.unlink(path)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(content)


def run_jobs(spec_path: str, out_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    repo, config_file, extra = spec["repo"], spec["config_file"], spec.get("pytest_args", [])
    results = []
    for job in spec["jobs"]:
        originals = {}
        for rel in job.get("files", {}):
            path = os.path.join(repo, rel)
            originals[rel] = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        try:
            for rel, content in job.get("files", {}).items():
                _write(repo, rel, content)
            result = run_pytest(repo, config_file, job["tests"], extra, float(job["timeout"]), job.get("trace"),
                                job.get("only"))
        finally:
            for rel, content in originals.items():
                _write(repo, rel, content)
        result["id"] = job["id"]
        results.append(result)
        tmp = out_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(results, f)
        os.replace(tmp, out_path)


# ---- verify (a task's verifier) -------------------------------------------------------------------


def _inside(repo: str, rel: str) -> str | None:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    path = repo
    for part in parts[:-1]:  # no directory on the way may be a link (it could lead out of the repository)
        path = os.path.join(path, part)
        if os.path.islink(path) or (os.path.exists(path) and not os.path.isdir(path)):
            os.unlink(path)
        os.makedirs(path, exist_ok=True)
    return os.path.join(path, parts[-1])


def restore(repo: str, archive: str) -> list[str]:
    """Write every regular file of ``archive`` into ``repo`` (whatever is at its path goes first)."""
    written = []
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            path = _inside(repo, member.name)
            if path is None:
                continue
            if os.path.islink(path) or os.path.isfile(path):
                os.unlink(path)
            elif os.path.isdir(path):
                shutil.rmtree(path)
            source = tar.extractfile(member)  # a regular member: never None
            with open(path, "wb") as f:
                f.write(source.read() if source is not None else b"")
            os.chmod(path, 0o644)
            written.append(member.name)
    return written


_STARTUP = ("sitecustomize.py", "usercustomize.py")  # imported at start-up from any directory on sys.path


def clean(repo: str, keep: set[str], test_dirs: list[str]) -> None:
    """Leave the tests as the task made them: remove every file of a test directory (``test_dirs``) and every
    ``conftest.py`` that is not in ``keep`` (the pristine files), every ``sitecustomize.py`` /
    ``usercustomize.py``, and every ``__pycache__`` and ``.pytest_cache``. Links are removed, never followed."""
    inside = tuple(d.rstrip("/") + "/" for d in test_dirs)
    for top, dirs, files in os.walk(repo):
        for d in list(dirs):
            full = os.path.join(top, d)
            if d in ("__pycache__", ".pytest_cache") or os.path.islink(full):
                os.unlink(full) if os.path.islink(full) else shutil.rmtree(full, ignore_errors=True)
                dirs.remove(d)
        for name in files:
            rel = os.path.relpath(os.path.join(top, name), repo)
            foreign = rel not in keep and (name == "conftest.py" or rel.startswith(inside))
            if foreign or name in _STARTUP:
                os.unlink(os.path.join(top, name))


def reward(config: dict[str, Any], outcomes: dict[str, str]) -> dict[str, float]:
    out = {f"fail_to_pass::{t}": 1.0 if outcomes.get(t) == "passed" else 0.0 for t in config["fail_to_pass"]}
    out.update({f"pass_to_pass::{t}": 0.0 for t in config["pass_to_pass"] if outcomes.get(t) != "passed"})
    return out


def verify(config_path: str) -> None:
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    repo = config["repo"]
    os.makedirs(REWARD_DIR, exist_ok=True)
    outcomes: dict[str, str] = {}
    try:
        kept = restore(repo, os.path.join(os.path.dirname(config_path), config["pristine"]))
        clean(repo, set(kept), config.get("test_dirs", []))
        config_file = config["config_file"]
        if not os.path.isabs(config_file):
            config_file = os.path.join(os.path.dirname(config_path), config_file)
        result = run_pytest(repo, config_file, config["tests"], config.get("pytest_args", []),
                            float(config["timeout"]))
        outcomes = result.get("tests", {})
        print(result.get("output", ""))
        print(f"[verifier] pytest {result['status']} in {result['seconds']} s")
    finally:
        values = reward(config, outcomes)
        tmp = os.path.join(REWARD_DIR, "reward.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(values, f, indent=1)
        os.replace(tmp, os.path.join(REWARD_DIR, "reward.json"))
        passed = sum(1 for k, v in values.items() if k.startswith("fail_to_pass::") and v == 1.0)
        print(f"[verifier] FAIL_TO_PASS {passed}/{len(config['fail_to_pass'])}, PASS_TO_PASS broken "
              f"{sum(1 for k in values if k.startswith('pass_to_pass::'))}/{len(config['pass_to_pass'])}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "jobs":
        run_jobs(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "verify":
        verify(sys.argv[2])
    else:
        sys.exit("usage: albatross_swe_run.py jobs JOBS.json OUT.json | verify CONFIG.json")
