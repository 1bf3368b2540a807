"""``albatross tasks new --scaffold NAME``: one small, complete task directory to edit into your own. It passes the
nine gates as written (``albatross tasks validate``), so each edit can be checked against a working start:
``instruction.md`` (what the agent is asked), ``environment/`` (its Dockerfile and files: the agent's world),
``solution/`` (the oracle ``solve.sh``, and ``demo.json``: the same steps one command per turn, for warm starts),
``tests/test.sh`` (the verifier: writes ``/logs/verifier/reward.json``, one 0/1 entry per check) and ``task.toml``
(limits and metadata)."""

from __future__ import annotations

import json
import re
from pathlib import Path

NOTES = """\
albatross trains agents on tasks like this one
each attempt runs in a fresh sandbox
and the tests decide whether it succeeded
"""

FILES = {
    "instruction.md": "Count the words in /app/notes.txt and write the number, alone, to /app/count.txt.\n",
    "task.toml": """\
version = "1.0"

[metadata]
category = "text-processing"   # families and categories group the report's per-family table
difficulty = "easy"
tags = ["my-first-task"]

[agent]
timeout_sec = 120.0            # wall time of one attempt

[verifier]
timeout_sec = 30.0

[environment]
cpus = 1
memory_mb = 512
storage_mb = 256
allow_internet = false
""",
    "environment/Dockerfile": """\
FROM python:3.11-slim-bookworm
WORKDIR /app
COPY notes.txt /app/notes.txt
""",
    "environment/notes.txt": NOTES,
    "solution/solve.sh": """\
#!/bin/bash
set -e
cd /app
wc -w < notes.txt > count.txt
""",
    "solution/demo.json": json.dumps({"steps": ["wc -w < notes.txt > count.txt", "submit"]}, indent=2) + "\n",
    "tests/test.sh": """\
#!/bin/bash
# The verifier: runs after the attempt, in a clean shell, with this directory at /tests. One entry per check in
# /logs/verifier/reward.json (1 passed, 0 failed); the attempt succeeds when every check passes.
mkdir -p /logs/verifier
expected=__EXPECTED__
exists=0; correct=0
if [ -f /app/count.txt ]; then
  exists=1
  if [ "$(tr -d '[:space:]' < /app/count.txt)" = "$expected" ]; then correct=1; fi
fi
echo "{\\"count_file_exists\\": $exists, \\"count_is_right\\": $correct}" > /logs/verifier/reward.json
""".replace("__EXPECTED__", str(len(NOTES.split()))),
}
EXECUTABLE = ("solution/solve.sh", "tests/test.sh")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def write_scaffold(out: Path, name: str) -> Path:
    """Write the scaffold task as ``out/name``; ``ValueError`` for a bad name or an existing directory."""
    if not NAME.match(name):
        raise ValueError(f"--scaffold {name!r}: a task name is letters, digits, '.', '_' and '-' (64 at most)")
    task = Path(out) / name
    if task.exists():
        raise ValueError(f"{task} exists already")
    for rel, text in FILES.items():
        path = task / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel in EXECUTABLE:
            path.chmod(0o755)
    return task
