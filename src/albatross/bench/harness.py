"""Harness: cost per attempt and context length with output redirection and context compression off / on.

A scripted policy (deterministic, no model) plays long-horizon built-in tasks whose commands print large
outputs (a 50 KB build log, a 1.3 MB service log) over about 20 turns, through the real harness and
sandbox, once per configuration. Every configuration shows the same number of characters of one output
(``--limit``, ``max_observation_chars``), so only the feature differs:

- ``baseline``: no redirection (an output over the limit is cut in the middle, as common harnesses do),
  no compression;
- ``redirect``: an output over the limit goes to a file; the agent sees head, tail and the path;
- ``compress``: observation masking, then a summary, when the context passes ``--compress-at`` of the
  context budget;
- ``redirect+compress``: both (the recipe reports cost per trial about 33% lower).

Cost prices tokens as an API with prefix caching bills them (``eval.run.sample_usage``): each model call
reads the context so far; the part the previous call of the same sample already read (its prompt and its
completion) is cached input, priced ``--price-cached`` (default 0.1) of a fresh input token; the rest
(the instruction, each observation, a whole rebuilt context after a compression) is fresh input; output
tokens cost ``--price-output`` (default 5) fresh input tokens. ``cost_reduction`` is the headline;
``uncached_tokens_reduction`` counts every token read at full price (what the harness figure reported
before it priced caching, and with unequal display limits).

Background jobs are measured apart, on a task whose test suite takes 4 s: the policy either waits for it
(``foreground``) or starts it as a job and reads the code meanwhile (``background``); the policy takes
``--think`` seconds per turn, standing in for a model's generation time, which is what the job overlaps.

The scripted policy never reads its observations, so success is equal by construction: the table shows
that the features break nothing, not that a model succeeds as often with less context.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albatross.engine.base import Completion, SamplingParams, SingleEngine
from albatross.harness.chat import ChatFormat
from albatross.harness.context import SUMMARY_REQUEST
from albatross.harness.parsers import FormatError, parse_bash_block

if TYPE_CHECKING:
    from albatross.config import HarnessConfig
    from albatross.harness.agent import Agent
    from albatross.harness.chat import TinyTokenizer
    from albatross.records import Trajectory

DOCKERFILE = "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY app/ /app/\n"
SERVICES = ("auth", "billing", "search", "cart", "mail", "geo")
CONFIGS: dict[str, dict[str, Any]] = {
    "baseline": {"redirect_output": False, "compression": "none"},
    "redirect": {"redirect_output": True, "compression": "none"},
    "compress": {"redirect_output": False, "compression": "mask_summary"},
    "redirect+compress": {"redirect_output": True, "compression": "mask_summary"},
}


class ScriptedPolicy(SingleEngine):
    """A deterministic fake engine for long attempts: the i-th action call answers the i-th action (then
    repeats the last); a request to summarise (``context.SUMMARY_REQUEST``) is answered with a summary
    listing the commands run so far, and does not advance the script. Completions are cut at
    ``max_tokens``; log-probs are 0.0 and every token carries ``version``. ``think_s``: seconds each call
    takes, standing in for a real model's generation time."""

    def __init__(self, actions: list[str], fmt: ChatFormat, version: int = 0, think_s: float = 0.0) -> None:
        if not actions:
            raise ValueError("ScriptedPolicy needs at least one action")
        self.actions, self.fmt, self.version, self.think_s = list(actions), fmt, version, think_s
        self.requests = [fmt.user(SUMMARY_REQUEST, closed=c) for c in (False, True)]
        self.calls = 0
        self.summaries = 0

    def _is_summary_request(self, prompt: list[int]) -> bool:
        return any(len(prompt) >= len(r) and prompt[-len(r):] == r for r in self.requests)

    def summary(self) -> str:
        done = []
        for action in self.actions[: self.calls]:
            try:
                done.append(parse_bash_block(action))
            except FormatError:
                done.append(action.strip()[:80])
        return "Commands run so far: " + "; ".join(done) + ". Next: continue with the remaining steps."

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for prompt in prompts:
            time.sleep(self.think_s)
            if self._is_summary_request(prompt):
                text = self.summary()
                self.summaries += 1
            else:
                text = self.actions[min(self.calls, len(self.actions) - 1)]
                self.calls += 1
            ids = self.fmt.action(text)
            reason = "stop" if len(ids) <= params.max_tokens else "length"
            ids = ids[: params.max_tokens]
            out.append(Completion(ids, [0.0] * len(ids), [self.version] * len(ids), reason))
        return out

    def update_weights(self, path: str, version: int) -> None:
        self.version = version

    def close(self) -> None:
        pass


