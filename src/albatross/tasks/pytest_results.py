"""A pytest plugin that records per-test results (copied into the offline toolkit as ``albatross_pytest``).

Loaded with ``-p albatross_pytest`` by the toolkit's ``uvx``/``uv run``/``pytest`` shims. It writes

- ``$ALBATROSS_TEST_RESULTS`` (when set): ``{"tests": [{"name": nodeid, "status": ...}]}``, merged with
  what earlier pytest runs of the same verification wrote, and
- ``--ctrf PATH``: a Common Test Report Format file, the option that ``pytest-json-ctrf`` adds and
  Terminal-Bench 2 verifiers pass (when that plugin is installed, it keeps the option).

A status is ``passed``, ``failed`` or ``skipped``; a collection error is a failed ``<path>::collect``.
Standard library only: it runs on the sandbox's python.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

RESULTS_ENV = "ALBATROSS_TEST_RESULTS"


class Recorder:
    def __init__(self, ctrf_path: str | None) -> None:
        self.ctrf_path = ctrf_path
        self.status: dict[str, str] = {}
        self.duration: dict[str, float] = {}
        self.start = time.time()

    def pytest_runtest_logreport(self, report: Any) -> None:
        name = report.nodeid
        self.duration[name] = self.duration.get(name, 0.0) + float(getattr(report, "duration", 0.0))  # pytest's report
        if report.failed:
            self.status[name] = "failed"
        elif report.skipped and self.status.get(name) != "failed":
            self.status[name] = "skipped"
        elif report.when == "call" and name not in self.status:
            self.status[name] = "passed"

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.status[f"{report.nodeid or 'session'}::collect"] = "failed"

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        tests = [{"name": n, "status": s, "duration": round(self.duration.get(n, 0.0) * 1000)}
                 for n, s in self.status.items()]
        path = os.environ.get(RESULTS_ENV)
        if path:
            _write(path, {"tests": _merge(_read_tests(path), tests)})
        if self.ctrf_path:
            _write(self.ctrf_path, _ctrf(tests, self.start))


def _merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_name = {t["name"]: t for t in old}
    by_name.update({t["name"]: t for t in new})
    return list(by_name.values())


def _read_tests(path: str) -> list[dict[str, Any]]:
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        with open(path, encoding="utf-8") as f:
            return list(json.load(f)["tests"])
    return []


def _ctrf(tests: list[dict[str, Any]], start: float) -> dict[str, Any]:
    summary = {"tests": len(tests), "pending": 0, "other": 0,
               "start": int(start * 1000), "stop": int(time.time() * 1000)}
    for status in ("passed", "failed", "skipped"):
        summary[status] = sum(t["status"] == status for t in tests)
    return {"results": {"tool": {"name": "pytest"}, "summary": summary, "tests": tests}}


def _write(path: str, data: dict[str, Any]) -> None:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)


def pytest_addoption(parser: Any) -> None:
    if _has_ctrf_plugin():  # pytest-json-ctrf is installed (test.sh's own pip install): it owns --ctrf
        return
    with contextlib.suppress(ValueError):  # it registered --ctrf before this plugin
        parser.getgroup("albatross").addoption(
            "--ctrf", dest="albatross_ctrf", default=None, metavar="PATH",
            help="write a CTRF JSON report of the test results to PATH")


def pytest_configure(config: Any) -> None:
    ctrf = getattr(config.option, "albatross_ctrf", None)  # pytest's options: absent when not registered
    config.pluginmanager.register(Recorder(ctrf), "albatross-recorder")


def _has_ctrf_plugin() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("pytest-json-ctrf")
    except metadata.PackageNotFoundError:
        return False
    return True
