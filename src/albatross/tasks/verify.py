"""Run a task's verifier (tests/test.sh) or its oracle (solution/solve.sh) inside an attempt.

The verifier writes ``/logs/verifier/reward.json`` (an object mapping test name -> number in [0, 1])
or ``/logs/verifier/reward.txt`` (one number in [0, 1]). When both exist, reward.json wins.

- reward.json: ``metrics`` is the object, ``reward`` the mean of its values, ``success`` is true when
  every value is 1.0.
- reward.txt: ``metrics`` is ``{"reward": r}``, ``reward`` is r, ``success`` is ``r == 1.0``.

A missing or malformed reward file, a non-finite value or one outside [0, 1] raises ``VerifierError``:
it is an infrastructure or task error and is never scored as zero.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field

from albatross.sandbox.base import Attempt, ExecResult
from albatross.tasks.format import Task, TaskFormatError

REWARD_DIR = "/logs/verifier"
REWARD_JSON = f"{REWARD_DIR}/reward.json"
REWARD_TXT = f"{REWARD_DIR}/reward.txt"
TESTS_PATH = "/tests"
SOLUTION_PATH = "/solution"
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


def verify(attempt: Attempt, task: Task) -> VerifyResult:
    """Copy tests/ to /tests, run test.sh from the task's workdir, and read the reward it wrote."""
    # Remove any reward file the agent may have left, so only test.sh can produce one.
    attempt.exec(f"rm -f {REWARD_JSON} {REWARD_TXT}", timeout_s=30)
    attempt.put_dir(task.tests_dir, TESTS_PATH)
    command = f"mkdir -p {REWARD_DIR} && cd {shlex.quote(task.workdir)} && bash {TESTS_PATH}/test.sh"
    run = attempt.exec(f"( {command} )", timeout_s=task.verifier_timeout_s)
    try:
        result = parse_reward(attempt.read_file(REWARD_JSON), attempt.read_file(REWARD_TXT))
    except VerifierError as e:
        raise VerifierError(f"{task.id}: {e}{_describe(run)}") from None
    result.error = _describe(run).removeprefix("; ")
    result.output = run.output
    return result


def run_oracle(attempt: Attempt, task: Task) -> ExecResult:
    """Copy solution/ to /solution and run solve.sh from the task's workdir (agent timeout)."""
    if not (task.solution_dir / "solve.sh").is_file():
        raise TaskFormatError(f"{task.solution_dir / 'solve.sh'}: missing")
    attempt.put_dir(task.solution_dir, SOLUTION_PATH)
    command = f"cd {shlex.quote(task.workdir)} && bash {SOLUTION_PATH}/solve.sh"
    return attempt.exec(f"( {command} )", timeout_s=task.agent_timeout_s)


def parse_reward(reward_json: bytes | None, reward_txt: bytes | None) -> VerifyResult:
    """Turn the contents of reward.json / reward.txt (None if absent) into a ``VerifyResult``."""
    if reward_json is not None:
        metrics = _parse_json(reward_json)
        values = list(metrics.values())
        return VerifyResult(metrics, sum(values) / len(values), all(v == 1.0 for v in values))
    if reward_txt is not None:
        reward = _check("reward.txt", _parse_number(reward_txt))
        return VerifyResult({"reward": reward}, reward, reward == 1.0)
    raise VerifierError(f"no reward file: test.sh wrote neither {REWARD_JSON} nor {REWARD_TXT}")


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
