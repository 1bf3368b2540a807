"""The instruction of a repository task: an issue report written from the failing behaviour, as a user who ran
the tests would file it. It names the project, the tests that fail and, for the first few, the failing line of
the test and the error it raised; never the file, the function or the change that broke them. A quoted error
that would give the location away (it names a changed file, module or line, or a function that is not public) is
left out; ``leaks`` is the check.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

MAX_TESTS_LISTED = 8
MAX_QUOTED = 3
_MESSAGE_LINES = 6


def issue_text(project: str, version: str, repo: str, failing: list[str], failures: dict[str, dict[str, str]],
               hidden: list[str], names: Sequence[str] = ()) -> str:
    """The issue report. ``failing``: FAIL_TO_PASS test ids; ``failures``: test id -> {"message", "line"}
    from the run with the bug; ``hidden``: strings the text must not contain (changed file paths, module
    names, changed source lines, private function names); ``names``: the changed public functions, which a
    quoted error may name only where the test's own line calls them."""
    n = len(failing)
    title = f"{n} test{'s' if n != 1 else ''} of {project} fail" + (f": {_short(failing[0])}" if n == 1 else "")
    listed = "\n".join(f"- `{t}`" for t in failing[:MAX_TESTS_LISTED])
    if n > MAX_TESTS_LISTED:
        listed += f"\n- ... and {n - MAX_TESTS_LISTED} more"
    quotes = [q for q in (_quote(t, failures.get(t, {}), hidden, list(names)) for t in failing) if q][:MAX_QUOTED]
    details = ("\n\nWhat they report:\n\n" + "\n\n".join(quotes)) if quotes else ""
    return (f"# {title}\n\n"
            f"In the {project} {version} checkout at `{repo}` (a git repository, with the project installed in "
            f"development mode and its test dependencies), the test suite is not green. These tests fail:\n\n"
            f"{listed}{details}\n\n"
            "The other tests pass. Fix the library so that these tests pass too, without breaking the others. "
            "Do not edit the tests: they are put back as they are before the tests are run. Run them with "
            f"`python -m pytest <test id>` from `{repo}`.\n")


def _short(test_id: str) -> str:
    return test_id.rsplit("::", 1)[-1]


def _quote(test_id: str, failure: dict[str, str], hidden: list[str], names: list[str]) -> str:
    line = str(failure.get("line") or "").strip()
    message = "\n".join(str(failure.get("message") or "").strip().splitlines()[:_MESSAGE_LINES]).strip()
    parts = []
    if line and not leaks(line, hidden):
        parts.append(f"    {line}")
    else:
        line = ""
    unseen = [n for n in names if not leaks(line + " " + test_id, [n])]
    if message and not leaks(message, hidden + unseen):
        parts.append("\n".join(f"    {m}" for m in message.splitlines()))
    if not parts:
        return ""
    return f"`{test_id}`:\n\n" + "\n".join(parts)


def leaks(text: str, hidden: list[str]) -> bool:
    """Whether ``text`` contains one of ``hidden`` (as a whole word where it is a name)."""
    for item in hidden:
        item = item.strip()
        if not item:
            continue
        if re.fullmatch(r"[A-Za-z_][\w.]*", item):  # a name: a whole word
            if re.search(rf"(?<![\w.]){re.escape(item)}(?![\w])", text):
                return True
        elif re.fullmatch(r"[\w./-]+\.py", item):  # a file: not inside a longer name (test_core.py is no core.py)
            if re.search(rf"(?<![\w.-]){re.escape(item)}", text):
                return True
        elif item in text:
            return True
    return False