# ---- long-horizon tasks -------------------------------------------------------------------------------


@dataclass
class LongTask:
    name: str
    instruction: str
    files: dict[str, str]
    test_sh: str
    steps: list[str]  # one shell command per turn, ending with "submit"


def _reward_sh(checks: dict[str, str]) -> str:
    """test.sh: each check is a shell condition; reward.json gets 1/0 per check."""
    lines = ["#!/bin/bash", "mkdir -p /logs/verifier", "cd /app || exit 1"]
    fields = []
    for name, cond in checks.items():
        lines.append(f"if {cond}; then {name}=1; else {name}=0; fi")
        fields.append(f'\\"{name}\\": ${name}')
    lines.append(f'echo "{{{", ".join(fields)}}}" > /logs/verifier/reward.json')
    return "\n".join(lines) + "\n"


BUILD_SH = """#!/bin/bash
cd "$(dirname "$0")"
errors=0
for f in src/*.conf; do
  m=$(basename "$f" .conf)
  for j in $(seq 1 {units}); do echo "[$m] compiling unit $j of {units} with flags -O2 -Wall ... ok"; done
  if ! grep -qx 'enabled=yes' "$f"; then echo "ERROR $m: missing enabled=yes in $f"; errors=$((errors+1)); fi
done
if [ $errors -gt 0 ]; then echo "BUILD FAILED: $errors errors"; exit 1; fi
echo "BUILD OK"
"""


def fix_build(rng: random.Random, modules: int = 30, units: int = 40, broken: int = 10) -> LongTask:
    """Fix the module configs that a 50 KB build log reports, rebuild, count the fixes."""
    names = [f"mod_{i:02d}" for i in range(modules)]
    bad = sorted(rng.sample(names, broken))
    files = {"build.sh": BUILD_SH.format(units=units),
             "README.md": "".join(f"Module {n}: part of the {rng.choice(SERVICES)} service; config in "
                                  f"src/{n}.conf, built by build.sh.\n" for n in names)}
    for n in names:
        files[f"src/{n}.conf"] = f"name={n}\nversion={rng.randint(1, 9)}\n" + ("" if n in bad else "enabled=yes\n")
    steps = ["ls", "cat README.md", "bash build.sh", "bash build.sh | grep ERROR"]
    for n in bad:
        steps += [f"cat src/{n}.conf", f"echo enabled=yes >> src/{n}.conf", "bash build.sh | grep ERROR"]
    steps += ["bash build.sh", "bash build.sh | tail -n 2", f"echo {broken} > answer.txt", "cat answer.txt",
              "submit"]
    test = _reward_sh({"build_ok": '[ "$(bash build.sh | tail -n 1)" = "BUILD OK" ]',
                       "answer": f'[ "$(tr -d "[:space:]" < answer.txt)" = "{broken}" ]'})
    return LongTask("fix_build", "The build in /app fails. Run build.sh, fix every module config it "
                    "reports (do not change build.sh) until it prints BUILD OK, then write the number of "
                    "configs you fixed to /app/answer.txt.", files, test, steps)


