"""`--agent oracle`: each task's reference solution through the same sandbox and verifier.

A check of the tasks, not of a model: on a sound task set every attempt succeeds (Pass@1 = 1.0). The
oracle runs with the task's own memory, storage and network policy under the run's limits (a ceiling
the task cannot raise), and its time limit is the task's agent timeout. It is verified as a model's
attempt is (``verify_attempt``): an oracle that breaks its own attempt (a full disk, ...) is a scored
failure; failures to fork, build, or a verifier that fails on an untouched fork too, are infrastructure
errors, as in the harness.
"""

from __future__ import annotations

import time
from dataclasses import replace

from albatross.harness.agent import AttemptSpec
from albatross.records import STATUS_INFRA_ERROR, Reward, Trajectory, Turn
from albatross.sandbox.base import Attempt, Backend, Limits, SandboxError
from albatross.tasks.format import Task, TaskFormatError, attempt_limits
from albatross.tasks.verify import SOLUTION_PATH, VerifierError, run_oracle, verify_attempt

ORACLE_COMMAND = f"bash {SOLUTION_PATH}/solve.sh"
_TAIL = 2000


class OracleAgent:
    """Runs ``solution/solve.sh`` in a forked attempt, then the verifier. No model, no tokens."""

    name = "oracle"

    def __init__(self, backend: Backend, limits: Limits | None = None) -> None:
        self.backend = backend
        self.limits = limits or Limits()

    def run(self, spec: AttemptSpec) -> Trajectory:
        task = spec.task
        traj = Trajectory(task_id=task.id, group_id=spec.group_id, attempt=spec.attempt)
        start = time.monotonic()
        attempt: Attempt | None = None
        try:
            limits = self._limits(task)
            traj.network = limits.network
            attempt = self.backend.fork(task.env_dir, task.workdir, limits)
            self._solve(attempt, task, traj, limits)
        except (SandboxError, VerifierError, TaskFormatError, OSError) as e:
            traj.status, traj.error = STATUS_INFRA_ERROR, f"{type(e).__name__}: {e}"
        finally:
            if attempt is not None:
                try:
                    attempt.close()
                except Exception as e:  # a failed close is an infra error, never a crash
                    traj.status, traj.error = STATUS_INFRA_ERROR, f"close failed: {e}"
        traj.wall_seconds = time.monotonic() - start
        return traj

    def _limits(self, task: Task) -> Limits:
        return replace(attempt_limits(task, self.limits), command_timeout_s=task.agent_timeout_s)

    def _solve(self, attempt: Attempt, task: Task, traj: Trajectory, limits: Limits) -> None:
        run = run_oracle(attempt, task)
        traj.turns.append(Turn(action=ORACLE_COMMAND, command=ORACLE_COMMAND, observation=run.output[-_TAIL:],
                               completion_tokens=0, observation_tokens=0, exit_code=run.exit_code,
                               timed_out=run.timed_out, seconds=run.seconds))
        result = verify_attempt(attempt, task, self.backend, limits)
        traj.system_changes = result.system_changes
        traj.reward = Reward(metrics=dict(result.metrics), success=result.success,
                             partial_credit=result.reward, score=1.0 if result.success else 0.0)
        if not result.success:
            tail = result.output[-_TAIL:].strip()
            traj.error = "; ".join(x for x in (result.error, f"verifier output: {tail}" if tail else "") if x)
