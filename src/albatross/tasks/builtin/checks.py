"""Verifiers of the newer built-in families: ``tests/check.py`` (python3, standard library only).

``check_files(family, body, expected)`` returns ``(test_sh, {"check.py": ...})``: test.sh runs
check.py from /app; check.py holds ``EXPECTED`` (the answers, which live only in tests/), the body's
``@check("name")`` functions, and writes every result (1 pass, 0 fail; an exception is a fail) to
/logs/verifier/reward.json. Each named check is one test for partial credit.
"""

from __future__ import annotations

import json

from albatross.tasks.builtin.families import Family, Instance

HEADER = '''"""albatross builtin task verifier: {family}"""
import json
import os
import subprocess
import sys

EXPECTED = json.loads({expected!r})
RESULTS = {{}}
APP = "/app"


def check(name):
    def record(fn):
        try:
            RESULTS[name] = 1 if fn() else 0
        except Exception:
            RESULTS[name] = 0
        return fn
    return record


def read(path):
    with open(os.path.join(APP, path), encoding="utf-8") as f:
        return f.read()


def lines(path):
    return [line.rstrip() for line in read(path).strip().splitlines()]


'''

FOOTER = '''

os.makedirs("/logs/verifier", exist_ok=True)
with open("/logs/verifier/reward.json", "w") as f:
    json.dump(RESULTS, f)
'''

TEST_SH = """#!/bin/bash
# albatross builtin task: {family}
mkdir -p /logs/verifier
cd /app || exit 1
python3 /tests/check.py
"""


def check_files(family: str, body: str, expected: object) -> tuple[str, dict[str, str]]:
    """(test.sh, test files) for a check.py made of ``body`` with ``EXPECTED = expected``."""
    source = HEADER.format(family=family, expected=json.dumps(expected)) + body.strip() + "\n" + FOOTER
    return TEST_SH.format(family=family), {"check.py": source}


def new_instance(
    family: Family,
    key: tuple[object, ...],
    difficulty: str,
    instruction: str,
    files: dict[str, str],
    commands: list[str],
    check_body: str,
    expected: object,
    setup_sh: str = "",
    solve: list[str] | None = None,
) -> Instance:
    """An instance whose demo steps are ``commands`` then ``submit``; its oracle runs ``solve`` (default:
    the same commands) in /app with ``set -e``."""
    test_sh, test_files = check_files(family.name, check_body, expected)
    return Instance(
        family=family.name,
        key=(family.name, *key),
        difficulty=difficulty,
        instruction=instruction,
        files=files,
        demo_steps=[*commands, "submit"],
        solve_sh="#!/bin/bash\nset -e\ncd /app\n" + "\n".join(commands if solve is None else solve) + "\n",
        test_sh=test_sh,
        test_files=test_files,
        setup_sh=setup_sh,
    )
