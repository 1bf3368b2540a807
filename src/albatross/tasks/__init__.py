"""Tasks: Harbor / Terminal-Bench 2 task directories, their verifier, and built-in task families.

``albatross.tasks.builtin`` (generated families for the CPU demo) is imported on its own.
"""

from albatross.tasks.format import Task, TaskFormatError, load_task, load_tasks, write_task
from albatross.tasks.verify import VerifierError, VerifyResult, parse_reward, run_oracle, verify_attempt

__all__ = [
    "Task",
    "TaskFormatError",
    "VerifierError",
    "VerifyResult",
    "load_task",
    "load_tasks",
    "parse_reward",
    "run_oracle",
    "verify_attempt",
    "write_task",
]
