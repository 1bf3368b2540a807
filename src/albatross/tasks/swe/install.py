"""Install a project's repository for testing (runs inside the image build, as a Dockerfile RUN step).

Usage: ``python3 install.py /repo``. Standard library only; run by the image's own python. Installs the
project editable (so the tests import the code in the repository) with its test extras (``test``,
``tests``, ``testing``; else ``dev``), its test dependency group (PEP 735) and test requirement files, plus
pytest; writes the installed versions to ``/usr/local/share/albatross-swe/freeze.txt``; removes every
``__pycache__`` and ``.pytest_cache`` of the repository (no compiled copy of the original code stays in the
image). A failing install with extras is retried without them before the step fails.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # an older python reads no pyproject.toml
    tomllib = None

EXTRAS = ("test", "tests", "testing")
REQUIREMENT_FILES = ("requirements-test.txt", "requirements-tests.txt", "test-requirements.txt",
                     "requirements_test.txt", "requirements/test.txt", "requirements/tests.txt",
                     "requirements/testing.txt", "tests/requirements.txt", "test/requirements.txt")
FREEZE = "/usr/local/share/albatross-swe/freeze.txt"


def pyproject(repo: str) -> dict[str, Any]:
    path = os.path.join(repo, "pyproject.toml")
    if tomllib is None or not os.path.isfile(path):
        return {}
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError:
            return {}


def extras_of(repo: str, data: dict[str, Any]) -> list[str]:
    names = set((data.get("project") or {}).get("optional-dependencies") or {})
    cfg = configparser.ConfigParser()
    try:
        cfg.read(os.path.join(repo, "setup.cfg"))
        if cfg.has_section("options.extras_require"):
            names |= set(cfg["options.extras_require"])
    except configparser.Error:
        pass
    setup_py = os.path.join(repo, "setup.py")
    if os.path.isfile(setup_py):
        text = open(setup_py, encoding="utf-8", errors="replace").read()
        names |= set(re.findall(r"""["'](tests?|testing|dev)["']\s*:""", text))
    chosen = [e for e in EXTRAS if e in names]
    return chosen or (["dev"] if "dev" in names else [])


def group_requirements(data: dict[str, Any], name: str, seen: tuple[str, ...] = ()) -> list[str]:
    groups = data.get("dependency-groups") or {}
    out: list[str] = []
    for item in groups.get(name) or []:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and item.get("include-group") and item["include-group"] not in seen:
            out += group_requirements(data, item["include-group"], (*seen, name))
    return out


def pip(*args: str) -> int:
    print("+ pip", " ".join(args), flush=True)
    return subprocess.call([sys.executable, "-m", "pip", *args])


def main(repo: str) -> None:
    data = pyproject(repo)
    extras = extras_of(repo, data)
    groups = [r for g in EXTRAS if g in (data.get("dependency-groups") or {}) for r in group_requirements(data, g)]
    files = [f for f in REQUIREMENT_FILES if os.path.isfile(os.path.join(repo, f))]
    reqs = [x for f in files for x in ("-r", os.path.join(repo, f))]
    target = repo + (f"[{','.join(extras)}]" if extras else "")
    common = ["install", "--no-input", "--progress-bar", "off"]
    if pip(*common, "-e", target, "pytest", *groups, *reqs) != 0:
        print("install with the test extras failed; trying without them", flush=True)
        if pip(*common, "-e", repo, "pytest") != 0:
            sys.exit("cannot install the project")
    os.makedirs(os.path.dirname(FREEZE), exist_ok=True)
    with open(FREEZE, "w") as out:
        subprocess.call([sys.executable, "-m", "pip", "freeze", "--all"], stdout=out)
    for top, dirs, _files in os.walk(repo):
        for d in list(dirs):
            if d in ("__pycache__", ".pytest_cache"):
                shutil.rmtree(os.path.join(top, d), ignore_errors=True)
                dirs.remove(d)


if __name__ == "__main__":
    main(sys.argv[1])
