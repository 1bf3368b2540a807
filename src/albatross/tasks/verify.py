"""Run a task's verifier (tests/test.sh) or its oracle (solution/solve.sh) inside an attempt.

The verifier writes ``/logs/verifier/reward.json`` (an object mapping test name -> number in [0, 1])
or ``/logs/verifier/reward.txt`` (one number in [0, 1]). When both exist, reward.json wins.

- reward.json: ``metrics`` is the object, ``reward`` the mean of its values, ``success`` is true when
  every value is 1.0.
- reward.txt: ``reward`` is r and ``success`` is ``r == 1.0``. ``metrics`` holds the per-test results
  (1.0 passed, 0.0 failed) when the verifier ran pytest through the offline toolkit (its plugin writes
  ``/logs/verifier/albatross-tests.json``) or wrote ``/logs/verifier/ctrf.json`` itself; otherwise
  ``{"reward": r}``. Per-test results that contradict r (a pass with a failed test, a fail with none)
  are noted in ``problem`` (the well-formed-reward gate fails on it).

Out of the agent's reach (``Attempt.verify``; on the isolated backend, ``sandbox/verifier.py``): before
the verifier starts every process of the attempt is killed (``Attempt.kill_all``), unless the task says
``[verifier] keep_agent_processes = true`` (its tests check a server the agent left running). test.sh
runs as a fresh ``bash --noprofile --norc`` with the image's environment only, in a mount namespace of
its own: ``/tests`` (a fresh copy), ``/logs/verifier`` (empty) and the offline toolkit exist only there,
so no process of the agent can touch them; its interpreter and tools (``/usr``, ``/etc``, ``/bin``,
``/lib``...) are the task's pristine image's, not the attempt's (``[verifier] toolchain = "attempt"``: its
own, for tests that must run in the attempt's environment; then the attempt's changes to those paths are
listed in ``system_changes``); the user site of python is off. Reward files are read without following links.

Every attempt is scored by ``verify_attempt``: the model's, the no-op's and ``eval --agent oracle``'s alike.
No usable reward (no reward file, a malformed one, a non-finite value or one outside [0, 1]) is the attempt's
own failure, scored 0, when the same verifier writes a usable reward on an untouched fork of the task (checked
once per task and backend): a full disk or inode table, a killed sandbox after running out of memory, a broken
workdir. Otherwise it is an infrastructure or task error (``VerifierError``), never scored. The gates
(``gates.py``) judge the task, not an attempt: they read ``run_verifier``'s run, where no usable reward is
reported as the task's problem.

Scripts that call apt-get, pip, uv/uvx, curl, wget or pytest run with the offline toolkit first on
``PATH`` (``offline.py``), so Terminal-Bench verifiers run without the internet.
"""

from __future__ import annotations

import json
import math
import secrets
import shlex
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from albatross.sandbox.base import Attempt, AttemptBroken, Backend, ExecResult, Limits, VerifierSpec
from albatross.tasks import offline
from albatross.tasks.format import Task, TaskFormatError
from albatross.tasks.shims import TOOLKIT_PATH

REWARD_DIR = "/logs/verifier"
REWARD_JSON = f"{REWARD_DIR}/reward.json"
REWARD_TXT = f"{REWARD_DIR}/reward.txt"
CTRF_JSON = f"{REWARD_DIR}/ctrf.json"
TEST_RESULTS = offline.TEST_RESULTS
TESTS_PATH = "/tests"
SOLUTION_PATH = "/solution"
VERIFIER_TOOLKIT = "/albatross-offline-verifier"  # the toolkit's place in the verifier's view (+ a random tail)
_OUTPUT_TAIL = 400


class VerifierError(RuntimeError):
    """The verifier produced no usable reward (infrastructure or task error; never scored)."""


@dataclass
class VerifyResult:
    metrics: dict[str, float]
    reward: float
    success: bool
    error: str = ""  # a non-fatal note, e.g. "test.sh exited with code 1"; empty when clean
    output: str = field(default="", repr=False)  # what test.sh printed
    source: str = "reward.json"  # reward.json, reward.txt, or reward.txt+tests (per-test metrics)
    problem: str = ""  # per-test results that contradict the reward; empty when consistent
    system_changes: list[str] = field(default_factory=list)  # toolchain "attempt": its changes to system paths


@dataclass
class VerifierRun:
    """One run of test.sh: what it printed and either a usable result or why there is none."""

    run: ExecResult
    result: VerifyResult | None
    error: str = ""


