"""The agent loop: one attempt at one task, token-in/token-out, in a forked sandbox.

Control flow by small exceptions, as in mini-swe-agent: a malformed action is an observation, a budget
ends the attempt with its own status, an infrastructure failure ends it as ``infra_error`` (retried by
the caller, never scored).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from albatross.config import HarnessConfig
from albatross.engine.base import Engine, SamplingParams
from albatross.harness.chat import TinyChatFormat
from albatross.harness.parsers import SUBMIT, FormatError, parse_bash_block
from albatross.harness.tools import format_observation
from albatross.records import (
    STATUS_AGENT_TIMEOUT,
    STATUS_FORMAT_ERROR,
    STATUS_INFRA_ERROR,
    STATUS_MAX_TOKENS,
    STATUS_MAX_TURNS,
    STATUS_OK,
    Reward,
    Sample,
    Trajectory,
    Turn,
)
from albatross.sandbox.base import Attempt, Backend, Limits, SandboxError
from albatross.tasks.format import Task
from albatross.tasks.verify import VerifierError, verify


class _Done(Exception):
    def __init__(self, status: str) -> None:
        self.status = status


@dataclass
class AttemptSpec:
    task: Task
    group_id: str
    attempt: int


class Agent:
    """Runs attempts with one engine, sandbox backend, chat format and harness config."""

    def __init__(self, engine: Engine, backend: Backend, fmt: TinyChatFormat, cfg: HarnessConfig,
                 sampling: SamplingParams, limits: Limits) -> None:
        self.engine, self.backend, self.fmt, self.cfg = engine, backend, fmt, cfg
        self.limits = limits
        self.sampling = SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=cfg.max_tokens_per_turn, stop_token_ids=fmt.stop_ids, seed=sampling.seed)

    def run(self, spec: AttemptSpec, engine: Engine | None = None) -> Trajectory:
        traj = Trajectory(task_id=spec.task.id, group_id=spec.group_id, attempt=spec.attempt)
        start = time.monotonic()
        attempt: Attempt | None = None
        try:
            attempt = self.backend.fork(spec.task.env_dir, spec.task.workdir, self.limits)
            traj.status = self._loop(spec.task, attempt, traj, engine or self.engine, start)
            self._verify(spec.task, attempt, traj)
        except (SandboxError, VerifierError, OSError) as e:
            traj.status, traj.error = STATUS_INFRA_ERROR, f"{type(e).__name__}: {e}"
        finally:
            if attempt is not None:
                try:
                    attempt.close()
                except Exception as e:  # a failed close is an infra error, never a crash
                    traj.status, traj.error = STATUS_INFRA_ERROR, f"close failed: {e}"
        traj.wall_seconds = time.monotonic() - start
        return traj

    def _loop(self, task: Task, attempt: Attempt, traj: Traj, engine: Engine, start: float) -> str:
        sample = Sample([], [], [], [])
        traj.samples.append(sample)
        prompt = self.fmt.initial_prompt(task.instruction)
        sample.extend(prompt, model=False)
        traj.prompt_tokens += len(prompt)
        format_errors = 0
        try:
            for _ in range(self.cfg.max_turns):
                self._check_budgets(sample, start, task)
                text = self._generate(engine, sample, traj)
                try:
                    command = parse_bash_block(text)
                    format_errors = 0
                except FormatError as e:
                    format_errors += 1
                    if format_errors >= self.cfg.max_format_errors:
                        raise _Done(STATUS_FORMAT_ERROR) from None
                    self._observe(sample, traj, text, None, str(e) + "\n", None)
                    continue
                if command.strip() == SUBMIT:
                    traj.turns.append(Turn(text, command, "", 0, 0))
                    return STATUS_OK
                result = attempt.exec(command, self.limits.command_timeout_s)
                obs = format_observation(result, self.cfg.max_observation_chars)
                self._observe(sample, traj, text, command, obs, result)
            return STATUS_MAX_TURNS
        except _Done as done:
            return done.status

    def _check_budgets(self, sample: Sample, start: float, task: Task) -> None:
        if len(sample.token_ids) + self.cfg.max_tokens_per_turn > self.cfg.max_context_tokens:
            raise _Done(STATUS_MAX_TOKENS)
        limit = min(self.cfg.attempt_timeout_s, task.agent_timeout_s or self.cfg.attempt_timeout_s)
        if time.monotonic() - start > limit:
            raise _Done(STATUS_AGENT_TIMEOUT)

    def _generate(self, engine: Engine, sample: Sample, traj: Traj) -> str:
        completion = engine.generate([list(sample.token_ids)], self.sampling)[0]
        sample.extend(completion.token_ids, model=True, logprobs=completion.logprobs,
                      versions=completion.versions)
        traj.completion_tokens += len(completion.token_ids)
        traj.turns.append(Turn(self.fmt.tokenizer.decode(completion.token_ids), None, "",
                               len(completion.token_ids), 0))
        return traj.turns[-1].action

    def _observe(self, sample: Sample, traj: Traj, text: str, command: str | None, obs: str,
                 result) -> None:
        ids = self.fmt.observation(obs)
        sample.extend(ids, model=False)
        traj.prompt_tokens += len(ids)
        turn = traj.turns[-1]
        turn.command, turn.observation, turn.observation_tokens = command, obs, len(ids)
        if result is not None:
            turn.exit_code, turn.timed_out, turn.seconds = result.exit_code, result.timed_out, result.seconds

    def _verify(self, task: Task, attempt: Attempt, traj: Trajectory) -> None:
        result = verify(attempt, task)
        traj.reward = Reward(metrics=dict(result.metrics), success=result.success)


Traj = Trajectory
