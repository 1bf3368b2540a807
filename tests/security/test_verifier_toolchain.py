"""Verifier toolchain tampering: the interpreter and tools test.sh runs come from the task's pristine image,
not from the attempt's files. Each probe is a hostile agent that hooks or replaces what the verifier runs
(python's sitecustomize, a .pth file, the python on PATH, bash itself, the user site, a module that shadows
pytest) so that a failing attempt would score 1; the real verifier must still score it 0."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _probes import PY_TEST_SH, make_task, needs_local

from albatross.sandbox import LocalBackend
from albatross.tasks.verify import verify_attempt

pytestmark = needs_local
FORGE_PY = ("import os\nos.makedirs('/logs/verifier', exist_ok=True)\n"
            "open('/logs/verifier/reward.txt', 'w').write('1')\nos._exit(0)\n")
SITE = "/usr/local/lib/python3.11/dist-packages"


def plant(path: str, text: str, mode: str = "644") -> str:
    """A shell command writing ``text`` to ``path`` (directories made) with ``mode``."""
    import shlex

    return (f"mkdir -p {shlex.quote(str(Path(path).parent))} && printf %s {shlex.quote(text)} > {shlex.quote(path)} "
            f"&& chmod {mode} {shlex.quote(path)}")


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBackend]:
    backend = LocalBackend(warm=0, hide_paths=[tmp_path_factory.getbasetemp()])
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory):
    return make_task(tmp_path_factory.mktemp("tasks"), "py-check", PY_TEST_SH)


def score_after(backend: LocalBackend, task, *commands: str) -> float:
    with backend.fork(task.env_dir, task.workdir) as attempt:
        for command in commands:
            result = attempt.exec(command, timeout_s=30)
            assert result.exit_code == 0, result.output
        return verify_attempt(attempt, task, backend).reward


TAMPERING = {
    "sitecustomize": plant("/etc/python3.11/sitecustomize.py", FORGE_PY),  # what Debian's python imports
    "pth-file": plant(f"{SITE}/zz-forge.pth", "import os; os._exit(0)\n"),
    "python-on-path": plant("/usr/local/bin/python3", "#!/bin/sh\nexit 0\n", "755"),
    "bash-wrapper": plant("/tmp/fake-bash", "#!/bin/sh\nmkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\n",
                          "755") + " && rm -f /usr/bin/bash && cp /tmp/fake-bash /usr/bin/bash",
    "user-site": plant("/root/.local/lib/python3.11/site-packages/zz-forge.pth", "import os; os._exit(0)\n"),
}


@pytest.mark.parametrize("name", sorted(TAMPERING))
def test_tampered_toolchain_does_not_raise_the_reward(backend: LocalBackend, task, name: str) -> None:
    assert score_after(backend, task, TAMPERING[name]) == 0.0


def test_untampered_attempt_that_solves_the_task_still_scores_1(backend: LocalBackend, task) -> None:
    assert score_after(backend, task, "echo forty-two > /app/answer.txt") == 1.0


def test_module_shadowing_pytest_in_the_workdir_is_not_imported(tmp_path: Path, backend: LocalBackend) -> None:
    """A Terminal-Bench verifier runs ``uvx ... pytest`` from the workdir; an /app/pytest.py the agent wrote
    must not be the pytest that runs."""
    test_sh = ("#!/bin/bash\ncd /app\nuvx -p 3.13 -w pytest==8.4.1 pytest /tests/test_outputs.py -rA\n"
               "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    tests = {"test_outputs.py": "def test_answer():\n    assert open('/app/answer.txt').read().strip() == "
                                "'forty-two'\n"}
    task = make_task(tmp_path, "tb-style", test_sh, test_files=tests)
    shadow = plant("/app/pytest.py", FORGE_PY)
    assert score_after(backend, task, shadow) == 0.0
    assert score_after(backend, task, "echo forty-two > /app/answer.txt") == 1.0


def test_a_task_that_verifies_in_its_own_toolchain_flags_the_attempts_changes(tmp_path: Path,
                                                                            backend: LocalBackend) -> None:
    """``[verifier] toolchain = "attempt"``: test.sh sees what the agent installed (here under /usr/local),
    and the trajectory lists the attempt's changes to system paths."""
    test_sh = ("#!/bin/bash\nmkdir -p /logs/verifier\n"
               "if [ \"$(/usr/local/bin/answer)\" = forty-two ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n")
    task = make_task(tmp_path, "own-tools", test_sh, toml={"verifier": {"toolchain": "attempt"}})
    install = plant("/usr/local/bin/answer", "#!/bin/sh\necho forty-two\n", "755")
    with backend.fork(task.env_dir, task.workdir) as attempt:
        assert attempt.exec(install).exit_code == 0
        result = verify_attempt(attempt, task, backend)
    assert result.reward == 1.0 and "/usr/local/bin/answer" in result.system_changes, result
    pristine = make_task(tmp_path, "image-tools", test_sh)
    assert score_after(backend, pristine, install) == 0.0  # the image has no /usr/local/bin/answer


def test_the_verifiers_own_toolkit_runs_where_the_image_has_none(tmp_path: Path, backend: LocalBackend) -> None:
    """An image the toolkit was not built into (debian, no RUN): the verifier's read-only copy serves its
    ``apt-get install curl`` and ``curl`` (the uv installer), as root of the attempt's user namespace."""
    test_sh = ("#!/bin/bash\napt-get install -y curl >/dev/null 2>&1\n"
               "curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh >/dev/null 2>&1 && source $HOME/.local/bin/env\n"
               "mkdir -p /logs/verifier\n"
               "if command -v curl | grep -q albatross-offline && command -v uvx >/dev/null; then echo 1; else echo 0; fi"
               " > /logs/verifier/reward.txt\n")
    task = make_task(tmp_path, "bare-image", test_sh, dockerfile="FROM debian:bookworm-slim\nWORKDIR /app\n")
    assert task.offline is None
    with backend.fork(task.env_dir, task.workdir) as attempt:
        assert verify_attempt(attempt, task, backend).reward == 1.0


def test_the_verifiers_own_installs_land_in_a_scratch_layer_the_attempt_never_sees(tmp_path: Path,
                                                                                   backend: LocalBackend) -> None:
    """test.sh may install into the pristine toolchain (``pip install`` of its test tools, as in a
    container): the writes go to a scratch layer of that verification only, not into the attempt, and not
    into the next verification."""
    marker = f"{SITE}/verifier_marker.py"
    test_sh = ("#!/bin/bash\nmkdir -p /logs/verifier\n"
               f"if [ -e {marker} ]; then echo 0; else echo 'FLAG = 1' > {marker} && "
               "python3 -c 'import verifier_marker, sys; sys.exit(0 if verifier_marker.FLAG == 1 else 1)' && echo 1 "
               "|| echo 0; fi > /logs/verifier/reward.txt\n")
    task = make_task(tmp_path, "installs", test_sh)
    with backend.fork(task.env_dir, task.workdir) as attempt:
        assert verify_attempt(attempt, task, backend).reward == 1.0  # it could write, and what it wrote works
        assert attempt.exec(f"test -e {marker}").exit_code == 1  # the attempt does not see it
        assert verify_attempt(attempt, task, backend).reward == 1.0  # a fresh scratch layer: not there again