def verify_attempt(attempt: Attempt, task: Task, backend: Backend, limits: Limits | None = None) -> VerifyResult:
    """Verify an attempt (a model's or the oracle's). No usable reward is the attempt's failure (reward
    0, ``error`` says why) if the verifier writes one on an untouched fork of the task; else
    ``VerifierError``. A sandbox the attempt broke (``AttemptBroken``: killed after it ran out of memory)
    is its failure on the same terms."""
    try:
        outcome = run_verifier(attempt, task)
    except AttemptBroken as err:
        outcome = VerifierRun(ExecResult(str(err), -1), None, str(err))
    if outcome.result is not None:
        return outcome.result
    if not _untouched.works(backend, task, limits):
        raise VerifierError(f"{task.id}: {outcome.error} (on an untouched fork of the task too)")
    return VerifyResult({"reward": 0.0}, 0.0, False, source="none", output=outcome.run.output,
                        error=f"no reward after the attempt, scored 0: {outcome.error}")


class _UntouchedCheck:
    """Whether a task's verifier writes a reward on an untouched fork, found once per task and backend
    (concurrent askers wait for the first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: weakref.WeakKeyDictionary[Backend, dict[tuple[str, str], bool]] = weakref.WeakKeyDictionary()
        self._locks: dict[tuple[int, str, str], threading.Lock] = {}

    def works(self, backend: Backend, task: Task, limits: Limits | None) -> bool:
        key = (str(task.tests_dir.resolve()), str(task.env_dir))
        with self._lock:
            known = self._known.setdefault(backend, {})
            once = self._locks.setdefault((id(backend), *key), threading.Lock())
        with once:
            if key not in known:
                known[key] = self._check(backend, task, limits)
            return known[key]

    @staticmethod
    def _check(backend: Backend, task: Task, limits: Limits | None) -> bool:
        attempt = backend.fork(task.env_dir, task.workdir, limits)
        try:
            return run_verifier(attempt, task).result is not None
        finally:
            attempt.close()


_untouched = _UntouchedCheck()


def run_verifier(attempt: Attempt, task: Task) -> VerifierRun:
    """Copy tests/ to /tests, run test.sh from the task's workdir, and read the reward it wrote: the run and
    its result, or why there is none. Scoring an attempt is ``verify_attempt``'s; this is its one run of
    test.sh, and the gates' (they judge the task itself, so no usable reward is their finding, not a score)."""
    if not task.keep_agent_processes:
        attempt.kill_all()  # the agent's background jobs die before anything of the verifier appears
    toolkit = None
    prefix = ""
    if _uses_toolkit(task.tests_dir):  # a fresh toolkit at an unpredictable path, read-only
        toolkit = (offline.toolkit_dir(), f"{VERIFIER_TOOLKIT}-{secrets.token_hex(6)}")
        prefix = f'export PATH="${{SANDBOX_ROOT:-}}{toolkit[1]}/bin:$PATH" && '
    spec = VerifierSpec(
        tests_dir=task.tests_dir, command=f'{prefix}bash --noprofile --norc "${{SANDBOX_ROOT:-}}{TESTS_PATH}/test.sh"',
        cwd=task.workdir, timeout_s=task.verifier_timeout_s,
        env={"ALBATROSS_TEST_RESULTS": TEST_RESULTS, "PYTHONNOUSERSITE": "1"}, toolkit=toolkit,
        reads=(REWARD_JSON, REWARD_TXT, TEST_RESULTS, CTRF_JSON), tests_path=TESTS_PATH, reward_dir=REWARD_DIR,
        toolchain=task.toolchain, keep_agent_processes=task.keep_agent_processes)
    done = attempt.verify(spec)
    if done.error:
        return VerifierRun(done.run, None, done.error)
    run = done.run
    tests = done.files.get(TEST_RESULTS) or done.files.get(CTRF_JSON)
    try:
        result = parse_reward(done.files.get(REWARD_JSON), done.files.get(REWARD_TXT), tests)
    except VerifierError as e:
        return VerifierRun(run, None, f"{e}{_describe(run)}")
    result.error = _describe(run).removeprefix("; ")
    result.output = run.output
    result.system_changes = done.system_changes
    return VerifierRun(run, result)


def keeps_agent_processes(task: Task) -> bool:
    """True when the task's task.toml says ``[verifier] keep_agent_processes = true``."""
    return task.keep_agent_processes