def log_audit(rng: random.Random, lines: int = 20000) -> LongTask:
    """Answer three questions about a 1.3 MB service log."""
    rows, errors = [], dict.fromkeys(SERVICES, 0)
    worst = (-1, "")
    for i in range(lines):
        svc, level = rng.choice(SERVICES), rng.choices(["INFO", "WARN", "ERROR"], [90, 7, 3])[0]
        latency, req = rng.randint(1, 5000), f"r{rng.randrange(16 ** 8):08x}"
        errors[svc] += level == "ERROR"
        if latency > worst[0]:
            worst = (latency, req)
        rows.append(f"2025-01-01T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d} service={svc} "
                    f"level={level} latency_ms={latency} req={req}\n")
    total = sum(errors.values())
    top = max(SERVICES, key=lambda s: (errors[s], s))
    steps = ["ls -la logs", "head -n 20 logs/app.log", "cat logs/app.log", "wc -l logs/app.log",
             "grep -c level=ERROR logs/app.log",
             "grep level=ERROR logs/app.log | awk '{print $2}' | sort | uniq -c | sort -rn",
             "grep level=ERROR logs/app.log",
             *(f"grep service={s} logs/app.log | grep -c level=ERROR" for s in SERVICES),
             *(f"grep service={s} logs/app.log | grep level=ERROR | head -n 5" for s in SERVICES),
             "awk '{split($4, a, \"=\"); print a[2], $5}' logs/app.log | sort -n | tail -n 5",
             f"echo {total} > report.txt", f"echo {top} >> report.txt", f"echo {worst[1]} >> report.txt",
             "cat report.txt", "submit"]
    expected = f"{total}\n{top}\n{worst[1]}"
    test = _reward_sh({"report": f'[ "$(cat report.txt)" = "{expected}" ]'})
    return LongTask("log_audit", "Read /app/logs/app.log and write /app/report.txt with three lines: the "
                    "number of ERROR lines, the service with the most ERROR lines, and the req id of the "
                    "slowest request.", {"logs/app.log": "".join(rows)}, test, steps)


def rename_key(rng: random.Random, files: int = 40, stale: int = 24) -> LongTask:
    """Rename a config key in every file that still has it, one file at a time (many short turns)."""
    names = [f"svc_{i:02d}.ini" for i in range(files)]
    old = sorted(rng.sample(names, stale))
    contents = {}
    for n in names:
        keys = [f"{k}_{j}={rng.randint(1, 999)}" for j, k in enumerate(rng.choices(SERVICES, k=24))]
        keys.insert(rng.randrange(len(keys)), f"{'retry_limit' if n in old else 'max_retries'}={rng.randint(1, 9)}")
        contents[f"config/{n}"] = f"# {n}: generated settings\n" + "\n".join(keys) + "\n"
    steps = ["ls config", "grep -l retry_limit config/*.ini"]
    for n in old:
        steps += [f"cat config/{n}", f"sed -i 's/^retry_limit=/max_retries=/' config/{n}"]
    steps += ["grep -c retry_limit config/*.ini | grep -v ':0'", "grep -l max_retries config/*.ini | wc -l",
              f"echo {stale} > answer.txt", "submit"]
    test = _reward_sh({"renamed": "! grep -q retry_limit config/*.ini",
                       "kept": f'[ "$(grep -l max_retries config/*.ini | wc -l)" = "{files}" ]',
                       "answer": f'[ "$(tr -d "[:space:]" < answer.txt)" = "{stale}" ]'})
    return LongTask("rename_key", "Every config in /app/config must use the key max_retries; some still use "
                    "the old name retry_limit. Rename it (keep the value) in each file that has it, then write "
                    "the number of files you changed to /app/answer.txt.", contents, test, steps)


FAMILIES = (fix_build, log_audit, rename_key)

RUN_TESTS_SH = """#!/bin/bash
cd "$(dirname "$0")"
fails=0
for t in tests/*.sh; do
  sleep 0.25
  if bash "$t" > /dev/null 2>&1; then echo "PASS $t"; else echo "FAIL $t"; fails=$((fails+1)); fi
done
echo "$fails failed"
[ $fails -eq 0 ]
"""


