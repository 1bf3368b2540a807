"""The nine validation gates of DESIGN.md: a task enters the training pool only when it passes all nine.

1 schema       files and fields valid (``load_task``) and an oracle ``solution/solve.sh`` present
2 build        the environment builds (its RUN steps reach the package registries, or any host under the
               ``open`` policy), within ``[environment] build_timeout_sec``; every Dockerfile instruction
               is honoured (or the line is named)
3 oracle       the oracle scores 1 (success)
4 noop         the untouched environment scores below 1; the tests it already passes are recorded
               (``TaskReport.untouched``: weight 0 in partial credit)
5 determinism  oracle and no-op give the same result over ``reruns`` runs each (default 3)
6 leakage      tests/ and solution/ are invisible to the agent: no file readable in an untouched attempt
               of the built image equals a test, expected-output or solution file (inputs the instruction
               hands over are allowed; ``tasks.leakage``; without a built image: no file the Dockerfile
               copies into it does), and nothing is copied to /tests or /solution
7 resources    the oracle and the verifier finish within the task's time and memory limits
8 offline      the environment builds and the oracle passes under the task's network policy (``none``
               unless the run's ``network`` and the task allow more)
9 reward       every verifier run wrote a finite reward in [0, 1] whose per-test breakdown agrees

A gate that cannot be judged because another failed is ``skip`` (with the reason), so a broken task
fails exactly the gate it breaks. A failure that shows network use (``offline.network_evidence``) is a
gate 8 failure; a run killed for time or memory is re-run with generous limits to tell gate 7 from
gate 3. Tasks are gated in parallel (``parallelism`` threads, default the number of cores); each
task's runs are sequential.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albatross.sandbox.base import LIMIT_OOM, Backend, ExecResult, Limits, Prepared, SandboxError
from albatross.sandbox.egress import narrowest
from albatross.tasks.buildable import dockerfile_notes, dockerfile_problem
from albatross.tasks.format import Task, TaskFormatError, attempt_limits, load_task
from albatross.tasks.leakage import find_static_leaks, placement_leaks, scan_for_leaks
from albatross.tasks.offline import network_evidence
from albatross.tasks.overrides import Override, apply_overrides
from albatross.tasks.verify import VerifierRun, VerifyResult, run_oracle, run_verifier

GATES = ("schema", "build", "oracle", "noop", "determinism", "leakage", "resources", "offline", "reward")
PASS, FAIL, SKIP = "pass", "fail", "skip"
_KILLED = (137, -9)
_REASON_CHARS = 400


@dataclass
class Gate:
    status: str
    reason: str = ""


@dataclass
class GateOptions:
    reruns: int = 3  # runs of the oracle and of the no-op for the determinism gate (>= 2)
    parallelism: int = 0  # tasks gated at once; 0: the number of cores
    slack: float = 3.0  # the resource re-run gets this many times the time and memory
    pids: int = 1024
    max_output_bytes: int = 1 << 20
    network: str = "none"  # the run's network policy; a task's own may narrow it (``format.attempt_limits``)
    ceiling: Limits | None = None  # the run's limits: a task's memory, storage and CPUs within them (None: its own)
    overrides: dict[str, Override] = field(default_factory=dict)  # task id -> override (``tasks.overrides``)
    build_timeout_scale: float = 1.0  # builds get this many times build_timeout_sec (a slow or shared machine)


@dataclass
class TaskReport:
    task: str
    path: str
    gates: dict[str, Gate] = field(default_factory=dict)
    untouched: list[str] = field(default_factory=list)  # tests the untouched environment passes
    tests: list[str] = field(default_factory=list)  # the tests of the oracle run
    notes: dict[str, float] = field(default_factory=dict)  # seconds of the build, oracle, verifier
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(self.gates.get(g, Gate(SKIP)).status == PASS for g in GATES)

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "path": self.path, "passed": self.passed,
                "gates": {g: dataclasses.asdict(self.gates[g]) for g in GATES if g in self.gates},
                "untouched": self.untouched, "tests": self.tests, "notes": self.notes,
                "seconds": round(self.seconds, 2)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskReport:
        """A report as ``to_dict`` wrote it (``tasks validate --resume``)."""
        gates = {g: Gate(str(v["status"]), str(v.get("reason", ""))) for g, v in data["gates"].items()}
        return cls(task=str(data["task"]), path=str(data["path"]), gates=gates,
                   untouched=list(data.get("untouched", [])), tests=list(data.get("tests", [])),
                   notes=dict(data.get("notes", {})), seconds=float(data.get("seconds", 0.0)))


Outcome = tuple[bool, float, tuple[tuple[str, float], ...]]  # what determinism compares: success, reward, metrics


@dataclass
class Run:
    """One attempt: the oracle (or nothing) followed by the verifier."""

    kind: str  # "oracle" or "noop"
    solve: ExecResult | None = None
    verifier: VerifierRun | None = None
    infra: str = ""  # a sandbox error that prevented the run
    leaks: list[str] = field(default_factory=list)  # what the untouched attempt exposes
    scanned: bool = False  # the untouched attempt was scanned for leaks
    refused: list[str] = field(default_factory=list)  # hosts the network policy refused to the run

    @property
    def result(self) -> VerifyResult | None:
        return self.verifier.result if self.verifier else None

    @property
    def outcome(self) -> Outcome | None:
        r = self.result
        if r is None:
            return None
        return (r.success, round(r.reward, 6), tuple(sorted((k, round(v, 6)) for k, v in r.metrics.items())))

    @property
    def text(self) -> str:
        parts = [self.solve.output if self.solve else "", self.verifier.run.output if self.verifier else "",
                 self.verifier.error if self.verifier else ""]
        return "\n".join(parts)


# --------------------------------------------------------------------------------------- entry points


def validate(paths: Iterable[str | Path], backend: Backend, options: GateOptions | None = None,
             progress: Callable[[TaskReport], None] | None = None) -> list[TaskReport]:
    """Gate every task directory in ``paths`` (task dirs; use ``find_task_dirs`` for folders)."""
    options = options or GateOptions()
    paths = list(paths)
    workers = options.parallelism or os.cpu_count() or 1
    pool = ThreadPoolExecutor(max(1, min(workers, len(paths) or 1)), thread_name_prefix="gate")
    stop = threading.Event()
    futures = {pool.submit(gate_task, p, backend, options, stop): i for i, p in enumerate(paths)}
    reports: list[TaskReport | None] = [None] * len(paths)
    try:
        for f in as_completed(futures):  # reported as they finish: a slow task holds back no checkpoint
            reports[futures[f]] = f.result()
            if progress is not None:
                progress(f.result())
    except BaseException:  # Ctrl-C: the queued tasks are dropped, the running ones stop at their next step
        stop.set()  # (and the caller's closing the backend ends the commands they are running)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return [r for r in reports if r is not None]


class _Stopped(Exception):
    """``validate`` was interrupted: a task being gated stops at its next build or run."""


def gate_task(path: str | Path, backend: Backend, options: GateOptions | None = None,
              stop: threading.Event | None = None) -> TaskReport:
    """Run the nine gates on one task directory (``stop``: once set, no further build or run starts and
    the report is left incomplete)."""
    start = time.monotonic()
    report = TaskReport(task=Path(path).name, path=str(path))
    with contextlib.suppress(_Stopped):
        _Gater(report, backend, options or GateOptions(), stop).run(Path(path))
    for name in GATES:
        report.gates.setdefault(name, Gate(SKIP, "an earlier gate failed"))
    report.seconds = time.monotonic() - start
    return report


# ------------------------------------------------------------------------------------------ the gater


class _Gater:
    def __init__(self, report: TaskReport, backend: Backend, options: GateOptions,
                 stop: threading.Event | None = None) -> None:
        self.report, self.backend, self.options, self.stop = report, backend, options, stop
        self.runs: list[Run] = []
        self.oracle_config: tuple[Task, Limits] | None = None  # what the deciding oracle run used

    def set(self, gate: str, status: str, reason: str = "") -> None:
        self.report.gates.setdefault(gate, Gate(status, _one_line(reason)))

    def run(self, path: Path) -> None:
        task = self.schema(path)
        if task is None:
            return
        self.report.task = task.id
        static_leaks = find_static_leaks(task)
        if not self.build(task):
            self.set("leakage", FAIL if static_leaks else SKIP, "; ".join(static_leaks) or "not built")
            return
        oracle = self.oracle(task)
        noop = self.noop(task)
        self.determinism(task, oracle, noop)
        # the built image says whether a copied secret is still readable: the untouched attempt's scan
        leaks = (placement_leaks(task) if noop.scanned else static_leaks) + noop.leaks
        self.set("leakage", FAIL if leaks else PASS, "; ".join(leaks) or "tests and solution not visible")
        self.reward()

    # gate 1 -------------------------------------------------------------------------------------
    def schema(self, path: Path) -> Task | None:
        try:
            task = apply_overrides(load_task(path), self.options.overrides)
        except TaskFormatError as e:
            self.set("schema", FAIL, str(e))
            return None
        solve = task.solution_dir / "solve.sh"
        if not solve.is_file():
            self.set("schema", FAIL, f"{solve}: missing (the oracle gates need it)")
            return None
        override = self.options.overrides.get(task.id)
        said = ", ".join(f"{k} = {v!r}" for k, v in override.values.items()) if override else ""
        self.set("schema", PASS, f"overridden: {said} ({override.reason})" if override else "")
        return task

    # gates 2 and 8 (build) ------------------------------------------------------------------------
    def build(self, task: Task) -> bool:
        problem = dockerfile_problem(task)
        if problem:
            self.set("build", FAIL, problem)
            return False
        start = time.monotonic()
        self.check_stop()
        try:
            parent = _prepare(self.backend, task, task_limits(task, self.options))
        except (SandboxError, ValueError, OSError) as e:
            message = task.offline.map_message(str(e)) if task.offline else str(e)
            evidence = network_evidence(message)
            if evidence:
                self.set("offline", FAIL, f"the build needs the network: {evidence}")
                self.set("build", SKIP, "needs the network (gate 8)")
            else:
                self.set("build", FAIL, message)
            return False
        seconds = parent.build_s if parent.cached else time.monotonic() - start
        self.report.notes["build_s"] = round(seconds, 2)
        took = f"{seconds:.1f} s" + (" (built by an earlier run; cached)" if parent.cached else "")
        limit = task.build_timeout_s * self.options.build_timeout_scale
        scaled = f" x {self.options.build_timeout_scale:g}" if self.options.build_timeout_scale != 1 else ""
        if seconds > limit:
            self.set("build", FAIL, f"took {seconds:.0f} s, over build_timeout_sec {task.build_timeout_s:.0f}{scaled}")
        else:
            self.set("build", PASS, "; ".join([took + (f" (build_timeout_sec{scaled})" if scaled else ""),
                                               *dockerfile_notes(task)]))
        return True

    # gates 3, 7 and 8 (oracle) ----------------------------------------------------------------
    def oracle(self, task: Task) -> Run:
        self.oracle_config = (task, task_limits(task, self.options))
        run = self.attempt(task, "oracle", self.oracle_config[1])
        if run.infra:
            self.set("oracle", FAIL, f"sandbox error: {run.infra}")
            return run
        if run.result is not None and run.result.success:
            self.oracle_passed(task, run)
            return run
        if resource_symptom(run):
            return self.oracle_rerun(task, run)
        self.oracle_failed(run, self.toolchain_hint(task, run))
        return run

    def toolchain_hint(self, task: Task, run: Run) -> str:
        """Why an oracle that scored below 1 under the pristine toolchain did: when it scores 1 with the
        verifier in the attempt's own toolchain, its tests use what the oracle installed (a tool under /usr,
        a file in /etc), which only an override may allow (``tasks.overrides``); "" otherwise."""
        if task.toolchain != "image" or run.result is None or network_evidence(run.text):
            return ""
        again = self.attempt(dataclasses.replace(task, toolchain="attempt"), "oracle", task_limits(task, self.options))
        if again.result is None or not again.result.success:
            return ""
        if not again.result.system_changes:  # the toolchains were the same: chance decided, not the toolchain
            return ("passed on a second run, whose verifier saw no change of the oracle's in system paths: its "
                    "result varies from run to run (a timing or load-dependent test?)")
        changes = ", ".join(again.result.system_changes[:4])
        return (f"passes with [verifier] toolchain = \"attempt\": its tests use what the oracle installed in "
                f"system paths ({changes}), which the pristine toolchain does not show; give "
                "the task an override (--overrides) if its tests may trust the attempt's tools")

    def oracle_rerun(self, task: Task, first: Run) -> Run:
        generous = _generous(task, self.options.slack)
        self.oracle_config = (generous, task_limits(generous, self.options, self.options.slack))
        rerun = self.attempt(generous, "oracle", self.oracle_config[1])
        if rerun.result is not None and rerun.result.success:
            self.set("resources", FAIL, resource_reason(task, first, rerun, self.options.slack))
            self.oracle_passed(task, rerun, resources=False)
        else:
            self.set("resources", SKIP, "the oracle fails even with more time and memory (gate 3)")
            self.oracle_failed(rerun)
        return rerun

    def oracle_passed(self, task: Task, run: Run, resources: bool = True) -> None:
        assert run.solve is not None and run.verifier is not None and run.result is not None  # it passed
        solve_s, verify_s = run.solve.seconds, run.verifier.run.seconds
        self.report.notes.update(oracle_s=round(solve_s, 2), verify_s=round(verify_s, 2))
        self.report.tests = sorted(run.result.metrics) if run.result.source != "reward.txt" else []
        self.set("oracle", PASS, f"scored 1 ({solve_s:.1f} s + verifier {verify_s:.1f} s)")
        if resources:
            self.set("resources", PASS, f"within {task.agent_timeout_s:.0f} s / {task.verifier_timeout_s:.0f} s "
                     f"and {task.memory_mb} MB")
        policy = task_limits(task, self.options).network
        how = "with no network" if policy == "none" else f"under network policy {policy}"
        note = f" (the task asks for {task.network})" if task.network not in (None, policy) else ""
        self.set("offline", PASS, f"built and solved {how}{note}")

    def oracle_failed(self, run: Run, hint: str = "") -> None:
        evidence = network_reason(run)
        if evidence:
            self.set("offline", FAIL, f"the oracle needs the network: {evidence}")
            self.set("oracle", SKIP, "needs the network (gate 8)")
        elif run.result is None:
            self.set("oracle", SKIP, "the verifier gave no usable reward (gate 9)")
        elif hint:
            self.set("oracle", FAIL, f"{hint}; {describe_failure(run)}")
        else:
            self.set("oracle", FAIL, describe_failure(run))
        self.set("resources", SKIP, "the oracle does not pass")
        self.set("offline", SKIP, "the oracle does not pass")

    # gate 4 -------------------------------------------------------------------------------------
    def noop(self, task: Task) -> Run:
        run = self.attempt(task, "noop", task_limits(task, self.options), scan=True)
        result = run.result
        if run.infra:
            self.set("noop", FAIL, f"sandbox error: {run.infra}")
        elif result is None:
            self.set("noop", SKIP, "the verifier gave no usable reward on the untouched environment (gate 9)")
        elif result.success:
            self.set("noop", FAIL, f"the untouched environment already scores 1 ({_metrics_text(result.metrics)})")
        else:
            named = result.source != "reward.txt"
            self.report.untouched = sorted(k for k, v in result.metrics.items() if v == 1.0) if named else []
            self.set("noop", PASS, f"scores {result.reward:g}; {len(self.report.untouched)} of "
                     f"{len(result.metrics)} tests pass untouched")
        return run

    # gate 5 -------------------------------------------------------------------------------------
    def determinism(self, task: Task, oracle: Run, noop: Run) -> None:
        if oracle.outcome is None or noop.outcome is None:
            self.set("determinism", SKIP, "needs a reward from both the oracle and the no-op")
            return
        assert self.oracle_config is not None  # set by the oracle gate, which ran first
        configs = {"oracle": self.oracle_config, "noop": (task, task_limits(task, self.options))}
        for first in (oracle, noop):
            run_task, limits = configs[first.kind]
            outcomes = [first.outcome]
            for _ in range(self.options.reruns - 1):
                outcomes.append(self.attempt(run_task, first.kind, limits).outcome)
            if len(set(outcomes)) > 1:
                self.set("determinism", FAIL, f"{first.kind} results differ over {len(outcomes)} runs: "
                         f"{describe_difference(outcomes)}")
                return
        self.set("determinism", PASS, f"same results over {self.options.reruns} runs each")

    # gate 9 -------------------------------------------------------------------------------------
    def reward(self) -> None:
        runs = [(r.kind, r.verifier) for r in self.runs if r.verifier is not None]
        if not runs:
            self.set("reward", SKIP, "no verifier run")
            return
        for kind, verifier in runs:
            if verifier.result is None:
                self.set("reward", FAIL, f"{kind}: {verifier.error}")
                return
            if verifier.result.problem:
                self.set("reward", FAIL, f"{kind}: {verifier.result.problem}")
                return
        self.set("reward", PASS, f"{len(runs)} verifier runs well formed")

    # runs ---------------------------------------------------------------------------------------
    def check_stop(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise _Stopped

    def attempt(self, task: Task, kind: str, limits: Limits, scan: bool = False) -> Run:
        error = ""
        for _ in range(2):  # a sandbox failure is retried once on a fresh fork
            self.check_stop()
            try:
                run = _attempt(self.backend, task, kind, limits, scan)
            except SandboxError as e:
                error = str(e)
                continue
            self.runs.append(run)
            return run
        return Run(kind, infra=error)


# ------------------------------------------------------------------------------------------- helpers


def _attempt(backend: Backend, task: Task, kind: str, limits: Limits, scan: bool) -> Run:
    attempt = backend.fork(task.env_dir, task.workdir, limits)
    try:
        run = Run(kind)
        if scan:
            run.leaks, run.scanned = scan_for_leaks(attempt, task), True
        if kind == "oracle":
            run.solve = run_oracle(attempt, task)
        run.verifier = run_verifier(attempt, task)
        run.refused = attempt.refused_hosts()
        return run
    finally:
        attempt.close()


def _prepare(backend: Backend, task: Task, limits: Limits) -> Prepared:
    return backend.prepare(task.env_dir, limits.network, limits.build_timeout_s)


def task_limits(task: Task, options: GateOptions, scale: float = 1.0) -> Limits:
    """The task's own limits (memory, storage, agent timeout, build time), within the run's ceiling
    (``options.ceiling``, as an attempt of a run gets them: ``format.attempt_limits``), optionally scaled
    up, and its network policy: the run's (``options.network``), narrowed by the task's own."""
    network = narrowest(options.network, task.network or options.network)
    memory_mb, disk_mb, cpus = task.memory_mb, task.storage_mb, 0.0
    if options.ceiling is not None:
        capped = attempt_limits(task, dataclasses.replace(options.ceiling, network=options.network))
        memory_mb, disk_mb, cpus = capped.memory_mb, capped.disk_mb, capped.cpus
    return Limits(memory_mb=int(memory_mb * scale), pids=options.pids, disk_mb=int(disk_mb * scale),
                  command_timeout_s=task.agent_timeout_s, max_output_bytes=options.max_output_bytes,
                  network=network, build_timeout_s=task.build_timeout_s * options.build_timeout_scale, cpus=cpus)


def _generous(task: Task, slack: float) -> Task:
    return dataclasses.replace(task, agent_timeout_s=task.agent_timeout_s * slack + 60,
                               verifier_timeout_s=task.verifier_timeout_s * slack + 60)


def network_reason(run: Run) -> str:
    """Why ``run`` needed the network ("" when nothing says so): the evidence in its output, with the hosts
    the network policy refused where the output does not name them ("403 Blocked by network policy"), or
    those hosts alone where a tool hides the proxy's answer (opam: "exited with code 56")."""
    evidence = network_evidence(run.text) or ""
    unnamed = [host for host in run.refused[:3] if host not in evidence]
    if evidence and unnamed:
        return f"{evidence} (refused: {', '.join(unnamed)})"
    if run.refused and not evidence:
        return f"needs {', '.join(run.refused[:3])}, which the network policy refused"
    return evidence


