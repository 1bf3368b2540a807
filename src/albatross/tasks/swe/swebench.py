"""``albatross tasks import swebench FILE.jsonl --repos DIR --out DIR``: SWE-bench instances as task directories.

An instance is one JSON object per line with SWE-bench's fields: ``instance_id``, ``repo`` (``owner/name``),
``base_commit``, ``patch`` (the fix), ``test_patch`` (the tests that show it), ``problem_statement``,
``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (lists of pytest test ids, or JSON strings of them), and optionally the
environment set-up: ``python`` (default ``--python``), ``pre_install`` and ``install`` (shell commands run in
``/repo`` at build time; default ``pip install -e .``), ``pip_packages`` (more requirements, pytest always
installed), ``timeout`` (the verifier's seconds). The repository comes from a local clone in ``--repos``
(``<owner>__<name>``, ``<owner>/<name>`` or ``<name>``): its tree at ``base_commit`` (``git archive``: no history,
so no later commit holding the fix is in the image) becomes ``/repo``, a fresh one-commit repository, with the
install run at build time (registries reachable as for any build; attempts and the oracle run offline).

The verifier is the one of generated repository tasks (``writer.py``): before the run it puts back the test files
as the test patch leaves them (and the base's ``conftest.py`` files and pytest configuration), so the new tests
never sit in the image; it runs the test files the test patch touches plus those the FAIL_TO_PASS and PASS_TO_PASS
ids name. The oracle applies ``patch``. ``tests/swebench_instance.json`` keeps the instance as given
(``instance_of`` reads it back: the round trip).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from albatross.errors import UserError
from albatross.tasks.swe import project
from albatross.tasks.swe.writer import REPO, RepoTask, git_commit_script, write_repo_task

INSTANCE_FILE = "swebench_instance.json"
REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "FAIL_TO_PASS",
            "PASS_TO_PASS")
_GIT_SAFE = ["-c", "core.fsmonitor=", "-c", "core.hooksPath=/dev/null", "-c", "protocol.allow=never"]


def read_instances(path: Path) -> list[dict[str, Any]]:
    """The instances of a JSONL file, each checked for SWE-bench's fields (a ``UserError`` names the line)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the instances: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            inst = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON: {e.msg}") from None
        missing = [k for k in REQUIRED if not isinstance(inst, dict) or k not in inst]
        if missing:
            raise UserError(f"{path}:{n}: the instance has no {', '.join(missing)}")
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            inst_tests(inst, key, f"{path}:{n}")
        if not re.fullmatch(r"[0-9a-fA-F]{7,40}", str(inst["base_commit"])):
            raise UserError(f"{path}:{n}: base_commit must be a commit hash")
        out.append(inst)
    if not out:
        raise UserError(f"{path}: no instances")
    return out


def inst_tests(inst: dict[str, Any], key: str, where: str = "") -> list[str]:
    """``FAIL_TO_PASS`` / ``PASS_TO_PASS`` as a list (SWE-bench writes them as JSON strings or lists)."""
    value = inst.get(key, [])
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise UserError(f"{where}: {key} must be a list of test ids (or a JSON string of one)") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise UserError(f"{where}: {key} must be a list of test ids")
    return list(value)


def find_clone(repos: Path, repo: str) -> Path:
    owner, _, name = repo.partition("/")
    for candidate in (repos / f"{owner}__{name}", repos / owner / name, repos / (name or owner)):
        if (candidate / ".git").exists():
            return candidate
    raise UserError(f"--repos {repos}: no clone of {repo} (looked for {owner}__{name}, {owner}/{name}, {name})")


def import_instances(path: Path, repos: Path, out: Path, python: str = "3.11",
                     log: Callable[[str], None] = print) -> list[Path]:
    """Write one task directory per instance of ``path`` into ``out``; returns them."""
    made = []
    for inst in read_instances(path):
        task = instance_task(inst, find_clone(repos, str(inst["repo"])), python)
        made.append(write_repo_task(out, task))
        log(f"[import] {inst['instance_id']} -> {made[-1]}")
    return made