def slow_tests(rng: random.Random, n: int = 16, wrong: int = 2, background: bool = False) -> LongTask:
    """Fix two constants that a 4-second test suite reports. ``background``: the agent starts the suite as
    a job and reads the code while it runs, instead of waiting for it."""
    values = {i: rng.randint(10, 99) for i in range(n)}
    bad = sorted(rng.sample(range(n), wrong))
    lib = "".join(f"LIMIT_{i:02d}={values[i] + (1 if i in bad else 0)}\n" for i in range(n))
    files = {"run_tests.sh": RUN_TESTS_SH, "lib/limits.sh": lib}
    files.update({f"tests/test_{i:02d}.sh": f'source lib/limits.sh\n[ "$LIMIT_{i:02d}" -eq {values[i]} ]\n'
                  for i in range(n)})
    fixes = [f"sed -i 's/^LIMIT_{i:02d}=.*/LIMIT_{i:02d}={values[i]}/' lib/limits.sh" for i in bad]
    reads = ["cat lib/limits.sh", *(f"cat tests/test_{i:02d}.sh" for i in bad), "ls tests"]
    if background:
        steps = ["ls", "job start bash run_tests.sh", *reads, "job wait 1 30", *fixes, "bash run_tests.sh"]
    else:
        steps = ["ls", "bash run_tests.sh", *reads, *fixes, "bash run_tests.sh"]
    test = _reward_sh({"passes": "bash run_tests.sh > /dev/null"})
    return LongTask("slow_tests", "Two tests in /app fail (run_tests.sh runs them). Fix lib/limits.sh so "
                    "every test passes; do not change the tests.", files, test, [*steps, "submit"])


def write_long_tasks(root: Path, n: int, seed: int = 0) -> list[tuple[Path, LongTask]]:
    """``n`` task directories (cycling through ``FAMILIES``) under ``root``."""
    return [_write(root, FAMILIES[i % len(FAMILIES)](random.Random(f"{seed}/{i}")), i) for i in range(n)]


def _write(root: Path, task: LongTask, i: int) -> tuple[Path, LongTask]:
    from albatross.tasks.format import write_task

    path = write_task(root / f"{task.name}-{i}", instruction=task.instruction + "\n",
                      task_toml={"version": "1.0", "metadata": {"family": task.name},
                                 "agent": {"timeout_sec": 600.0}, "verifier": {"timeout_sec": 60.0}},
                      env_files={f"app/{k}": v for k, v in task.files.items()}, dockerfile=DOCKERFILE,
                      solve_sh="#!/bin/bash\ncd /app\n" + "\n".join(task.steps[:-1]) + "\n",
                      test_sh=task.test_sh, demo_steps=task.steps)
    return path, task


# ---- the benchmark -------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-tasks", type=int, default=3, help="number of long-horizon tasks (cycling through 3 families)")
    p.add_argument("--limit", type=int, default=2000,
                   help="characters of one output shown, in every configuration (max_observation_chars)")
    p.add_argument("--price-cached", type=float, default=0.1, help="price of a cached input token "
                   "(a fresh input token costs 1)")
    p.add_argument("--price-output", type=float, default=5.0, help="price of an output token "
                   "(a fresh input token costs 1)")
    p.add_argument("--context", type=int, default=16384, help="context budget (tokens)")
    p.add_argument("--compress-at", type=float, default=0.5, help="compress past this share of the budget")
    p.add_argument("--compress-target", type=float, default=0.25, help="masking suffices below this share")
    p.add_argument("--sandbox", choices=("local", "process"), default=None,
                   help="sandbox type (default: local if available, else process)")
    p.add_argument("--think", type=float, default=0.5, help="background jobs: seconds the scripted policy "
                   "takes per turn (a model's generation time)")
    p.add_argument("--seed", type=int, default=0)


def _harness_cfg(args: argparse.Namespace, knobs: dict[str, Any]) -> HarnessConfig:
    from albatross.config import HarnessConfig

    cfg = HarnessConfig(max_turns=100, max_tokens_per_turn=512, max_context_tokens=args.context,
                        max_format_errors=2, attempt_timeout_s=600.0,
                        max_observation_chars=args.limit)
    return cfg.model_copy(update={"compress_at": args.compress_at, "compress_target": args.compress_target,
                                  "keep_observations": 2, "summary_max_tokens": 512, **knobs})