def resource_symptom(run: Run) -> bool:
    """The oracle or the verifier timed out or was killed (the memory limit kills with SIGKILL), or the memory
    limit killed one of their processes (a step of solve.sh that the script outlived)."""
    execs = [e for e in (run.solve, run.verifier.run if run.verifier else None) if e is not None]
    return any(e.timed_out or e.exit_code in _KILLED or e.limit == LIMIT_OOM for e in execs)


def resource_reason(task: Task, first: Run, rerun: Run, slack: float) -> str:
    """Why the first oracle run failed where ``rerun`` (with more time and memory) passed."""
    assert rerun.solve is not None and rerun.verifier is not None  # it passed
    if first.solve is not None and first.solve.timed_out:
        return (f"the oracle needs more than [agent] timeout_sec {task.agent_timeout_s:.0f} s "
                f"(took {rerun.solve.seconds:.1f} s with more time)")
    if first.verifier is not None and first.verifier.run.timed_out:
        return (f"the verifier needs more than [verifier] timeout_sec {task.verifier_timeout_s:.0f} s "
                f"(took {rerun.verifier.run.seconds:.1f} s with more time)")
    return (f"killed within memory {task.memory_mb} MB; passes with {int(task.memory_mb * slack)} MB")


def describe_failure(run: Run) -> str:
    """A scored oracle run that did not pass: its score, failing tests and what went wrong."""
    result = run.result
    assert result is not None  # scored
    failed = [k for k, v in result.metrics.items() if v < 1.0]
    parts = [f"scored {result.reward:g}" + (f", failing {', '.join(failed[:4])}" if failed else "")]
    if result.error:
        parts.append(result.error)
    if run.solve is not None and run.solve.exit_code != 0:
        parts.append(f"solve.sh exited with {run.solve.exit_code}: {run.solve.output[-200:]}")
    return "; ".join(parts)