def instance_task(inst: dict[str, Any], clone: Path, python: str) -> RepoTask:
    iid = str(inst["instance_id"])
    with tempfile.TemporaryDirectory(prefix="albatross-swebench-") as tmp:
        base = Path(tmp) / "repo"
        _export(clone, str(inst["base_commit"]), base, iid)
        config_file = project.config_file(base)
        base_files = project.pristine_files(base)
        after = Path(tmp) / "after"
        shutil.copytree(base, after, symlinks=True)
        touched = _apply(after, str(inst["test_patch"]), f"{iid}: test_patch")
        _apply(Path(shutil.copytree(base, Path(tmp) / "fixed", symlinks=True)), str(inst["patch"]), f"{iid}: patch")
        f2p, p2p = inst_tests(inst, "FAIL_TO_PASS", iid), inst_tests(inst, "PASS_TO_PASS", iid)
        tests = sorted({f for f in touched if f.endswith(".py") and project.is_test_path(f)}
                       | {t.split("::", 1)[0] for t in f2p + p2p if "::" in t})
        overrides = {f: (after / f).read_bytes() for f in touched if (after / f).is_file()}
        pristine = project.pristine_tar(base, [f for f in base_files if f not in overrides], overrides)
        env_files = _tree_files(base)
    name = str(inst["repo"]).split("/")[-1]
    metadata = {"category": "swe", "family": f"swebench-{name}", "source": f"swebench/{inst['repo']}",
                "instance_id": iid, "repo": str(inst["repo"]), "base_commit": str(inst["base_commit"]),
                "fail_to_pass": len(f2p), "pass_to_pass": len(p2p), "generator": "albatross tasks import swebench"}
    instruction = (str(inst["problem_statement"]).rstrip() + f"\n\n---\nThe repository is checked out at `{REPO}` "
                   "(a git repository, with the project installed for development). Fix the issue in the "
                   "library; tests that check it are run afterwards.\n")
    return RepoTask(project.safe_id(iid), instruction, _dockerfile(inst, python, iid), env_files, str(inst["patch"]),
                    f2p, p2p, tests, pristine, config_file, float(inst.get("timeout") or 900.0),
                    metadata, extra_tests={INSTANCE_FILE: json.dumps(inst, indent=1) + "\n"})


def instance_of(task_dir: Path) -> dict[str, Any]:
    """The instance a task was imported from (the round trip of ``instance_task``)."""
    instance: dict[str, Any] = json.loads((Path(task_dir) / "tests" / INSTANCE_FILE).read_text(encoding="utf-8"))
    return instance


def _export(clone: Path, commit: str, dest: Path, iid: str) -> None:
    """The clone's tree at ``commit`` (no history), extracted safely."""
    proc = subprocess.run(["git", *_GIT_SAFE, "-C", str(clone), "archive", "--format=tar", commit],
                          capture_output=True)
    if proc.returncode != 0:
        raise UserError(f"{iid}: cannot export {commit} of {clone}: {proc.stderr.decode(errors='replace')[-300:]}")
    dest.mkdir(parents=True)
    with tempfile.TemporaryFile() as f:
        f.write(proc.stdout)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(dest, filter="data")


def _apply(tree: Path, patch: str, what: str) -> list[str]:
    """Apply a patch to a plain tree (``git apply``: no path out of it); returns the files it touches."""
    if not patch.strip():
        return []
    stat = subprocess.run(["git", *_GIT_SAFE, "apply", "--numstat", "-z", "-"], input=patch.encode(),
                          capture_output=True, cwd=tree)
    proc = subprocess.run(["git", *_GIT_SAFE, "apply", "--whitespace=nowarn", "-"], input=patch.encode(),
                          capture_output=True, cwd=tree)
    if proc.returncode != 0 or stat.returncode != 0:
        raise UserError(f"{what} does not apply to base_commit: {proc.stderr.decode(errors='replace')[-300:]}")
    return [item.split("\t")[-1] for item in stat.stdout.decode(errors="replace").split("\0") if "\t" in item]


def _tree_files(root: Path) -> dict[str, str | bytes]:
    return {f"repo/{p.relative_to(root).as_posix()}": p.read_bytes() for p in project.walk_files(root)}


def _commands(value: Any) -> list[str]:
    if value is None or value == "":
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def _dockerfile(inst: dict[str, Any], default_python: str, iid: str) -> str:
    from albatross.tasks.swe.image import python_ref

    python = str(inst.get("python") or default_python)
    install = _commands(inst.get("install")) or ["pip install -e ."]
    extra = _commands(inst.get("pip_packages"))
    steps = [*_commands(inst.get("pre_install")), *install,
             "pip install pytest " + " ".join(shlex.quote(p) for e in extra for p in e.split())]
    runs = "".join(f"RUN {step}\n" for step in steps)
    return (f"FROM {python_ref(python)}\n"
            "ENV PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1\n"
            "RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*\n"
            f"COPY repo/ {REPO}/\nWORKDIR {REPO}\n{runs}"
            f"RUN find {REPO} -name __pycache__ -prune -exec rm -rf {{}} + ; {git_commit_script(iid)}\n")
