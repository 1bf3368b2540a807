"""The leakage gate (6): what the agent can read in the built image must not give the tests or the oracle away.

A *secret* is a file of the task's tests/ (test code, and the expected outputs the tests compare
against) or solution/, of at least 16 bytes, known by its sha256. A *leak* is a file the agent can read
in the image that equals a secret, unless the instruction hands it over on purpose: its image path or
file name is named in instruction.md, or it comes from environment/ and the instruction names it or
a directory holding it (other than / and the working directory). A leak line names the file in the
image and the secret it equals.

Static (before the build): the files the final stage's COPY/ADD would put into the image from
environment/ (computed with the build's own COPY rules), and any COPY/ADD into /tests or /solution.
Files of environment/ that the Dockerfile never copies are no leak. In an untouched attempt of the
built image: /tests and /solution do not exist, the task's own directories are not visible at their
host path, and no file of the image (outside /proc, /sys, /dev and the offline toolkit) equals a
secret: every file of a secret's exact size is hashed.
"""

from __future__ import annotations

import hashlib
import io
import posixpath
import re
import shlex
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

from albatross.sandbox.base import Attempt
from albatross.tasks.format import Task
from albatross.tasks.shims import TOOLKIT_PATH
from albatross.tasks.verify import SOLUTION_PATH, TESTS_PATH

MIN_SECRET_BYTES = 16  # smaller files ("1\n", "ok") are too common to be evidence of anything
MAX_SCANNED = 5000  # files hashed in one attempt at most


def secret_hashes(task: Task) -> dict[str, list[str]]:
    """sha256 -> ["tests/x", "solution/y", ...] for every file of tests/ and solution/ worth comparing."""
    out: dict[str, list[str]] = {}
    for root in (task.tests_dir, task.solution_dir):
        for path in sorted(root.rglob("*")) if root.is_dir() else []:
            if path.is_file() and path.stat().st_size >= MIN_SECRET_BYTES:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                out.setdefault(digest, []).append(f"{root.name}/{path.relative_to(root)}")
    return out


def _secret_sizes(task: Task) -> set[int]:
    return {p.stat().st_size for root in (task.tests_dir, task.solution_dir) if root.is_dir()
            for p in root.rglob("*") if p.is_file() and p.stat().st_size >= MIN_SECRET_BYTES}


def _named(text: str, name: str) -> bool:
    """``name`` appears in ``text`` as a whole path or file name (not inside a longer word)."""
    return bool(name) and re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-]|\.\w)", text) is not None


def handed_over(task: Task, image_path: str, from_env: bool) -> bool:
    """The instruction hands ``image_path`` to the agent on purpose: it names the path or the file name,
    or (for a file that comes from environment/) a directory holding it, other than / and the workdir: by
    its path, or under the workdir as a relative path (``test/``, ``test/calculator.scm``)."""
    text = task.instruction
    if _named(text, image_path) or _named(text, posixpath.basename(image_path)):
        return True
    if not from_env:
        return False
    workdir = task.workdir.rstrip("/")
    parent = posixpath.dirname(image_path)
    while parent not in ("/", "") and parent != workdir:
        if _named(text, parent):
            return True
        if workdir and parent.startswith(workdir + "/") and _names_relative_dir(text, parent[len(workdir) + 1:]):
            return True
        parent = posixpath.dirname(parent)
    return False


def _names_relative_dir(text: str, relative: str) -> bool:
    """``text`` has a relative path that starts with the directory ``relative`` (``test/``, ``./test/x``)."""
    return re.search(rf"(?<![\w./-])(?:\./)?{re.escape(relative)}/", text) is not None


@dataclass(frozen=True)
class ImageFile:
    path: str  # where the image has it
    digest: str
    line: int  # the COPY/ADD that puts it there


def copied_files(task: Task) -> Iterator[ImageFile]:
    """The regular files the final stage's COPY/ADD put into the image from environment/, with the
    build's own rules (directories, globs, existing-directory destinations, archives)."""
    from albatross.sandbox.build import EnvBuildError, copy_tar
    from albatross.sandbox.dockerfile import Copy, DockerfileError, Workdir, parse_dockerfile, split_stages

    env = task.source_env_dir or task.env_dir
    try:
        stages = split_stages(parse_dockerfile(task.dockerfile))
    except DockerfileError:
        return  # the build gate reports it
    cwd, dirs = "/", {"/"}
    for ins in stages[-1].instructions if stages else []:
        if isinstance(ins, Workdir):
            cwd = posixpath.normpath(posixpath.join(cwd, ins.path))
            dirs.update(_ancestors(cwd))
        if not isinstance(ins, Copy) or ins.from_ is not None:
            continue
        dest = posixpath.normpath(posixpath.join(cwd, ins.dest))
        try:
            data = copy_tar(ins, env, cwd, dest_kind="dir" if dest in dirs else None)
        except (EnvBuildError, OSError, tarfile.TarError):
            continue  # a missing source or a URL: the build gate reports it
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar:
                path = "/" + member.name
                if member.isdir():
                    dirs.update(_ancestors(path))
                elif member.isreg():
                    dirs.update(_ancestors(posixpath.dirname(path)))
                    content = tar.extractfile(member)  # a regular member: never None
                    digest = hashlib.sha256(content.read() if content is not None else b"").hexdigest()
                    yield ImageFile(path, digest, ins.line)