def describe_difference(outcomes: list[Outcome | None]) -> str:
    def show(o: Outcome | None) -> str:
        return "no reward" if o is None else f"reward {o[1]:g} {dict(o[2])}"

    first = outcomes[0]
    other = next(o for o in outcomes if o != first)
    return f"{show(first)} vs {show(other)}"


def _metrics_text(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in list(metrics.items())[:6])


def _one_line(text: str) -> str:
    text = re.sub(r"\s*\n\s*", " | ", text.strip())
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


# ------------------------------------------------------------------------------------------ reports


def partial_credit_weights(reports: Iterable[TaskReport]) -> dict[str, dict[str, float]]:
    """task id -> {test: 0.0} for the tests that pass untouched (the no-op gate): partial-credit
    weights for ``orchestrator.buffer.GroupScorer``."""
    return {r.task: {name: 0.0 for name in r.untouched} for r in reports if r.untouched}


def load_test_weights(path: str | Path) -> dict[str, dict[str, float]]:
    """The partial-credit weights from a ``tasks validate --json`` report."""
    data = json.loads(Path(path).read_text())
    return {k: {t: float(w) for t, w in v.items()} for k, v in data.get("test_weights", {}).items()}


def reports_json(reports: list[TaskReport]) -> dict[str, Any]:
    failed = {g: sum(r.gates[g].status == FAIL for r in reports) for g in GATES}
    return {"gates": list(GATES), "tasks": [r.to_dict() for r in reports],
            "summary": {"tasks": len(reports), "passed": sum(r.passed for r in reports),
                        "failures_by_gate": failed, "failures_by_reason": reason_summary(reports)},
            "test_weights": partial_credit_weights(reports)}


