"""The leakage gate (6): the tests and the oracle must stay invisible to the agent until verification.

Static: no file of tests/ or solution/ is in environment/, and the Dockerfile copies nothing into /tests
or /solution. In an untouched attempt: /tests and /solution do not exist, the task's own directories are
not visible at their host path (the sandbox's base is the live host root), and no test or solution file
is readable under the workdir or a COPY destination (files are compared by sha256).
"""

from __future__ import annotations

import hashlib
import shlex

from albatross.sandbox.base import Attempt
from albatross.tasks.format import Task
from albatross.tasks.offline import TOOLKIT_PATH
from albatross.tasks.verify import SOLUTION_PATH, TESTS_PATH


def _secret_hashes(task: Task) -> dict[str, str]:
    """sha256 -> "tests/x" for every non-trivial file of tests/ and solution/."""
    out: dict[str, str] = {}
    for root in (task.tests_dir, task.solution_dir):
        for path in sorted(root.rglob("*")) if root.is_dir() else []:
            if path.is_file() and path.stat().st_size >= 16:
                out[hashlib.sha256(path.read_bytes()).hexdigest()] = f"{root.name}/{path.relative_to(root)}"
    return out


def find_static_leaks(task: Task) -> list[str]:
    """Copies of test or solution files in environment/, and Dockerfile COPYs into /tests or /solution."""
    from albatross.sandbox.dockerfile import Copy, DockerfileError, parse_dockerfile

    secrets = _secret_hashes(task)
    env = task.source_env_dir or task.env_dir
    leaks = [f"{secrets[h]} is in the environment as environment/{p.relative_to(env)}"
             for p in sorted(env.rglob("*")) if p.is_file()
             for h in [hashlib.sha256(p.read_bytes()).hexdigest()] if h in secrets]
    try:
        instructions = parse_dockerfile(task.dockerfile)
    except DockerfileError:
        return leaks
    for ins in instructions:
        dest = ins.dest if isinstance(ins, Copy) else ""
        if dest.rstrip("/") in (TESTS_PATH, SOLUTION_PATH) or dest.startswith((TESTS_PATH + "/", SOLUTION_PATH + "/")):
            leaks.append(f"{task.dockerfile}:{ins.line}: {ins.keyword} into {dest}, where the verifier's files go")
    return leaks


def _scan_roots(task: Task) -> list[str]:
    from albatross.sandbox.dockerfile import Copy, DockerfileError, parse_dockerfile

    roots = [task.workdir] if task.workdir != "/" else []
    try:
        instructions = parse_dockerfile(task.dockerfile)
    except DockerfileError:
        return roots
    for ins in instructions:
        if isinstance(ins, Copy) and ins.dest.startswith("/") and ins.dest.rstrip("/"):
            roots.append(ins.dest)
    return sorted(set(roots))


def scan_for_leaks(attempt: Attempt, task: Task) -> list[str]:
    """In an untouched attempt: /tests or /solution already there, the task's own tests/ or solution/
    visible at their host path (the sandbox's base is the live host root: keep task directories under
    a hidden path), or a test/solution file readable under the workdir or a COPY destination."""
    secrets = _secret_hashes(task)
    roots = " ".join(shlex.quote(r) for r in _scan_roots(task))
    visible = " ".join(shlex.quote(str(p.resolve())) for p in (task.tests_dir, task.solution_dir) if p.is_dir())
    command = (f"for p in {TESTS_PATH} {SOLUTION_PATH} {visible}; do [ -e $p ] && echo \"EXISTS $p\"; done; "
               + (f"find {roots} -xdev -type f -size -2048k -not -path '{TOOLKIT_PATH}*' -print0 2>/dev/null "
                  "| head -z -n 5000 | xargs -0 -r sha256sum 2>/dev/null" if roots else "true"))
    output = attempt.exec(command, timeout_s=60).output
    leaks = []
    for line in output.splitlines():
        if line.startswith("EXISTS "):
            where = line[7:]
            leaks.append(f"{where} exists before verification" if where in (TESTS_PATH, SOLUTION_PATH) else
                         f"the task's {where} is visible inside the sandbox (keep task directories under a "
                         "hidden path)")
            continue
        digest, _, path = line.partition("  ")
        if digest in secrets:
            leaks.append(f"{secrets[digest]} is readable in the environment at {path}")
    return leaks