def _tokenizer(tasks: list[LongTask]) -> TinyTokenizer:
    from albatross.harness.chat import TinyTokenizer
    from albatross.harness.context import SUMMARY_HEADER

    corpus = [t.instruction for t in tasks] + [s for t in tasks for s in t.steps]
    corpus += [t.files.get("README.md", "") for t in tasks] + [SUMMARY_REQUEST, SUMMARY_HEADER]
    corpus += [" ".join(SERVICES), "retry_limit max_retries generated settings"]
    corpus += [BUILD_SH, "compiling unit of with flags ok service level latency_ms req INFO WARN ERROR"]
    return TinyTokenizer.from_corpus(corpus)


def run_config(agent: Agent, tasks: list[tuple[Path, LongTask]], think_s: float = 0.0) -> list[Trajectory]:
    from albatross.harness.agent import AttemptSpec
    from albatross.tasks.format import load_task

    trajs: list[Trajectory] = []
    for i, (path, task) in enumerate(tasks):
        policy = ScriptedPolicy([f"```bash\n{s}\n```" for s in task.steps], agent.fmt, think_s=think_s)
        trajs.append(agent.run(AttemptSpec(load_task(path), "bench", i), engine=policy))
    return trajs


def prices(args: argparse.Namespace) -> dict[str, float]:
    """Token prices relative to one fresh input token (named in the JSON)."""
    return {"input": 1.0, "cached_input": float(args.price_cached), "output": float(args.price_output)}


def attempt_cost(traj: Trajectory, price: dict[str, float]) -> tuple[dict[str, int], float]:
    """Fresh input, cached input and output tokens of an attempt (every model call, summaries included),
    and its cost at ``price``."""
    from albatross.eval.run import Usage, sample_usage

    usage = sum((sample_usage(s.loss_mask) for s in traj.samples), Usage())
    cost = usage.input * price["input"] + usage.cached_input * price["cached_input"] + usage.output * price["output"]
    return {"input": usage.input, "cached_input": usage.cached_input, "output": usage.output}, cost


def summarise(trajs: list[Trajectory], price: dict[str, float]) -> dict[str, Any]:
    per_turn: dict[int, list[int]] = {}
    for t in trajs:
        for i, turn in enumerate(t.turns):
            per_turn.setdefault(i, []).append(turn.context_tokens)
    costs = [attempt_cost(t, price) for t in trajs]
    return {
        "success_rate": sum(t.success for t in trajs) / len(trajs),
        "statuses": sorted({t.status for t in trajs}),
        "cost_per_attempt": statistics.mean(c for _, c in costs),
        "fresh_input_tokens_per_attempt": statistics.mean(u["input"] for u, _ in costs),
        "cached_input_tokens_per_attempt": statistics.mean(u["cached_input"] for u, _ in costs),
        "tokens_per_attempt": statistics.mean(t.input_tokens + t.completion_tokens for t in trajs),
        "input_tokens_per_attempt": statistics.mean(t.input_tokens for t in trajs),
        "max_context": max(turn.context_tokens for t in trajs for turn in t.turns),
        "mean_context": statistics.mean(turn.context_tokens for t in trajs for turn in t.turns),
        "turns_per_attempt": statistics.mean(len(t.turns) for t in trajs),
        "compressions_per_attempt": statistics.mean(len(t.compressions) for t in trajs),
        "samples_per_attempt": statistics.mean(len(t.samples) for t in trajs),
        "wall_seconds_per_attempt": statistics.mean(t.wall_seconds for t in trajs),
        "context_over_turns": [round(statistics.mean(v)) for _, v in sorted(per_turn.items())],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from albatross.bench.common import print_table, write_json
    from albatross.engine.base import SamplingParams
    from albatross.harness.agent import Agent
    from albatross.harness.chat import TinyChatFormat
    from albatross.sandbox import local_available, make_backend
    from albatross.sandbox.base import Limits

    kind = args.sandbox or ("local" if local_available() else "process")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="albatross-bench-harness-") as tmp:
        tasks = write_long_tasks(Path(tmp) / "tasks", args.n_tasks, args.seed)
        slow = [_write(Path(tmp) / mode, slow_tests(random.Random(args.seed), background=mode == "bg"), 0)
                for mode in ("fg", "bg")]
        fmt = TinyChatFormat(_tokenizer([t for _, t in tasks + slow]))
        backend = make_backend(kind) if kind == "process" else make_backend(kind, hide_paths=[tmp])

        def agent(knobs: dict[str, Any]) -> Agent:
            return Agent(None, backend, fmt, _harness_cfg(args, knobs), SamplingParams(temperature=0.0),
                         Limits(command_timeout_s=30.0, disk_mb=512))

        price = prices(args)
        try:
            for name, knobs in CONFIGS.items():
                results[name] = summarise(run_config(agent(knobs), tasks), price)
            both = CONFIGS["redirect+compress"]
            jobs = {mode: summarise(run_config(agent(both), [task], args.think), price)
                    for mode, task in zip(("foreground", "background"), slow, strict=True)}
        finally:
            backend.close()
    return _report(args, kind, results, jobs, print_table, write_json)


