"""A pytest plugin for repository tasks (copied into attempts as ``albatross_swe.py``; loaded with
``-p albatross_swe``). Standard library only: it runs on the image's python, under the project's own pytest.

It writes ``$ALBATROSS_SWE_RESULTS`` (JSON): every test's outcome (``passed``, ``failed`` or ``skipped``; an error
in set-up or tear-down is ``failed``, a collection error a failed ``<path>::collect``) and duration, and for a
failed test its error message and the failing line of the test's own source (what an issue report quotes). With
``$ALBATROSS_SWE_TRACE`` set to a directory, it also records which functions under that directory each test
called (``sys.setprofile``: file, first line, name), for choosing the functions worth breaking. With
``$ALBATROSS_SWE_ONLY`` naming a JSON list of test ids, every other collected test is deselected.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from types import CodeType, FrameType
from typing import Any

RESULTS_ENV = "ALBATROSS_SWE_RESULTS"
TRACE_ENV = "ALBATROSS_SWE_TRACE"
ONLY_ENV = "ALBATROSS_SWE_ONLY"
_MESSAGE_CHARS = 1500


class Recorder:
    def __init__(self, trace_root: str | None) -> None:
        self.outcome: dict[str, str] = {}
        self.failure: dict[str, dict[str, str]] = {}
        self.calls: dict[str, list[tuple[str, int, str]]] = {}
        self.durations: dict[str, float] = {}
        self.trace_root = os.path.realpath(trace_root) + os.sep if trace_root else None
        self._seen: set[tuple[str, int, str]] = set()
        self._keys: dict[CodeType, tuple[str, int, str] | tuple[()]] = {}

    # outcomes -----------------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: Any) -> None:
        name = report.nodeid
        seconds = float(getattr(report, "duration", 0.0))  # pytest's report; older ones lack it
        self.durations[name] = round(self.durations.get(name, 0.0) + seconds, 4)
        if report.failed:
            if self.outcome.get(name) != "failed":
                self.failure[name] = _failure(report)
            self.outcome[name] = "failed"
        elif report.skipped and self.outcome.get(name) != "failed":
            self.outcome[name] = "skipped"
        elif report.when == "call" and name not in self.outcome:
            self.outcome[name] = "passed"

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            name = f"{report.nodeid or 'session'}::collect"
            self.outcome[name] = "failed"
            self.failure[name] = {"message": str(report.longrepr)[-_MESSAGE_CHARS:], "line": ""}

    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        path = os.environ.get(ONLY_ENV)
        if not path:
            return
        with open(path, encoding="utf-8") as f:
            wanted = set(json.load(f))
        deselected = [item for item in items if item.nodeid not in wanted]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item.nodeid in wanted]

    # coverage -----------------------------------------------------------------------------------
    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        root = self.trace_root
        if event != "call" or root is None:
            return
        code = frame.f_code
        key = self._keys.get(code)
        if key is None:
            path = os.path.realpath(code.co_filename)
            key = (path[len(root):], code.co_firstlineno, code.co_name) if path.startswith(root) else ()
            self._keys[code] = key
        if key:
            self._seen.add(key)

    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> None:
        if self.trace_root is None:
            return None
        self._seen = set()
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        return None

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        if self.trace_root is None:
            return
        sys.setprofile(None)
        threading.setprofile(None)
        self.calls[nodeid] = sorted(self._seen)

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        path = os.environ.get(RESULTS_ENV)
        if not path:
            return
        data = {"tests": self.outcome, "failures": self.failure, "durations": self.durations,
                "exitstatus": int(exitstatus)}
        if self.trace_root is not None:
            data["calls"] = self.calls
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)


def _failure(report: Any) -> dict[str, str]:
    """The error message and the failing line of the test file (the ``>`` line of its last frame there)."""
    message, line = "", ""
    longrepr = report.longrepr
    try:
        message = str(longrepr.reprcrash.message)
    except AttributeError:
        message = str(longrepr)
    try:
        test_file = report.location[0]
        entries = [e for e in longrepr.reprtraceback.reprentries  # pytest's entries: not every kind has a location
                   if getattr(getattr(e, "reprfileloc", None), "path", "").endswith(test_file)]
        if entries:
            marked = [ln[1:].strip() for ln in entries[-1].lines if ln.startswith(">")]
            line = marked[-1] if marked else ""
    except (AttributeError, IndexError, TypeError):
        pass
    return {"message": message[:_MESSAGE_CHARS], "line": line[:300], "when": report.when}


def pytest_configure(config: Any) -> None:
    config.pluginmanager.register(Recorder(os.environ.get(TRACE_ENV) or None), "albatross-swe-recorder")
