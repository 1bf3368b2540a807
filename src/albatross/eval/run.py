"""Evaluate a policy on tasks with the same harness and sandbox as training; summarise the attempts.

``evaluate`` runs every task ``trials`` times (infrastructure errors are retried and never scored) and can
append every try to a JSONL file, so an interrupted evaluation resumes by skipping the (task, trial)
pairs already finished (``finished_pairs``). ``summarize`` turns attempt records (``Trajectory.to_dict``
plus optional ``category`` / ``usage`` / ``cost`` keys) into Pass@1 with its standard error and 95% interval over
tasks (``stats.py``),
unbiased pass@k, token, turn, time and cost figures, and per-task and per-category tables.

Token accounting follows prefix caching: each model turn is one request whose input is the whole
context so far; the part already processed by the previous turn of the same sample (its prompt and its
completion) counts as cached input, the rest (the instruction, then each observation) as fresh input.
"""

from __future__ import annotations

import math
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from math import comb
from pathlib import Path
from typing import Any

from albatross.config import default
from albatross.harness.agent import AttemptSpec
from albatross.harness.retry import Runner, run_with_retries
from albatross.records import STATUS_INFRA_ERROR, Trajectory, append_jsonl, read_jsonl
from albatross.tasks.format import UNCATEGORIZED, Task, family_of_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib



def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n trials with c successes (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class EvalResult:
    trajectories: list[Trajectory]
    counts: Counter[str] = field(default_factory=Counter)

    def per_task(self) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in self.trajectories:
            if t.status != STATUS_INFRA_ERROR:
                out.setdefault(t.task_id, []).append(t.success)
        return out

    @property
    def pass_at_1(self) -> float:
        tasks = self.per_task()
        if not tasks:
            return 0.0
        return sum(sum(v) / len(v) for v in tasks.values()) / len(tasks)

    @property
    def pass_at_1_se(self) -> float | None:
        """Standard error of ``pass_at_1`` over tasks: the sample standard deviation of the per-task pass
        rates / sqrt(number of tasks) (None with fewer than two tasks). It measures how much Pass@1 would
        move on another draw of tasks of the same kind, which dominates with few tasks and few trials."""
        return _task_se(list(self.per_task().values()))

    def only(self, task_ids: Iterable[str]) -> EvalResult:
        """The attempts at ``task_ids`` alone (counts are not carried over)."""
        keep = set(task_ids)
        return EvalResult([t for t in self.trajectories if t.task_id in keep])

    @property
    def tokens_per_solve(self) -> float:
        """Mean generated tokens of the solved attempts (0 when none solved)."""
        solved = [t.completion_tokens for t in self.trajectories if t.success]
        return sum(solved) / len(solved) if solved else 0.0

    @property
    def infra_errors(self) -> int:
        return self.counts["infra_error_attempts"]


def task_family(task_id: str, families: dict[str, str] | None = None) -> str:
    """A task's family: ``families[task_id]`` (e.g. from ``task.metadata["family"]``), else the family
    named by a built-in task id (``heldout-0003-count_lines``), else ``uncategorized``."""
    if families and task_id in families:
        return families[task_id]
    return family_of_id(task_id)


def pass_at_1_by_family(result: EvalResult, families: dict[str, str] | None = None) -> dict[str, float]:
    """Pass@1 per task family (mean over the family's tasks of their pass rates), families sorted by name."""
    rates: dict[str, list[float]] = {}
    for task_id, outcomes in result.per_task().items():
        rates.setdefault(task_family(task_id, families), []).append(sum(outcomes) / len(outcomes))
    return {name: sum(v) / len(v) for name, v in sorted(rates.items())}


FAIL_TO_PASS_PREFIX = "fail_to_pass::"  # a repository task's reward.json entry per FAIL_TO_PASS test


def fail_to_pass_share(metrics: dict[str, float]) -> float | None:
    """The share of a repository task's FAIL_TO_PASS tests an attempt fixed (its ``fail_to_pass::<test>``
    entries), or None when the task has none."""
    values = [float(v) for k, v in metrics.items() if k.startswith(FAIL_TO_PASS_PREFIX)]
    return sum(v >= 1.0 for v in values) / len(values) if values else None


def by_source(records: Iterable[dict[str, Any]], sources: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Per source of tasks (``sources``: task id -> name, else each record's ``source`` key): tasks, scored
    attempts, Pass@1 (mean over tasks of their pass rates) and, for repository tasks, the share of FAIL_TO_PASS
    tests fixed (mean over tasks of the mean over their attempts; None for a source without such tasks).
    Infrastructure errors are left out."""
    per_task: dict[str, dict[str, tuple[list[bool], list[float]]]] = {}
    for r in records:
        if r.get("status") == STATUS_INFRA_ERROR:
            continue
        name = (sources or {}).get(r["task_id"]) or r.get("source")
        if name is None:
            continue
        entry = per_task.setdefault(name, {}).setdefault(r["task_id"], ([], []))
        reward = r.get("reward", {})
        entry[0].append(bool(reward.get("success")))
        share = fail_to_pass_share(reward.get("metrics", {}))
        if share is not None:
            entry[1].append(share)
    rows = []
    for name, tasks in sorted(per_task.items()):
        rates = [sum(ok) / len(ok) for ok, _ in tasks.values() if ok]
        fixed = [sum(f) / len(f) for _, f in tasks.values() if f]
        rows.append({"source": name, "tasks": len(tasks), "attempts": sum(len(ok) for ok, _ in tasks.values()),
                     "pass_at_1": _mean(rates), **_interval_fields(rates),
                     "fail_to_pass_fixed": _mean(fixed) if fixed else None})
    return rows


def _task_se(outcomes: list[list[bool]]) -> float | None:
    from albatross.eval.stats import task_interval

    return task_interval([sum(v) / len(v) for v in outcomes if v]).se


# ------------------------------------------------------------------------------------------- running


def evaluate(agent: Runner, tasks: list[Task], trials: int, workers: int = 16,
             out_jsonl: Path | None = None, retries: int = default("sandbox", "max_infra_retries"),
             progress: Callable[[int, int], None] | None = None,
             skip: Iterable[tuple[str, int]] = (),
             on_try: Callable[[Trajectory], None] | None = None,
             sources: dict[str, str] | None = None) -> EvalResult:
    """Run every task ``trials`` times; infrastructure errors are retried and never count as failures.

    ``out_jsonl``: every try is appended as it finishes (with its task's ``source`` when ``sources``, task id ->
    source name, is given). ``skip``: (task id, trial) pairs not to run (already finished). ``progress(done,
    total)`` is called after each attempt; ``on_try(traj)`` after each try (both from worker threads, one at a
    time). The result holds the final try of each attempt run now, in task then trial order."""
    done_pairs = set(skip)
    specs = [AttemptSpec(task, f"eval-{task.id}", i) for task in tasks for i in range(trials)
             if (task.id, i) not in done_pairs]
    counts: Counter[str] = Counter()
    lock, stop = threading.Lock(), threading.Event()
    finished = [0]

    def record(traj: Trajectory) -> None:
        with lock:
            if stop.is_set():  # interrupted: this try was cut short, it is neither saved nor retried
                raise _Stopped
            if out_jsonl is not None:
                source = (sources or {}).get(traj.task_id)
                append_jsonl(out_jsonl, {**traj.to_dict(), **({"source": source} if source is not None else {})})
            if on_try is not None:
                on_try(traj)

    def one(spec: AttemptSpec) -> Trajectory:
        traj = run_with_retries(agent, spec, retries, counts, record)
        with lock:
            finished[0] += 1
            if progress is not None:
                progress(finished[0], len(specs))
        return traj

    return EvalResult(_run_all(one, specs, workers, stop), counts)


class _Stopped(Exception):
    """Raised in a worker whose attempt finished after the evaluation was interrupted."""


def _run_all(fn: Callable[[AttemptSpec], Trajectory], specs: list[AttemptSpec], workers: int,
             stop: threading.Event) -> list[Trajectory]:
    """Run ``fn`` over ``specs`` on a thread pool. On an interrupt (KeyboardInterrupt) ``stop`` is set
    and queued attempts are cancelled; running ones end when their sandboxes are closed."""
    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="eval")
    try:
        futures: list[Future[Trajectory]] = [pool.submit(fn, s) for s in specs]
        pending = set(futures)
        while pending:  # wait in short slices so that KeyboardInterrupt reaches this thread
            _, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
        return [f.result() for f in futures]
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------------- attempt records


def load_attempts(path: Path) -> list[dict[str, Any]]:
    """Read an attempts JSONL file, first cutting off a last line left unfinished by a crash."""
    path = Path(path)
    if path.is_file():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            path.write_bytes(data[: data.rfind(b"\n") + 1])
    return read_jsonl(path)


def finished_pairs(records: Iterable[dict[str, Any]]) -> set[tuple[str, int]]:
    """(task id, trial) pairs with a scored try (not an infrastructure error)."""
    return {(r["task_id"], int(r["attempt"])) for r in records if r.get("status") != STATUS_INFRA_ERROR}


def final_records(records: Iterable[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """The try that counts for each (task id, trial): the first scored one, else the last infra error."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for r in records:
        key = (r["task_id"], int(r["attempt"]))
        if key not in out or out[key].get("status") == STATUS_INFRA_ERROR:
            out[key] = r
    return out


# ----------------------------------------------------------------------------------- tokens and cost


@dataclass
class Usage:
    """Tokens of one attempt, as an API with prefix caching would bill them."""

    input: int = 0  # fresh (uncached) input tokens
    cached_input: int = 0
    output: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.input + other.input, self.cached_input + other.cached_input,
                     self.output + other.output)


@dataclass
class Price:
    """US dollars per million tokens."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0

    def cost(self, usage: Usage) -> float:
        return (usage.input * self.input + usage.cached_input * self.cached_input
                + usage.output * self.output) / 1e6


def sample_usage(loss_mask: list[int]) -> Usage:
    """Usage of one token sequence: each run of model tokens is one request (see the module doc)."""
    usage = Usage()
    prev_end, i, n = 0, 0, len(loss_mask)
    while i < n:
        if not loss_mask[i]:
            i += 1
            continue
        start = i
        while i < n and loss_mask[i]:
            i += 1
        usage += Usage(start - prev_end, prev_end, i - start)
        prev_end = i
    return usage


def record_usage(record: dict[str, Any]) -> Usage:
    """Usage stored in a record (``usage`` key), else computed from its samples."""
    if isinstance(record.get("usage"), dict):
        return Usage(**record["usage"])
    total = Usage()
    for s in record.get("samples", []):
        total += sample_usage(s.get("loss_mask", []))
    return total


def load_prices(path: str | Path) -> dict[str, Price]:
    """A TOML file of ``["model name"]`` tables with ``input``, ``cached_input``, ``output`` in USD per
    million tokens. Raises ``ValueError`` with one line naming the file and field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: price table not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from None
    return {name: _price(path, name, table) for name, table in data.items()}


def _price(path: Path, name: str, table: object) -> Price:
    if not isinstance(table, dict):
        raise ValueError(f'{path}: ["{name}"] must be a table of input, cached_input, output')
    unknown = set(table) - {"input", "cached_input", "output"}
    if unknown:
        raise ValueError(f'{path}: ["{name}"] unknown field {sorted(unknown)[0]!r}')
    for key, value in table.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0:
            raise ValueError(f'{path}: ["{name}"] {key} must be a non-negative number (USD per 1M tokens)')
    price = Price(**{k: float(v) for k, v in table.items()})
    if "cached_input" not in table:
        price.cached_input = price.input
    return price


# ------------------------------------------------------------------------------------------- summary


@dataclass
class _TaskStats:
    category: str
    n: int = 0
    successes: int = 0
    infra_errors: int = 0
    usage: Usage = field(default_factory=Usage)
    turns: int = 0
    wall_seconds: float = 0.0
    cost: float = 0.0
    solved_tokens: int = 0

    def add(self, r: dict[str, Any], usage: Usage, cost: float) -> None:
        self.n += 1
        self.successes += bool(r.get("reward", {}).get("success"))
        self.usage += usage
        self.turns += len(r.get("turns", []))
        self.wall_seconds += float(r.get("wall_seconds", 0.0))
        self.cost += cost
        if r.get("reward", {}).get("success"):
            self.solved_tokens += usage.output


def summarize(records: Iterable[dict[str, Any]], *, tasks: Iterable[str] | None = None,
              trials: int | None = None, categories: dict[str, str] | None = None,
              price: Price | None = None) -> dict[str, Any]:
    """Figures of an evaluation from its attempt records (every try, in any order).

    ``tasks`` / ``trials`` restrict to those task ids and trials below ``trials``; ``categories`` maps
    task id -> category (else a record's ``category`` key); ``price`` reprices every attempt (else a
    record's ``cost`` key). Infrastructure errors are counted, never scored."""
    records = list(records)
    wanted = set(tasks) if tasks is not None else None
    keep = [r for r in records if (wanted is None or r["task_id"] in wanted)
            and (trials is None or int(r["attempt"]) < trials)]
    stats = _task_stats(keep, categories or {}, price)
    per_task = [_task_row(tid, s) for tid, s in sorted(stats.items())]
    scored = [s for s in stats.values() if s.n]
    n_attempts = sum(s.n for s in scored)
    usage = sum((s.usage for s in scored), Usage())
    solved = sum(s.successes for s in scored)
    return {
        "tasks": len(stats),
        "trials": trials if trials is not None else max((s.n for s in stats.values()), default=0),
        "attempts": n_attempts,
        "successes": solved,
        "pass_at_1": _mean([s.successes / s.n for s in scored]),
        **_interval_fields([s.successes / s.n for s in scored]),
        "pass_at_k": _pass_at_ks(scored),
        "infra_errors": sum(1 for r in keep if r.get("status") == STATUS_INFRA_ERROR),
        "unscored_attempts": sum(s.infra_errors for s in stats.values()),
        "statuses": dict(Counter(r.get("status", "ok") for r in final_records(keep).values())),
        "tokens": asdict(usage),
        "tokens_per_task": _per(asdict(usage), n_attempts),
        "tokens_per_solve": round(sum(s.solved_tokens for s in scored) / solved, 2) if solved else 0.0,
        "turns_per_task": _div(sum(s.turns for s in scored), n_attempts),
        "wall_seconds_per_task": _div(sum(s.wall_seconds for s in scored), n_attempts),
        "cost_total": sum(s.cost for s in scored),
        "cost_per_task": _div(sum(s.cost for s in scored), n_attempts),
        "per_task": per_task,
        "per_category": _category_rows(per_task),
        **({"per_source": rows} if (rows := by_source(final_records(keep).values())) else {}),
    }


def _task_stats(records: list[dict[str, Any]], categories: dict[str, str],
                price: Price | None) -> dict[str, _TaskStats]:
    stats: dict[str, _TaskStats] = {}
    for r in records:
        cat = categories.get(r["task_id"]) or r.get("category") or UNCATEGORIZED
        stats.setdefault(r["task_id"], _TaskStats(cat))
    for (tid, _), r in sorted(final_records(records).items()):
        s = stats[tid]
        if r.get("status") == STATUS_INFRA_ERROR:
            s.infra_errors += 1
            continue
        usage = record_usage(r)
        s.add(r, usage, price.cost(usage) if price is not None else float(r.get("cost", 0.0)))
    return stats


def _task_row(task_id: str, s: _TaskStats) -> dict[str, Any]:
    return {"task": task_id, "category": s.category, "n": s.n, "successes": s.successes,
            "pass_at_1": _div(s.successes, s.n), "unscored": s.infra_errors,
            "turns": _div(s.turns, s.n), "output_tokens": _div(s.usage.output, s.n),
            "wall_seconds": _div(s.wall_seconds, s.n), "cost": _div(s.cost, s.n)}


def _category_rows(per_task: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_cat: dict[str, list[dict[str, Any]]] = {}
    for row in per_task:
        by_cat.setdefault(row["category"], []).append(row)
    out = []
    for cat, rows in sorted(by_cat.items()):
        scored = [r for r in rows if r["n"]]
        n = sum(r["n"] for r in scored)
        out.append({"category": cat, "tasks": len(rows), "attempts": n,
                    "pass_at_1": _mean([r["pass_at_1"] for r in scored]),
                    "cost_per_task": _div(sum(r["cost"] * r["n"] for r in scored), n)})
    return out


def _interval_fields(rates: list[float]) -> dict[str, Any]:
    """``pass_at_1_se`` and ``pass_at_1_ci95`` over tasks (``eval/stats.py``: the one interval albatross uses)."""
    from albatross.eval.stats import task_interval

    iv = task_interval(rates)
    return {"pass_at_1_se": iv.se, "pass_at_1_ci95": None if iv.low is None else [iv.low, iv.high]}


def _pass_at_ks(scored: list[_TaskStats]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k in range(1, max((s.n for s in scored), default=0) + 1):
        vals = [pass_at_k(s.n, s.successes, k) for s in scored if s.n >= k]
        out[str(k)] = _mean(vals)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _div(a: float, b: float) -> float:
    return a / b if b else 0.0


def _per(totals: dict[str, int], n: int) -> dict[str, float]:
    return {k: _div(v, n) for k, v in totals.items()}