def _ancestors(path: str) -> list[str]:
    out = []
    while path not in ("/", ""):
        out.append(path)
        path = posixpath.dirname(path)
    return out


def find_static_leaks(task: Task) -> list[str]:
    """Secrets the Dockerfile would copy from environment/ into the image (``copied_leaks``), and COPY/ADD
    into /tests or /solution (``placement_leaks``)."""
    return copied_leaks(task) + placement_leaks(task)


def copied_leaks(task: Task) -> list[str]:
    """Secrets a COPY/ADD of the Dockerfile puts into the image from environment/. Whether one is still
    readable in the built image (a later ``RUN rm`` removes it, a build stage drops it) is for
    ``scan_for_leaks`` to say; this is the verdict before a build, or without one."""
    secrets = secret_hashes(task)
    return [f"{secrets[f.digest][0]} would be readable in the image at {f.path} "
            f"(copied from environment/ by Dockerfile line {f.line})"
            for f in copied_files(task) if f.digest in secrets and not handed_over(task, f.path, from_env=True)]


def placement_leaks(task: Task) -> list[str]:
    """COPY/ADD into /tests or /solution, where the verifier's files go."""
    from albatross.sandbox.dockerfile import Copy, DockerfileError, parse_dockerfile

    leaks: list[str] = []
    try:
        instructions = parse_dockerfile(task.dockerfile)
    except DockerfileError:
        return leaks
    for ins in instructions:
        if not isinstance(ins, Copy):
            continue
        dest = ins.dest
        if dest.rstrip("/") in (TESTS_PATH, SOLUTION_PATH) or dest.startswith((TESTS_PATH + "/", SOLUTION_PATH + "/")):
            leaks.append(f"{task.dockerfile}:{ins.line}: {ins.keyword} into {dest}, where the verifier's files go")
    return leaks


def _env_hashes(task: Task) -> set[str]:
    env = task.source_env_dir or task.env_dir
    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in env.rglob("*") if p.is_file()} if env.is_dir() else set()


def scan_command(task: Task) -> str:
    """The shell command an untouched attempt runs: which of /tests, /solution and the task's host
    directories exist, then the sha256 of every file with a secret's exact size."""
    visible = " ".join(shlex.quote(str(p.resolve())) for p in (task.tests_dir, task.solution_dir) if p.is_dir())
    command = f"for p in {TESTS_PATH} {SOLUTION_PATH} {visible}; do [ -e $p ] && echo \"EXISTS $p\"; done; "
    sizes = sorted(_secret_sizes(task))
    if not sizes:
        return command + "true"
    size_test = " -o ".join(f"-size {n}c" for n in sizes)
    return command + (
        f"find / \\( -path /proc -o -path /sys -o -path /dev -o -path {shlex.quote(TOOLKIT_PATH)} \\) -prune "
        f"-o -type f \\( {size_test} \\) -print0 2>/dev/null "
        f"| head -z -n {MAX_SCANNED} | xargs -0 -r sha256sum 2>/dev/null")


def scan_for_leaks(attempt: Attempt, task: Task) -> list[str]:
    """In an untouched attempt: /tests or /solution already there, the task's own tests/ or solution/
    visible at their host path, or a readable file of the image equal to a secret and not handed over."""
    secrets = secret_hashes(task)
    output = attempt.exec(scan_command(task), timeout_s=120).output
    env = _env_hashes(task)
    leaks = []
    for line in output.splitlines():
        if line.startswith("EXISTS "):
            where = line[7:]
            leaks.append(f"{where} exists before verification" if where in (TESTS_PATH, SOLUTION_PATH) else
                         f"the task's {where} is visible inside the sandbox (keep task directories under a "
                         "hidden path)")
            continue
        digest, _, path = line.partition("  ")
        if digest in secrets and not handed_over(task, path, from_env=digest in env):
            leaks.append(f"{secrets[digest][0]} is readable in the image at {path}")
    return leaks