# (gate or "*", pattern, category): the first match names a failure's reason category; "{0}" is the
# pattern's first group. Network evidence is named by the host it needed.
_CATEGORIES: tuple[tuple[str, str, str], ...] = (
    ("*", r"/dev/kvm|\bKVM\b", "needs KVM"),
    ("*", r"(?i)nvidia|\bCUDA\b|\bGPU\b", "needs a GPU"),
    ("*", r"(?:needs|resolve host:?|resolve '?|connect to|Failed to connect to)\s*'?([a-z0-9.-]+\.[a-z]{2,})",
     "needs {0}"),
    ("*", r"(?:unable to access|Failed to fetch|Could not fetch|Cannot connect to proxy\.\W+'?)\s*'?https?://"
          r"([a-z0-9.-]+\.[a-z]{2,})", "needs {0}"),
    ("*", r".*needs the network: ([\w.-]+(?: (?:install|clone|add|get|download))?)", "needs the network: {0}"),
    ("*", r"needs the network", "needs the network"),
    ("*", r"sandbox error", "sandbox error"),
    ("schema", r"solve\.sh: missing", "no oracle solution/solve.sh"),
    ("schema", r".", "invalid task files"),
    ("build", r"unsupported (instruction|RUN flag|COPY flag|ADD flag) (\S+)", "unsupported {0} {1}"),
    ("build", r"FROM \S+:", "no base for the FROM image"),
    ("build", r"RUN timed out|over build_timeout_sec", "build too slow"),
    ("build", r"RUN exited", "a RUN step fails"),
    ("build", r"source .* not found|no source files", "COPY/ADD source missing"),
    ("build", r"USER|--chown", "unknown user or group"),
    ("oracle", r"passes with \[verifier\] toolchain", "needs the attempt's toolchain (an override)"),
    ("oracle", r"varies from run to run", "the oracle's result varies"),
    ("oracle", r"solve\.sh exited", "solve.sh fails"),
    ("oracle", r"scored", "oracle scores below 1"),
    ("noop", r"already scores 1", "the untouched environment passes"),
    ("determinism", r"^(\w+) results differ", "{0} results differ between runs"),
    ("leakage", r"readable in the image", "a test or solution file is readable in the image"),
    ("leakage", r"exists before verification", "/tests or /solution exists before verification"),
    ("leakage", r"visible inside the sandbox", "the task directory is visible"),
    ("leakage", r"where the verifier's files go", "the Dockerfile copies into /tests or /solution"),
    ("resources", r"\[agent\] timeout_sec", "the oracle needs more time"),
    ("resources", r"\[verifier\] timeout_sec", "the verifier needs more time"),
    ("resources", r"memory", "the oracle needs more memory"),
    ("reward", r".", "malformed reward"),
)


