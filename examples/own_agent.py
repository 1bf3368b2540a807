"""An agent loop of your own, plugged into albatross.

Training and evaluation run every attempt through an agent: any object with ``engine``, ``backend`` and
``run(spec, engine=None) -> Trajectory`` (``albatross.harness.agent.AgentLoop``). This one is a plain loop written
from albatross's public pieces: the model's chat format (``make_chat_format``), a token-exact context
(``Context``: the sample grows by the engine's own token ids, so the trainer learns from exactly what was
sampled), fenced-bash actions (``BashBlockParser``), a shell in the forked sandbox (``Toolbox``) and the task's
verifier (``verify_attempt``).

Use it for a run with

    [harness]
    agent = "examples/own_agent.py:build"

or run this file: it plays two built-in tasks with a scripted "model" (one that types each task's oracle
steps, and one that gives a wrong answer) and prints how each attempt ended and what the verifier said.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from albatross.engine.base import EngineError, SamplingParams
from albatross.harness.agent import AttemptSpec
from albatross.harness.chat import make_chat_format
from albatross.harness.context import Context
from albatross.harness.parsers import SUBMIT, BashBlockParser, FormatError
from albatross.harness.tools import Toolbox
from albatross.records import STATUS_INFRA_ERROR, STATUS_MAX_TURNS, STATUS_OK, Reward, Trajectory, Turn
from albatross.sandbox.base import Limits, SandboxError
from albatross.tasks.verify import VerifierError, verify_attempt


class ShellAgent:
    """Up to ``max_turns`` turns of: the model writes one fenced bash block, the sandbox runs it, the output is
    the next observation; the block ``submit`` ends the attempt, which the task's tests then score."""

    def __init__(self, engine: Any, backend: Any, fmt: Any, limits: Limits, sampling: SamplingParams,
                 max_turns: int = 8, max_tokens_per_turn: int = 256, max_output_chars: int = 2000) -> None:
        self.engine, self.backend, self.fmt, self.limits = engine, backend, fmt, limits
        self.sampling = replace(sampling, max_tokens=max_tokens_per_turn, stop_token_ids=fmt.stop_ids)
        self.max_turns, self.max_output_chars = max_turns, max_output_chars
        self.parser = BashBlockParser()

    def run(self, spec: AttemptSpec, engine: Any = None) -> Trajectory:
        engine = engine or self.engine
        traj = Trajectory(task_id=spec.task.id, group_id=spec.group_id, attempt=spec.attempt)
        start = time.monotonic()
        try:
            attempt = self.backend.fork(spec.task.env_dir, spec.task.workdir, self.limits)
        except SandboxError as e:  # never the attempt's fault: retried by the caller, never scored
            traj.status, traj.error = STATUS_INFRA_ERROR, f"fork: {e}"
            return traj
        try:
            traj.status = self._play(spec, engine, attempt, traj)
            result = verify_attempt(attempt, spec.task, self.backend, self.limits)
            traj.reward = Reward(metrics=dict(result.metrics), success=result.success)
        except (SandboxError, VerifierError, EngineError) as e:
            traj.status, traj.error = STATUS_INFRA_ERROR, f"{type(e).__name__}: {e}"
        finally:
            attempt.close()
            traj.wall_seconds = time.monotonic() - start
        return traj

    def _play(self, spec: AttemptSpec, engine: Any, attempt: Any, traj: Trajectory) -> str:
        ctx = Context(self.fmt, spec.task.instruction)  # the prompt, in the model's own chat template
        traj.samples.append(ctx.sample)
        traj.prompt_tokens += len(ctx)
        shell = Toolbox(attempt, self.max_output_chars, self.limits.command_timeout_s, redirect=False)
        shell.setup()
        for _ in range(self.max_turns):
            done = engine.generate([list(ctx.sample.token_ids)], self.sampling)[0]
            ctx.add_action(done.token_ids, done.logprobs, done.versions)  # trained on: the model's own tokens
            text = self.fmt.decode(done.token_ids)
            traj.completion_tokens += len(done.token_ids)
            try:
                action = self.parser.parse(text)
            except FormatError as e:  # bad model output is an observation, never a crash
                observation, command = f"{e}\n", None
            else:
                if action.tool == SUBMIT:
                    traj.turns.append(Turn(text, SUBMIT, "", len(done.token_ids), 0, tool=SUBMIT))
                    return STATUS_OK
                observation, command = shell.call(action).text, action.command
            ids = ctx.add_observation(observation)
            traj.turns.append(Turn(text, command, observation, len(done.token_ids), len(ids), tool="bash"))
        return STATUS_MAX_TURNS


def build(cfg: Any, engine: Any, backend: Any, tokenizer: Any) -> ShellAgent:
    """``harness.agent = "examples/own_agent.py:build"``: the agent of a run config."""
    sampling = SamplingParams(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k)
    return ShellAgent(engine, backend, make_chat_format(tokenizer, cfg.harness), Limits.from_config(cfg.sandbox),
                      sampling, max_turns=cfg.harness.max_turns, max_tokens_per_turn=cfg.harness.max_tokens_per_turn)


def main() -> int:
    from albatross.config import load_config
    from albatross.engine.scripted import ScriptedEngine
    from albatross.harness.parsers import write_command
    from albatross.pipeline.demo import demo_tokenizer
    from albatross.sandbox import local_available, make_backend
    from albatross.tasks.builtin import generate_tasks
    from albatross.tasks.format import load_tasks

    root = Path(tempfile.mkdtemp(prefix="own-agent-"))
    generate_tasks(root, families=["count_lines"], n_train=2, n_heldout=0, seed=1)
    tasks = load_tasks(root / "train")
    kind = "local" if local_available() else "process"  # process: no isolation, for machines without root
    backend = make_backend(kind, **({"hide_paths": [str(root)]} if kind == "local" else {}))
    cfg = load_config(None, ["harness.action_format=bash_block"])
    agent = build(cfg, None, backend, demo_tokenizer())
    scripts = {"oracle": lambda task: [*task.demo_steps],
               "wrong answer": lambda task: ["echo 12345 > answer.txt", "submit"]}
    try:
        for task in tasks:
            for name, script in scripts.items():
                engine = ScriptedEngine([write_command(s, False) for s in script(task)], agent.fmt.action)
                traj = agent.run(AttemptSpec(task, "example", 0), engine=engine)
                print(f"{task.id}  {name:<12}  status {traj.status:<10}  success {traj.reward.success!s:<5}  "
                      f"turns {len(traj.turns)}  trained tokens {sum(s.num_model_tokens for s in traj.samples)}")
                if traj.status == STATUS_INFRA_ERROR or traj.reward.success != (name == "oracle"):
                    print(f"unexpected: {traj.error or traj.reward}", file=sys.stderr)
                    return 1
    finally:
        backend.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"sandbox: {kind}; the own loop solved every task with the oracle's steps and failed the wrong answers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
