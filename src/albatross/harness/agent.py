"""The agent loop: one attempt at one task, token-in/token-out, in a forked sandbox.

Control flow by small exceptions, as in mini-swe-agent: a malformed action is an observation, a budget
ends the attempt with its own status (turns ``max_turns``, generated tokens ``max_tokens``, context
``max_context``, wall time ``agent_timeout``), an infrastructure failure ends it as ``infra_error``
(retried by the caller, never scored). Before a turn that would not fit under ``compress_at`` of the
context budget, the context is compressed (``context.py``); each compression starts a new sample.

``albatross train`` and ``albatross eval`` both run attempts through ``Agent.run`` with the same
``[harness]`` config section (build it with ``build_agent``). ``action_format = "auto"`` is resolved once, from the
chat format (``chat.resolve_action_format``). With a history-rewriting chat template (``fmt.append_only`` False)
or ``reasoning = "strip"``, the context after each observation is the conversation re-rendered
(``fmt.conversation``), which is no longer a prefix of the old one: each turn starts a new sample.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

from albatross.config import HarnessConfig, RunConfig
from albatross.engine.base import Completion, Engine, EngineError, SamplingParams
from albatross.harness.chat import ChatFormat, make_chat_format, resolve_action_format
from albatross.harness.context import SUMMARY_HEADER, SUMMARY_REQUEST, Context
from albatross.harness.hf_chat import strip_reasoning
from albatross.harness.parsers import SUBMIT, BashBlockParser, FormatError, Parser, ToolCallParser
from albatross.harness.tools import BASH_TOOLS_HINT, TOOL_SCHEMAS, TOOLS, Observation, Toolbox, repo_diff
from albatross.records import (
    STATUS_AGENT_TIMEOUT,
    STATUS_FORMAT_ERROR,
    STATUS_INFRA_ERROR,
    STATUS_MAX_CONTEXT,
    STATUS_MAX_TOKENS,
    STATUS_MAX_TURNS,
    STATUS_OK,
    Reward,
    Trajectory,
    Turn,
)
from albatross.sandbox.base import Attempt, Backend, Limits, SandboxError
from albatross.tasks.format import Task, attempt_limits
from albatross.tasks.verify import VerifierError, verify_attempt


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

    def __init__(self, engine: Engine | None, backend: Backend, fmt: ChatFormat, cfg: HarnessConfig,
                 sampling: SamplingParams, limits: Limits) -> None:
        self.engine, self.backend, self.fmt, self.cfg = engine, backend, fmt, cfg
        self.limits = limits
        self.sampling = SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=cfg.max_tokens_per_turn, stop_token_ids=fmt.stop_ids, seed=sampling.seed)
        self.tool_calls = resolve_action_format(cfg, fmt) == "tool_calls"
        self.rerender = not fmt.append_only or cfg.reasoning == "strip"
        offered = set(cfg.tools or TOOL_SCHEMAS) | {SUBMIT}  # harness.tools: a subset of the built-ins
        self.tools = [t for t in TOOLS if t["function"]["name"] in offered]
        self.parser: Parser = (ToolCallParser({n: s for n, s in TOOL_SCHEMAS.items() if n in offered})
                               if self.tool_calls else BashBlockParser())

    def run(self, spec: AttemptSpec, engine: Engine | None = None) -> Trajectory:
        traj = Trajectory(task_id=spec.task.id, group_id=spec.group_id, attempt=spec.attempt)
        start = time.monotonic()
        attempt: Attempt | None = None
        episode: Episode | None = None
        engine = engine or self.engine
        if engine is None:
            raise ValueError("Agent.run needs an engine (set agent.engine or pass engine=)")
        session: Engine | None = None
        try:
            # an engine pool keeps the attempt on one replica (the one holding its KV cache)
            session = engine.session()
            limits = attempt_limits(spec.task, self.limits)  # the task's own, under the run's ceiling
            traj.network = limits.network
            attempt = self.backend.fork(spec.task.env_dir, spec.task.workdir, limits)
            # the agent's clock starts with its sandbox: a slow fork (a build, a busy host) is not its time
            episode = Episode(self, spec.task, attempt, traj, session, time.monotonic())
            traj.status = episode.run()
            traj.diff = repo_diff(attempt, spec.task.workdir)  # what the attempt changed, when the workdir is a repo
            self._verify(spec.task, attempt, traj, limits)
        except (SandboxError, VerifierError, EngineError, OSError) as e:
            traj.status, traj.error = STATUS_INFRA_ERROR, f"{type(e).__name__}: {e}"
        finally:
            if session is not None:
                session.close()
            if attempt is not None:
                self._close(attempt, episode, traj)
        traj.wall_seconds = time.monotonic() - start
        return traj

    def _close(self, attempt: Attempt, episode: Episode | None, traj: Trajectory) -> None:
        if episode is not None and episode.toolbox.dir and not self.backend.isolated:
            with contextlib.suppress(Exception):  # an isolated sandbox's close kills jobs itself
                episode.toolbox.kill_jobs()
        try:
            attempt.close()
        except Exception as e:  # a failed close is an infra error, never a crash
            traj.status, traj.error = STATUS_INFRA_ERROR, f"close failed: {e}"

    def _verify(self, task: Task, attempt: Attempt, traj: Trajectory, limits: Limits) -> None:
        result = verify_attempt(attempt, task, self.backend, limits)
        traj.reward = Reward(metrics=dict(result.metrics), success=result.success)
        traj.system_changes = result.system_changes


def request_seed(seed: int | None, traj: Trajectory, n: int) -> int | None:
    """The sampling seed of an attempt's ``n``-th engine request under the base ``seed`` (None: unseeded): a hash of
    (seed, group, attempt, n), so each request draws apart and a rerun of the same attempt draws the same."""
    if seed is None:
        return None
    key = f"{seed}\0{traj.group_id}\0{traj.attempt}\0{n}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1  # < 2**63: every engine's range


class Episode:
    """The state of one attempt in progress: its context, tools, budgets and trajectory."""

    def __init__(self, agent: Agent, task: Task, attempt: Attempt, traj: Trajectory, engine: Engine,
                 start: float) -> None:
        self.agent, self.cfg, self.fmt, self.traj, self.engine = agent, agent.cfg, agent.fmt, traj, engine
        self.wall_limit = min(self.cfg.attempt_timeout_s, task.agent_timeout_s or self.cfg.attempt_timeout_s)
        self.start = start
        self.toolbox = Toolbox(attempt, self.cfg.max_observation_chars, agent.limits.command_timeout_s,
                               redirect=self.cfg.redirect_output)
        self.toolbox.deadline = start + self.wall_limit
        instruction = task.instruction
        if not agent.tool_calls and self.cfg.bash_tools_hint:
            instruction = instruction.strip() + "\n" + BASH_TOOLS_HINT
        self.ctx = Context(self.fmt, instruction, agent.tools if agent.tool_calls else None)
        self._new_sample(len(self.ctx))
        self.format_errors = 0
        self.requests = 0  # engine requests so far (each seeded apart: ``request_seed``)

    def run(self) -> str:
        self.toolbox.setup()
        try:
            for _ in range(self.cfg.max_turns):
                self._check_budgets()
                self._act(self._generate())
            return STATUS_MAX_TURNS
        except _Done as done:
            return done.status

    # budgets and compression ------------------------------------------------------------------------
    def _check_budgets(self) -> None:
        cfg, per_turn = self.cfg, self.cfg.max_tokens_per_turn
        trigger = cfg.compress_at * cfg.max_context_tokens
        if cfg.compression != "none" and len(self.ctx) + per_turn > trigger:
            self._compress()
        if len(self.ctx) + per_turn > cfg.max_context_tokens:
            raise _Done(STATUS_MAX_CONTEXT)
        if time.monotonic() - self.start > self.wall_limit:
            raise _Done(STATUS_AGENT_TIMEOUT)
        if self._generation_left() <= 0:
            raise _Done(STATUS_MAX_TOKENS)

    def _generation_left(self) -> int:
        budget = self.cfg.max_generated_tokens
        return budget - self.traj.completion_tokens if budget > 0 else 1 << 62

    def _compress(self) -> None:
        cfg, keep = self.cfg, self.cfg.keep_observations
        if self.traj.compressions and self.traj.compressions[-1]["turn"] == len(self.traj.turns):
            return  # compressed already before this turn: the context budget decides
        before = len(self.ctx)
        ids = self.ctx.masked_ids(keep)
        method, extra = "mask", {}
        if (len(ids) + cfg.max_tokens_per_turn > cfg.compress_target * cfg.max_context_tokens
                and cfg.compression == "mask_summary"):
            method, extra = "summary", {"summary_tokens": self._summarise(ids)}
            ids = self.ctx.summarised(self.ctx.summary_text, keep)
        elif len(ids) >= before:
            return  # nothing to gain; the context budget ends the attempt
        self.ctx.restart(ids)
        self._new_sample(len(ids))
        self.traj.compressions.append({
            "turn": len(self.traj.turns), "reason": "context", "method": method, "tokens_before": before,
            "tokens_after": len(ids), "sample": len(self.traj.samples) - 1, **extra})

    def _summarise(self, masked: list[int]) -> int:
        """Continue the masked context with the summary request and let the model write the summary
        (its own sample: the summary's tokens are the model's); returns how many tokens it wrote."""
        self.ctx.restart(masked)
        self._new_sample(len(masked))
        request = self.fmt.user(SUMMARY_REQUEST, closed=False)
        self.ctx.sample.extend(request, model=False)
        self.traj.prompt_tokens += len(request)
        room = min(self.cfg.summary_max_tokens, self.cfg.max_context_tokens - len(self.ctx),
                   self._generation_left())
        self.ctx.summary_text = ""
        if room < 1:
            return 0
        completion = self._complete(room)
        self.ctx.sample.extend(completion.token_ids, model=True, logprobs=completion.logprobs,
                               versions=completion.versions, routing=completion.routing)
        self.ctx.summary_text = self.fmt.decode(completion.token_ids)
        return len(completion.token_ids)

    def _new_sample(self, prompt_tokens: int) -> None:
        self.traj.samples.append(self.ctx.sample)
        self.traj.prompt_tokens += prompt_tokens

    # one turn -----------------------------------------------------------------------------------------
    def _complete(self, max_tokens: int) -> Completion:
        params = replace(self.agent.sampling, max_tokens=max_tokens,
                         seed=request_seed(self.agent.sampling.seed, self.traj, self.requests))
        self.requests += 1
        completion = self.engine.generate([list(self.ctx.sample.token_ids)], params)[0]
        self.traj.input_tokens += len(self.ctx)
        self.traj.completion_tokens += len(completion.token_ids)
        return completion

    def _generate(self) -> str:
        context = len(self.ctx)
        completion = self._complete(min(self.cfg.max_tokens_per_turn, self._generation_left()))
        self.ctx.add_action(completion.token_ids, completion.logprobs, completion.versions, completion.routing)
        text = self.fmt.decode(completion.token_ids)
        self.traj.turns.append(Turn(text, None, "", len(completion.token_ids), 0, context_tokens=context))
        return text

    def _act(self, text: str) -> None:
        try:
            action = self.agent.parser.parse(text)
        except FormatError as e:
            self.format_errors += 1
            if self.format_errors >= self.cfg.max_format_errors:
                raise _Done(STATUS_FORMAT_ERROR) from None
            self._observe(Observation(str(e) + "\n"))
            return
        self.format_errors = 0
        turn = self.traj.turns[-1]
        turn.tool, turn.command = action.tool, action.command
        if action.tool == SUBMIT:
            raise _Done(STATUS_OK)
        self._observe(self.toolbox.call(action))

    def _observe(self, obs: Observation) -> None:
        ids = self.ctx.add_observation(obs.text)
        self.traj.prompt_tokens += len(ids)
        turn = self.traj.turns[-1]
        turn.observation, turn.observation_tokens = obs.text, len(ids)
        if obs.exit_code is not None:
            turn.exit_code, turn.timed_out, turn.seconds = obs.exit_code, obs.timed_out, obs.seconds
        if self.agent.rerender:
            self._rerender()

    def _rerender(self) -> None:
        """Start the next turn's sample from the conversation re-rendered by the chat template (earlier
        actions without their reasoning when ``reasoning = "strip"``), since the template rewrites history.
        After a summary the conversation starts from the summarised instruction; masked observations are
        not re-rendered masked."""
        strip = self.cfg.reasoning == "strip"
        turns = [(strip_reasoning(t.action) if strip else t.action, t.observation)
                 for t in self.traj.turns[self.ctx.base:]]
        summary = self.ctx.summary_text.strip()
        instruction = self.ctx.instruction.strip() + (SUMMARY_HEADER + summary if self.ctx.base and summary else "")
        ids = self.fmt.conversation(instruction, self.ctx.tools, turns)
        self.ctx.restart(ids)
        self._new_sample(len(ids))


class AgentLoop(Protocol):
    """What training and evaluation use of an agent: ``harness.agent`` plugs in any object with these members
    (the built-in ``Agent`` is one). ``run`` plays one attempt with ``engine`` (else ``self.engine``, which the
    run sets once its engine is up) in a sandbox forked from ``backend``, verifies it, and returns the
    ``Trajectory``: its ``samples`` (token ids, sampler log-probs, policy versions, loss mask) are what the
    trainer learns from; an infrastructure failure is status ``infra_error`` (retried, never scored)."""

    engine: Engine | None
    backend: Backend

    def run(self, spec: AttemptSpec, engine: Engine | None = None) -> Trajectory: ...


# ``harness.agent``'s function: (run config, engine, sandbox backend, tokenizer) -> the agent; the tokenizer is a
# transformers tokenizer (untyped) or the demo's ``TinyTokenizer``
AgentFactory = Callable[[RunConfig, Engine | None, Backend, Any], AgentLoop]


def build_agent(cfg: RunConfig, engine: Engine | None, backend: Backend, tokenizer: Any) -> AgentLoop:
    """The agent of a run config: the one constructor ``train`` and ``eval`` share; with ``harness.agent`` set,
    the agent that function builds, else the built-in one (``builtin_agent``). ``tokenizer``: a transformers
    tokenizer or the demo's ``TinyTokenizer``."""
    if cfg.harness.agent:
        return load_agent_factory(cfg.harness.agent)(cfg, engine, backend, tokenizer)
    return builtin_agent(cfg, engine, backend, tokenizer)