def _reductions(results: dict[str, dict[str, Any]], key: str) -> dict[str, float]:
    """1 - figure / baseline figure, per configuration other than the baseline."""
    base = results["baseline"][key]
    return {name: round(1 - r[key] / base, 4) if base else 0.0 for name, r in results.items() if name != "baseline"}


def _report(args: argparse.Namespace, kind: str, results: dict[str, dict[str, Any]],
            jobs: dict[str, dict[str, Any]], print_table: Callable[[str, list[tuple[str, Any]]], None],
            write_json: Callable[[str | Path | None, dict[str, Any]], None]) -> dict[str, Any]:
    cost, tokens = _reductions(results, "cost_per_attempt"), _reductions(results, "tokens_per_attempt")
    rows: list[tuple[str, Any]] = []
    for name, r in results.items():
        rows += [(f"{name}: cost/attempt", round(r["cost_per_attempt"])),
                 (f"{name}: tokens/attempt (fresh + cached + output)", round(r["tokens_per_attempt"])),
                 (f"{name}: cached share of input", round(r["cached_input_tokens_per_attempt"]
                                                          / max(1.0, r["input_tokens_per_attempt"]), 3)),
                 (f"{name}: max context", r["max_context"]), (f"{name}: success", r["success_rate"]),
                 (f"{name}: compressions/attempt", r["compressions_per_attempt"])]
    data = {
        "cost_reduction": cost["redirect+compress"],
        "cost_reduction_by_config": cost,
        "uncached_tokens_reduction": tokens["redirect+compress"],
        "uncached_tokens_reduction_by_config": tokens,
        "prices": {**prices(args), "unit": "one fresh input token"},
        "equal_success": len({r["success_rate"] for r in results.values()}) == 1,
        "equal_success_note": "scripted policy: it never reads its observations, so success is equal by "
                              "construction",
        "configs": results,
        "background_jobs": {**jobs, "wall_seconds_reduction": round(
            1 - jobs["background"]["wall_seconds_per_attempt"] / jobs["foreground"]["wall_seconds_per_attempt"], 4)},
        "settings": {k: vars(args)[k] for k in ("tasks", "limit", "context", "compress_at", "compress_target",
                                                    "think", "seed")} | {"backend": kind},
    }
    rows += [("cost_reduction (redirect+compress vs baseline, cached input priced)", data["cost_reduction"]),
             ("uncached_tokens_reduction (every token at full price)", data["uncached_tokens_reduction"])]
    for mode, r in jobs.items():
        rows += [(f"slow tests, {mode}: wall s/attempt", r["wall_seconds_per_attempt"]),
                 (f"slow tests, {mode}: tokens/attempt", round(r["tokens_per_attempt"])),
                 (f"slow tests, {mode}: success", r["success_rate"])]
    print_table(f"albatross bench harness: scripted policy, long-horizon tasks, {args.limit} characters "
                "shown per output in every configuration", rows)
    write_json(args.json, data)
    return data