def run_oracle(attempt: Attempt, task: Task) -> ExecResult:
    """Copy solution/ to /solution and run solve.sh from the task's workdir (agent timeout)."""
    if not (task.solution_dir / "solve.sh").is_file():
        raise TaskFormatError(f"{task.solution_dir / 'solve.sh'}: missing")
    attempt.put_dir(task.solution_dir, SOLUTION_PATH)
    prefix = _toolkit_prefix(attempt, task.solution_dir)
    command = f"{prefix}cd {shlex.quote(task.workdir)} && bash {SOLUTION_PATH}/solve.sh"
    return attempt.exec(f"( {command} )", timeout_s=task.agent_timeout_s)


def _uses_toolkit(scripts_dir: Path) -> bool:
    """Whether a script in ``scripts_dir`` calls a tool the offline toolkit stands in for."""
    scripts = [p for p in sorted(scripts_dir.rglob("*.sh")) if p.is_file()]
    return any(offline.uses_toolkit(p.read_text(encoding="utf-8", errors="replace")) for p in scripts)


def _toolkit_prefix(attempt: Attempt, scripts_dir: Path) -> str:
    """Put a fresh toolkit (at a path the agent cannot predict) into the attempt when the scripts in
    ``scripts_dir`` call a tool it stands in for; returns the shell prefix that puts it on PATH."""
    if not _uses_toolkit(scripts_dir):
        return ""
    path = f"{TOOLKIT_PATH}-{secrets.token_hex(6)}"
    attempt.put_dir(offline.toolkit_dir(), path)
    return f"export PATH={path}/bin:$PATH && "


def parse_reward(
    reward_json: bytes | None, reward_txt: bytes | None, tests_json: bytes | None = None
) -> VerifyResult:
    """Turn the contents of reward.json / reward.txt / per-test results (None if absent) into a
    ``VerifyResult``."""
    if reward_json is not None:
        metrics = _parse_json(reward_json)
        values = list(metrics.values())
        return VerifyResult(metrics, sum(values) / len(values), all(v == 1.0 for v in values))
    if reward_txt is not None:
        reward = _check("reward.txt", _parse_number(reward_txt))
        tests = parse_test_results(tests_json)
        if not tests:
            return VerifyResult({"reward": reward}, reward, reward == 1.0, source="reward.txt")
        return VerifyResult(tests, reward, reward == 1.0, source="reward.txt+tests",
                            problem=_contradiction(reward, tests))
    raise VerifierError(f"no reward file: test.sh wrote neither {REWARD_JSON} nor {REWARD_TXT}")


def parse_test_results(raw: bytes | None) -> dict[str, float]:
    """Per-test results (name -> 1.0 passed / 0.0 failed; skipped tests left out) from the toolkit's
    results file or a CTRF report; {} when absent or unreadable."""
    if not raw:
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
        tests = data["results"]["tests"] if "results" in data else data["tests"]
        return {str(t["name"]): 1.0 if t["status"] == "passed" else 0.0
                for t in tests if t.get("status") in ("passed", "failed", "error")}
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return {}


def _contradiction(reward: float, tests: dict[str, float]) -> str:
    failed = sorted(name for name, value in tests.items() if value < 1.0)
    if reward == 1.0 and failed:
        return f"reward.txt is 1 but {len(failed)} of {len(tests)} tests failed ({', '.join(failed[:3])})"
    if reward == 0.0 and not failed:
        return f"reward.txt is 0 but all {len(tests)} tests passed"
    return ""


def _parse_json(raw: bytes) -> dict[str, float]:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VerifierError(f"reward.json: invalid JSON: {e}") from None
    if not isinstance(data, dict) or not data:
        raise VerifierError("reward.json: must be a non-empty object of test name -> number")
    metrics: dict[str, float] = {}
    for name, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise VerifierError(f"reward.json: {name} must be a number, got {value!r}")
        metrics[name] = _check(f"reward.json: {name}", float(value))
    return metrics


def _parse_number(raw: bytes) -> float:
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        return float(text)
    except ValueError:
        raise VerifierError(f"reward.txt: not a number: {text[:80]!r}") from None


def _check(where: str, value: float) -> float:
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise VerifierError(f"{where}: {value} is not a finite number in [0, 1]")
    return value


def _describe(run: ExecResult) -> str:
    if run.timed_out:
        note = "; test.sh timed out"
    elif run.exit_code != 0:
        note = f"; test.sh exited with code {run.exit_code}"
    else:
        return ""
    tail = run.output[-_OUTPUT_TAIL:].replace("\n", " | ").strip()
    return f"{note}: {tail}" if tail else note
