"""One attempt, retried on a fresh fork while it ends in an infrastructure error: the one retry loop that
training, evaluation and the probe share (DESIGN.md: infrastructure errors are never scored)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from albatross.records import STATUS_INFRA_ERROR, Trajectory

if TYPE_CHECKING:  # annotations only
    from albatross.harness.agent import AttemptSpec


class Runner(Protocol):
    """Anything that runs one attempt: the harness's agent (``harness.agent.AgentLoop``) or
    ``eval.oracle.OracleAgent``."""

    def run(self, spec: AttemptSpec) -> Trajectory: ...


def run_with_retries(agent: Runner, spec: AttemptSpec, retries: int, counts: Counter[str],
                     on_try: Callable[[Trajectory], None] | None = None) -> Trajectory:
    """Run ``spec`` with ``agent`` up to ``retries + 1`` times, until a try is not an infrastructure error.

    Every failed try is counted in ``counts["infra_error_attempts"]`` and by kind in ``infra_error:<kind>``
    (the error's class: ForkError, SandboxDied, VerifierError, ...); every try, failed or not, goes to
    ``on_try``. The last try is returned (an infrastructure error when all of them were)."""
    for _ in range(retries + 1):
        traj = agent.run(spec)
        if traj.status == STATUS_INFRA_ERROR:
            counts["infra_error_attempts"] += 1
            counts[f"infra_error:{traj.error.split(':', 1)[0].strip() or 'unknown'}"] += 1
        if on_try is not None:
            on_try(traj)
        if traj.status != STATUS_INFRA_ERROR:
            break
    return traj