def builtin_agent(cfg: RunConfig, engine: Engine | None, backend: Backend, tokenizer: Any) -> Agent:
    """The built-in agent loop of a run config, whatever ``harness.agent`` says (demonstrations, the no-op agent)."""
    limits = Limits.from_config(cfg.sandbox)
    sampling = SamplingParams(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                              top_k=cfg.sampling.top_k, seed=cfg.sampling.seed if cfg.sampling.seed >= 0 else None)
    return Agent(engine, backend, make_chat_format(tokenizer, cfg.harness), cfg.harness, sampling, limits)


def load_agent_factory(spec: str) -> AgentFactory:
    """The function ``harness.agent`` names: ``package.module:function`` or ``path/to/file.py:function``.
    A spec that does not resolve is a ``UserError`` naming it."""
    import importlib
    import importlib.util
    from pathlib import Path

    from albatross.errors import UserError

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UserError(f"harness.agent {spec!r}: expected module:function or file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser().resolve()
            loader = importlib.util.spec_from_file_location(f"albatross_agent_{path.stem}", path)
            if loader is None or loader.loader is None or not path.is_file():
                raise FileNotFoundError(f"{path}: no such file")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (ImportError, OSError, SyntaxError) as e:
        raise UserError(f"harness.agent {spec!r}: cannot load {where}: {e}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UserError(f"harness.agent {spec!r}: {where} has no function {name!r}")
    return cast(AgentFactory, factory)  # the user's function: only that it is callable can be checked