def reason_category(gate: str, reason: str) -> str:
    """A short category for a failure's reason ("needs github.com", "a RUN step fails", ...), so a
    task set's failures can be counted by cause."""
    for where, pattern, category in _CATEGORIES:
        if where not in ("*", gate):
            continue
        match = re.search(pattern, reason)
        if match:
            return category.format(*[g or "" for g in match.groups()])
    first = re.split(r"[:;(]", reason, maxsplit=1)[0]
    return re.sub(r"\d+(\.\d+)?", "N", first).strip()[:60] or "no reason given"


def reason_summary(reports: list[TaskReport]) -> list[dict[str, Any]]:
    """Failing tasks counted per (gate, reason category), most frequent first (a task counts once per
    gate it fails)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in reports:
        for g in GATES:
            gate = r.gates.get(g)
            if gate is not None and gate.status == FAIL:
                groups.setdefault((g, reason_category(g, gate.reason)), []).append(r.task)
    rows = [{"gate": g, "reason": reason, "count": len(tasks), "tasks": sorted(tasks)}
            for (g, reason), tasks in groups.items()]
    return sorted(rows, key=lambda row: (-row["count"], GATES.index(row["gate"]), row["reason"]))


def first_failure(report: TaskReport) -> tuple[str, str] | None:
    """The first gate ``report`` failed and its reason (None when it failed none)."""
    for name in GATES:
        gate = report.gates.get(name)
        if gate is not None and gate.status == FAIL:
            return name, gate.reason
    return None


def format_reason_table(rows: list[dict[str, Any]], examples: int = 3) -> str:
    """The per-reason summary as a table: gate, count of tasks, reason category, a few task ids."""
    if not rows:
        return ""
    width = max(len(row["gate"]) for row in rows)
    lines = [f"{'gate':<{width}}  tasks  reason"]
    for row in rows:
        shown = ", ".join(row["tasks"][:examples]) + (", ..." if len(row["tasks"]) > examples else "")
        lines.append(f"{row['gate']:<{width}}  {row['count']:>5}  {row['reason']} ({shown})")
    return "\n".join(lines)


def format_table(reports: list[TaskReport]) -> str:
    """A task x gate table (pass / FAIL / skip), the reasons for every FAIL and skip, and a total.
    Tasks are named by id, or by path where two share an id."""
    ids = [r.task for r in reports]
    names = [r.path if ids.count(r.task) > 1 else r.task for r in reports]
    width = max([len(n) for n in names] + [4])
    heads = [f"{i}:{g}" for i, g in enumerate(GATES, 1)]
    lines = [f"{'task':<{width}}  " + "  ".join(heads)]
    marks = {PASS: "pass", FAIL: "FAIL", SKIP: "skip"}
    for name, r in zip(names, reports, strict=True):
        cells = [f"{marks[r.gates[g].status]:<{len(h)}}" for g, h in zip(GATES, heads, strict=True)]
        lines.append(f"{name:<{width}}  " + "  ".join(cells).rstrip())
    reasons = [f"  {name}: gate {i} {g}: {r.gates[g].status}: {r.gates[g].reason}"
               for name, r in zip(names, reports, strict=True) for i, g in enumerate(GATES, 1)
               if r.gates[g].status != PASS]
    if reasons:
        lines += ["", "reasons:", *reasons]
    by_reason = format_reason_table(reason_summary(reports))
    if by_reason:
        lines += ["", "failures by reason:", by_reason]
    lines += ["", summary_line(reports)]
    return "\n".join(lines)


def summary_line(reports: list[TaskReport]) -> str:
    passed = sum(r.passed for r in reports)
    failed = {g: sum(r.gates[g].status == FAIL for r in reports) for g in GATES}
    which = ", ".join(f"{g} {n}" for g, n in failed.items() if n)
    tail = f"; failures by gate: {which}" if which else ""
    return f"{len(reports)} tasks: {passed} passed all nine gates, {len(reports) - passed} did not{tail}"
