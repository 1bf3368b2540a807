"""`albatross report`: one self-contained HTML page from eval and training run directories.

Figures (matplotlib, PNG embedded as data URIs): Pass@1 against cost per task on a log axis with the
Pareto frontier and every result labelled; a per-category breakdown; training curves of each training
run. Tables give the figures behind the plots and the configuration that produced each result.

A directory is read as:
- an eval directory (``albatross eval --out``): ``attempts.jsonl``, ``eval.json``, ``summary.json``;
- a demo or training run directory: ``eval_<name>.jsonl`` files (one result each, e.g. base and
  trained), ``run/metrics.jsonl`` or ``metrics.jsonl`` (training curves), ``run/trajectories.jsonl``
  (reward and tokens per solve by policy version), ``summary.json`` and ``config.json`` if present.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albatross.errors import UserError
from albatross.eval.run import Price, load_attempts, load_prices, summarize, task_family
from albatross.eval.stats import DEFINITION, Interval, paired_difference, task_interval, verdict
from albatross.records import read_jsonl
from albatross.tasks.format import UNCATEGORIZED

if TYPE_CHECKING:  # annotations only: matplotlib is imported when a figure is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_PRICE_KEY = "*"
_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22"]
_MARKERS = ["o", "s", "D", "^", "v", "P", "X", "*", "<", ">"]


class ReportError(UserError, ValueError):
    """A report input is unusable; the message is one line naming the directory or file."""


@dataclass
class Result:
    """One evaluated model or checkpoint."""

    label: str
    source: Path
    summary: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    expected_attempts: int | None = None  # tasks x trials of an eval directory, to flag a partial one
    role: str = "model"  # "model": an evaluated model; "validation": a run's validation split (shown apart)
    split: str = ""  # a run's evaluation: "base", "trained", "validation"
    network: str = ""  # the network policies its attempts ran under (``network_policies``)


def network_policies(records: list[dict[str, Any]]) -> str:
    """The network policies attempts ran under, as the report shows them: ``registries``, or with counts
    when tasks narrowed the run's (``registries (60), none (4)``); ``—`` for records from before policies."""
    from collections import Counter

    counts = Counter(str(r.get("network") or "") for r in records if "task_id" in r)
    counts.pop("", None)
    if not counts:
        return "—"
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{policy} ({n})" for policy, n in counts.most_common())


@dataclass
class TrainingRun:
    label: str
    source: Path
    metrics: list[dict[str, Any]]
    by_version: dict[int, dict[str, float]] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- load


def load_dir(path: str | Path, prices: dict[str, Price] | None = None) -> tuple[list[Result], list[TrainingRun]]:
    """The results and training runs found in one directory (see the module docstring)."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path}: no such directory")
    results = [_eval_result(path, prices)] if (path / "attempts.jsonl").is_file() else []
    results += _run_results(path, prices)
    runs = [r for r in [_training_run(path)] if r is not None]
    if not results and not runs:
        raise ReportError(f"{path}: no attempts.jsonl, eval_*.jsonl or metrics.jsonl found")
    return results, runs


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: invalid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _pick_price(prices: dict[str, Price] | None, *names: str) -> Price | None:
    if not prices:
        return None
    for name in (*names, DEFAULT_PRICE_KEY):
        if name in prices:
            return prices[name]
    return None


def _eval_result(path: Path, prices: dict[str, Price] | None) -> Result:
    config = _read_json(path / "eval.json")
    label = str(config.get("label") or _read_json(path / "summary.json").get("label") or path.name)
    tasks, trials = config.get("tasks"), config.get("trials")
    records = load_attempts(path / "attempts.jsonl")
    summary = summarize(records, tasks=tasks, trials=trials, price=_pick_price(prices, label))
    expected = len(tasks) * int(trials) if isinstance(tasks, list) and isinstance(trials, int) else None
    return Result(label, path, summary, config, expected, network=network_policies(list(records)))


def _run_results(path: Path, prices: dict[str, Price] | None) -> list[Result]:
    files = sorted(path.glob("eval_*.jsonl"))
    if not files:
        return []
    summary = _read_json(path / "summary.json")
    config = {"summary.json": summary, **({"config.json": c} if (c := _read_json(path / "config.json")) else {})}
    categories = _task_categories(path / "tasks")
    out = []
    for f in files:
        split = f.stem.removeprefix("eval_")
        label = f"{path.name} {split}"
        records = read_jsonl(f)
        families = {r["task_id"]: task_family(r["task_id"]) for r in records if "task_id" in r}
        known = {**{t: f for t, f in families.items() if f != UNCATEGORIZED}, **categories}
        s = summarize(records, categories=known, price=_pick_price(prices, label, path.name))
        out.append(Result(label, path, s, config, role="validation" if split == "validation" else "model",
                          split=split, network=network_policies(records)))
    return out


def _task_categories(tasks_dir: Path) -> dict[str, str]:
    """Task id -> category of the task directories below ``tasks_dir`` (empty when unreadable)."""
    out: dict[str, str] = {}
    for toml_path in tasks_dir.glob("**/task.toml") if tasks_dir.is_dir() else []:
        try:
            meta = tomllib.loads(toml_path.read_text()).get("metadata", {})
        except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError):
            continue
        if isinstance(meta, dict) and (meta.get("category") or meta.get("family")):
            out[toml_path.parent.name] = str(meta.get("category") or meta.get("family"))
    return out


def _training_run(path: Path) -> TrainingRun | None:
    for run_dir in (path / "run", path):
        if (run_dir / "metrics.jsonl").is_file():
            metrics = read_jsonl(run_dir / "metrics.jsonl")
            return TrainingRun(path.name, path, metrics, _by_version(run_dir / "trajectories.jsonl"))
    return None


def _by_version(path: Path) -> dict[int, dict[str, float]]:
    """Mean reward and tokens per solve of the training attempts, by the newest policy version in each."""
    acc: dict[int, list[float]] = {}
    if not path.is_file():
        return {}
    with path.open() as f:
        for line in f:
            try:
                t = json.loads(line)
            except json.JSONDecodeError:
                continue
            versions = [v for s in t.get("samples", []) for v, m in zip(s["versions"], s["loss_mask"],
                                                                        strict=False) if m]
            if not versions or t.get("status") == "infra_error":
                continue
            a = acc.setdefault(max(versions), [0, 0.0, 0, 0])
            ok = bool(t["reward"].get("success"))
            a[0] += 1
            a[1] += float(t["reward"].get("score", 0.0))
            a[2] += ok
            a[3] += t.get("completion_tokens", 0) if ok else 0
    return {v: {"reward": a[1] / a[0], "tokens_per_solve": a[3] / a[2] if a[2] else math.nan}
            for v, a in sorted(acc.items())}


# ------------------------------------------------------------------------------------------ figures


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


_X_AXES = {  # kind: (what, axis label, note of a result at zero)
    "cost": ("cost", "average cost per task, USD (log scale)", "no price"),
    "tokens": ("generated tokens", "output tokens per task (log scale; no prices given: pass --prices for cost)",
               "no tokens"),
}


def _x_values(results: list[Result]) -> tuple[list[float], str, list[bool]]:
    """x of each result, the axis kind ("cost", or "tokens" when no result has a price), and which
    results are at zero (drawn hollow one decade left of the smallest non-zero value)."""
    costs = [r.summary["cost_per_task"] for r in results]
    kind = "cost" if any(c > 0 for c in costs) else "tokens"
    values = costs if kind == "cost" else [r.summary["tokens_per_task"]["output"] for r in results]
    positive = [v for v in values if v > 0]
    floor = min(positive) / 10 if positive else 1.0
    return [v if v > 0 else floor for v in values], kind, [v <= 0 for v in values]


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats (cost no higher, pass rate higher), by cost."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def fig_pareto(results: list[Result]) -> str:
    from matplotlib.figure import Figure

    xs, kind, free = _x_values(results)
    what, xlabel, zero_note = _X_AXES[kind]
    ys = [r.summary["pass_at_1"] for r in results]
    fig = Figure(figsize=(10, 6))
    ax = fig.add_subplot()
    front = pareto_front(list(zip(xs, ys, strict=True)))
    ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="#444", lw=1.5, zorder=1,
            label="Pareto frontier")
    for i, r in enumerate(results):
        half = _interval(r).half_width or 0.0
        color = _COLORS[i % len(_COLORS)]
        ax.errorbar(xs[i], ys[i], yerr=half, fmt=_MARKERS[i % len(_MARKERS)], ms=10, capsize=4, color=color,
                    mfc="white" if free[i] else color, zorder=3, label=r.label + (f" ({zero_note})" if free[i] else ""))
    ax.set_xscale("log")
    _log_ticks(ax, xs, dollars=kind == "cost")
    ax.set_ylim(-0.03, 1.05)
    _labels(ax, fig, xs, ys, [r.label for r in results])
    ax.yaxis.set_major_formatter(_percent())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("Pass@1 (95% interval over tasks)")
    ax.set_title(f"Pass@1 against {what} per task")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    return _png(fig)


def _labels(ax: Axes, fig: Figure, xs: list[float], ys: list[float], labels: list[str]) -> None:
    """Label each point to its right, at the nearest height where the label overlaps no other label
    and no other point (a thin line joins a moved label to its point)."""
    pts = ax.transData.transform(list(zip(xs, ys, strict=True)))
    pt = fig.dpi / 72  # pixels per point
    step = 7 * pt
    boxes: list[tuple[float, float, float]] = []
    bottom, top = ax.bbox.y0 + 6 * pt, ax.bbox.y1 - 6 * pt
    for i in sorted(range(len(xs)), key=lambda j: pts[j][1]):
        x, y = pts[i]
        x0, x1 = x + 10 * pt, x + (14 + 6.0 * len(labels[i])) * pt
        others = [p for j, p in enumerate(pts) if j != i]
        for k in range(60):
            dy = step * ((k + 1) // 2) * (1 if k % 2 else -1) if k else 0.0
            ly = y + dy
            if bottom <= ly <= top and not _collides(x0, x1, ly, boxes, others, pt):
                break
        boxes.append((x0, x1, ly))
        off = (ly - y) / pt
        arrow = {"arrowstyle": "-", "color": "#999", "lw": 0.8} if abs(off) > 8 else None
        ax.annotate(labels[i], (xs[i], ys[i]), xytext=(12, off), textcoords="offset points", fontsize=10,
                    color=_COLORS[i % len(_COLORS)], va="center", arrowprops=arrow)


def _collides(x0: float, x1: float, y: float, boxes: list[tuple[float, float, float]], points: list[Any],
              pt: float) -> bool:
    """Whether a label spanning x0..x1 at height y meets a placed label or a point (pixels)."""
    if any(bx0 < x1 and x0 < bx1 and abs(by - y) < 13 * pt for bx0, bx1, by in boxes):
        return True
    return any(x0 - 7 * pt <= px <= x1 and abs(py - y) < 10 * pt for px, py in points)


def _log_ticks(ax: Axes, xs: list[float], dollars: bool) -> None:
    """Pad the log axis around the points and label ticks as plain numbers (dollars for cost)."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xlim(min(xs) / 3, max(xs) * 3)
    fmt = FuncFormatter(lambda v, _pos: (f"${v:g}" if dollars else f"{v:g}"))
    ax.xaxis.set_major_formatter(fmt)
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: ""))


def _percent() -> PercentFormatter:
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(xmax=1.0)


def fig_categories(results: list[Result]) -> str:
    from matplotlib.figure import Figure

    cats = sorted({c["category"] for r in results for c in r.summary["per_category"]})
    n = len(results)
    fig = Figure(figsize=(10, max(2.5, 0.45 * len(cats) * max(1, n) ** 0.5 + 1.5)))
    ax = fig.add_subplot()
    height = 0.8 / max(n, 1)
    for i, r in enumerate(results):
        rates = {c["category"]: c["pass_at_1"] for c in r.summary["per_category"]}
        ys = [j + (i - (n - 1) / 2) * height for j in range(len(cats))]
        ax.barh(ys, [rates.get(c, 0.0) for c in cats], height=height, color=_COLORS[i % len(_COLORS)],
                label=r.label)
    ax.set_yticks(range(len(cats)), cats)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(_percent())
    ax.set_xlabel("Pass@1")
    ax.set_title("Pass@1 by task category")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    return _png(fig)


def _series(metrics: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float)) and "step" in m]
    return [p[0] for p in pts], [p[1] for p in pts]


def _zero_signal_share(metrics: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Per step: the share of the groups finished for that step's batch whose attempts all scored the same
    (``batch/dropped_zero_signal`` / ``batch/groups_seen``); runs that logged only running totals
    (``groups``, ``zero_signal_groups``) by their differences."""
    xs, ys = [], []
    if any("batch/groups_seen" in m for m in metrics):
        for m in metrics:
            seen = m.get("batch/groups_seen")
            if isinstance(seen, (int, float)) and seen > 0 and "step" in m:
                xs.append(m["step"])
                ys.append(float(m.get("batch/dropped_zero_signal", 0.0)) / seen)
        return xs, ys
    prev_g = prev_z = 0
    for m in metrics:
        if "groups" in m and "zero_signal_groups" in m:
            dg, dz = m["groups"] - prev_g, m["zero_signal_groups"] - prev_z
            prev_g, prev_z = m["groups"], m["zero_signal_groups"]
            if dg > 0:
                xs.append(m["step"])
                ys.append(dz / dg)
    return xs, ys


Line = tuple[str, Sequence[float], Sequence[float]]  # label, xs, ys
Panel = tuple[str, str, str, list[Line]]  # title, x label, y label, lines


def _training_panels(run: TrainingRun) -> list[Panel]:
    """(title, x label, y label, [(line label, xs, ys)]) of each training panel."""
    m, bv = run.metrics, run.by_version
    versions = list(bv)

    def from_metrics_or_versions(keys: tuple[str, ...], fallback: str) -> tuple[str, list[Line]]:
        """A per-step metric when the run logged one, else the value by policy version (trajectories)."""
        for key in keys:
            if any(key in r for r in m):
                return "trainer step", [(key, *_series(m, key))]
        return "policy version", [(fallback, versions, [bv[v][fallback] for v in versions])]

    reward_x, reward = from_metrics_or_versions(("reward_mean", "reward"), "reward")
    tps_x, tps = from_metrics_or_versions(("tokens_per_solve",), "tokens_per_solve")
    step = "trainer step"
    return [
        ("reward", reward_x, "mean score of the attempts", reward),
        ("pass rate", step, "share of attempts solved", [("pass_rate", *_series(m, "pass_rate"))]),
        ("loss", step, "policy loss", [("loss", *_series(m, "loss"))]),
        ("gradient norm", step, "norm before clipping", [("grad_norm", *_series(m, "grad_norm"))]),
        ("learning rate", step, "learning rate", [("lr", *_series(m, "lr"))]),
        ("entropy", step, "nats per token", [("entropy", *_series(m, "entropy"))]),
        ("mismatch KL", step, "KL(sampler || trainer) per token",
         [("mismatch_kl", *_series(m, "mismatch_kl")), ("without routing replay", *_series(m, "mismatch_kl_no_replay"))]),
        ("staleness", step, "policy versions behind", [("mean", *_series(m, "staleness_mean")),
                                                        ("max", *_series(m, "staleness_max"))]),
        ("zero-signal groups", step, "share of the step's groups", [("share", *_zero_signal_share(m))]),
        ("throughput", step, "tokens per second", [("trainer", *_series(m, "tokens_per_s")),
                                                    ("engines (generated)", *_series(m, "engine_tokens_per_s"))]),
        ("tokens per solve", tps_x, "generated tokens per solved attempt", tps),
        ("infra errors", step, "attempts (running total)", [("attempts", *_series(m, "infra_error_attempts"))]),
    ]


def smooth(ys: Sequence[float], weight: float = 0.8) -> list[float]:
    """Exponential moving average with bias correction (TensorBoard's smoothing): the early points are not
    pulled towards 0."""
    out, acc, norm = [], 0.0, 0.0
    for y in ys:
        acc = weight * acc + (1 - weight) * y
        norm = weight * norm + (1 - weight)
        out.append(acc / norm)
    return out


def fig_training(run: TrainingRun) -> str:
    from matplotlib.figure import Figure

    panels = _training_panels(run)
    fig = Figure(figsize=(13, 9.5), layout="constrained")
    axes = fig.subplots(3, 4)
    for ax, (title, xlabel, ylabel, lines) in zip(axes.flat, panels, strict=True):
        drawn = 0
        for i, (name, xs, ys) in enumerate(lines):
            if not xs:
                continue
            color = _COLORS[i % len(_COLORS)]
            if len(xs) >= 5:  # raw values faint, the smoothed trend on top
                ax.plot(xs, ys, "-", lw=0.8, alpha=0.35, color=color)
                ax.plot(xs, smooth(ys), "-", lw=1.8, color=color, label=f"{name} (smoothed)")
            else:
                ax.plot(xs, ys, "o-", ms=3, lw=1.5, color=color, label=name)
            drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="#888")
        if drawn > 1:
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"training: {run.label} (faint: each step; solid: smoothed)", fontsize=12)
    return _png(fig)


# --------------------------------------------------------------------------------------------- html

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;max-width:1120px;margin:24px auto;
padding:0 20px;color:#222;line-height:1.45}
h1{font-size:1.7em;margin-bottom:.2em}h2{margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.meta{color:#666;font-size:.9em}
img{max-width:100%;height:auto;display:block;margin:12px 0;border:1px solid #eee}
table{border-collapse:collapse;margin:10px 0;font-size:.9em}
th,td{border:1px solid #ddd;padding:4px 10px;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}
pre{background:#f7f7f7;padding:10px;overflow-x:auto;font-size:.8em}
details{margin:8px 0}summary{cursor:pointer;font-weight:600}
#headline{background:#f6f8fa;border:1px solid #d0d7de;border-radius:6px;padding:6px 16px;margin:14px 0}
.headline{font-size:1.15em}.verdict{font-size:1.35em;font-weight:700}
.verdict.good{color:#1a7f37}.verdict.bad{color:#cf222e}.verdict.flat{color:#444}.run{color:#666}
"""


def _esc(value: Any) -> str:
    """Escape text content (quotes stay readable); attributes go through ``html.escape``."""
    return html.escape(str(value), quote=False)


def _img(fig_id: str, data: str, alt: str) -> str:
    return f'<img id="{html.escape(fig_id)}" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _html_table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _money(value: float, priced: bool) -> str:
    """A cost per task: ``—`` without prices (a local model costs nothing we know of), else dollars to 3
    significant digits."""
    if not priced:
        return "—"
    return f"${value:.3g}" if value >= 0.001 else f"${value:.2e}"


def _interval(r: Result) -> Interval:
    """Pass@1 of a result with the one interval of ``eval/stats.py`` (over tasks, trials nested)."""
    return task_interval(list(_task_rates(r).values()))


def _task_rates(r: Result) -> dict[str, float]:
    return {row["task"]: row["pass_at_1"] for row in r.summary["per_task"] if row["n"]}


def _results_table(results: list[Result]) -> str:
    priced = any(r.summary["cost_per_task"] > 0 for r in results)
    rows = []
    for r in results:
        s = r.summary
        ks = s["pass_at_k"]
        kmax = max(ks, key=int) if ks else "1"
        partial = r.expected_attempts is not None and s["attempts"] < r.expected_attempts
        rows.append([r.label, _interval(r).text(), f"{ks.get(kmax, 0.0):.3f} (k={kmax})", s["tasks"],
                     f"{s['attempts']} of {r.expected_attempts} (partial)" if partial else s["attempts"],
                     _money(s["cost_per_task"], priced), f"{s['tokens_per_task']['input']:.0f}",
                     f"{s['tokens_per_task']['cached_input']:.0f}", f"{s['tokens_per_task']['output']:.0f}",
                     f"{s['turns_per_task']:.2f}", f"{s['wall_seconds_per_task']:.2f}", s["infra_errors"],
                     r.network or "—"])
    return _html_table(["result", "Pass@1 (95% CI)", "pass@k", "tasks", "attempts", "cost/task",
                        "input tok", "cached tok", "output tok", "turns", "wall s", "infra errors", "network"], rows)


def _category_table(results: list[Result]) -> str:
    priced = any(r.summary["cost_per_task"] > 0 for r in results)
    rows = [[r.label, c["category"], c["tasks"], c["attempts"], f"{c['pass_at_1']:.3f}",
             _money(c["cost_per_task"], priced)] for r in results for c in r.summary["per_category"]]
    return _html_table(["result", "category", "tasks", "attempts", "Pass@1", "cost/task"], rows)


def _pairs(results: list[Result]) -> list[tuple[Result, Result]]:
    """(base, trained) of each run directory that evaluated both."""
    by_source: dict[Path, dict[str, Result]] = {}
    for r in results:
        if r.split:
            by_source.setdefault(r.source, {})[r.split] = r
    return [(d["base"], d["trained"]) for d in by_source.values() if "base" in d and "trained" in d]


def headline(base: Result, trained: Result) -> tuple[str, str]:
    """(verdict, sentence): did training help? Base and trained Pass@1 with their intervals, the paired
    difference with its interval, and a plain verdict."""
    diff = paired_difference(_task_rates(base), _task_rates(trained))
    word = verdict(diff)
    trials = trained.summary.get("trials")
    sentence = (f"Held-out Pass@1: base {_interval(base).text()}, trained {_interval(trained).text()}; "
                f"trained - base {diff.text(signed=True)} over {diff.n} tasks"
                + (f" x {trials} trials" if trials else "") + f": {word}.")
    return word, sentence


def _headline_section(results: list[Result]) -> str:
    parts = ["<section id='headline'>"]
    pairs = _pairs(results)
    for base, trained in pairs:
        word, sentence = headline(base, trained)
        run = base.source.name
        parts.append(f"<p class='headline'><span class='verdict {'good' if word == 'training helped' else 'bad' if word == 'training hurt' else 'flat'}'>"
                     f"Did training help? {_esc(word.capitalize())}.</span> <span class='run'>({_esc(run)})</span>"
                     f"<br>{_esc(sentence)}</p>")
    if not pairs:
        models = [r for r in results if r.role == "model"]
        best = max(models, key=lambda r: r.summary["pass_at_1"], default=None)
        if best is not None:
            parts.append(f"<p class='headline'>Best Pass@1: {_esc(best.label)} {_esc(_interval(best).text())}"
                         f" over {best.summary['tasks']} tasks.</p>")
    parts.append(f"<p class='meta'>All intervals: {_esc(DEFINITION)}. An interval that covers 0 is no "
                 "significant change.</p></section>")
    return "\n".join(parts)


def _family_section(results: list[Result]) -> str:
    """Per-family Pass@1 of base and trained, with the paired difference and its interval."""
    rows = []
    for base, trained in _pairs(results):
        b_rates, t_rates = _task_rates(base), _task_rates(trained)
        fam_b = {row["task"]: row["category"] for row in base.summary["per_task"]}
        for family in sorted(set(fam_b.values())):
            ids = {t for t, f in fam_b.items() if f == family}
            b = task_interval([v for t, v in b_rates.items() if t in ids])
            t = task_interval([v for t, v in t_rates.items() if t in ids])
            d = paired_difference({k: v for k, v in b_rates.items() if k in ids}, t_rates)
            rows.append([base.source.name, family, b.n, b.text(), t.text(), d.text(signed=True), verdict(d)])
    if not rows:
        return ""
    return ("<h2>Per family</h2><p>Pass@1 of each task family (a family held out from training tests transfer "
            "to a new kind of task).</p>"
            + _html_table(["run", "family", "tasks", "base", "trained", "trained - base", "verdict"], rows))


def _source_section(results: list[Result]) -> str:
    """Per source of a task mix (``tasks.mix``): Pass@1 and, for repository tasks, the share of FAIL_TO_PASS
    tests fixed, of every result whose attempts name their source."""
    rows = [[r.label, row["source"], row["tasks"], row["attempts"], f"{row['pass_at_1']:.3f}",
             "-" if row["fail_to_pass_fixed"] is None else f"{row['fail_to_pass_fixed']:.3f}"]
            for r in results for row in r.summary.get("per_source", [])]
    if not rows:
        return ""
    return ("<h2>Per source</h2><p>Pass@1 of each source of the task mix, and for repository tasks the share of "
            "their FAIL_TO_PASS tests an attempt fixed (mean over tasks).</p>"
            + _html_table(["result", "source", "tasks", "attempts", "Pass@1", "FAIL_TO_PASS fixed"], rows))


def _validation_section(validation: list[Result]) -> str:
    if not validation:
        return ""
    rows = [[r.label, _interval(r).text(), r.summary["tasks"], r.summary["attempts"]] for r in validation]
    return ("<h2>Validation</h2><p>The trained model on the validation split: tasks of the training families "
            "in their own words, kept apart to tune settings on (report the held-out figures above). Not a "
            "model of its own, so not in the comparisons.</p>"
            + _html_table(["split", "Pass@1 (95% CI)", "tasks", "attempts"], rows))


def _config_section(results: list[Result], runs: list[TrainingRun]) -> str:
    """Each source directory's configuration once, collapsed (a run's base, trained and validation results share
    one)."""
    parts, seen = [], set()
    for r in results:
        if r.source in seen:
            continue
        seen.add(r.source)
        parts.append(f"<details><summary>configuration of {_esc(r.source.name)} <span class='meta'>"
                     f"{_esc(r.source)}</span></summary><pre>"
                     f"{_esc(json.dumps(r.config or {'note': 'no configuration recorded'}, indent=2))}</pre></details>")
    for run in runs:
        last = run.metrics[-1] if run.metrics else {}
        parts.append(f"<details><summary>training run {_esc(run.label)}: last metrics record</summary>"
                     f"<pre>{_esc(json.dumps(last, indent=2))}</pre></details>")
    return "\n".join(parts)


RECIPE_FILE = "bench_recipe.json"  # `albatross bench recipe --json` output, when put in a run directory


def load_recipe(path: str | Path) -> dict[str, Any] | None:
    """The ``bench recipe`` JSON of a directory, or None when it has none."""
    file = Path(path) / RECIPE_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except ValueError as e:
        raise ReportError(f"{file}: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("table"), list):
        raise ReportError(f"{file}: no 'table' field (not the output of `albatross bench recipe --json`)")
    return data


def recipe_section(source: Path, data: dict[str, Any]) -> str:
    """A ``bench recipe`` JSON as HTML: the table (claim, the seed's figure, ours), its notes and its plot."""
    mode = f"--quick, {data.get('seeds')} seed(s): a smoke test" if data.get("quick") else f"{data.get('seeds')} seeds"
    parts = [f"<h2>Recipe: the seed's figures beside ours</h2><p class='meta'>{_esc(source / RECIPE_FILE)} "
             f"({_esc(mode)})</p>",
             _html_table(["claim", "seed", "ours"], [list(row)[:3] for row in data["table"]])]
    if data.get("notes"):
        parts.append("<ul>" + "".join(f"<li>{_esc(n)}</li>" for n in data["notes"]) + "</ul>")
    plot = Path(str(data.get("stability_plot") or ""))
    if plot.name and not plot.is_absolute():
        plot = source / plot
    if plot.name and plot.is_file():
        parts.append(_img("fig-recipe-stability", base64.b64encode(plot.read_bytes()).decode(),
                          "entropy and mismatch KL by trainer step"))
    return "\n".join(parts)


def render_html(results: list[Result], runs: list[TrainingRun], title: str,
                recipes: Sequence[tuple[Path, dict[str, Any]]] = ()) -> str:
    """The whole page as one string (``recipes``: ``bench recipe`` JSONs and their directories)."""
    models = [r for r in results if r.role == "model"]
    body = [f"<h1>{_esc(title)}</h1>",
            f"<p class='meta'>generated {_esc(time.strftime('%Y-%m-%d %H:%M:%S'))} from "
            f"{_esc(', '.join(sorted({str(r.source) for r in results} | {str(r.source) for r in runs})))}</p>"]
    if results:
        body.append(_headline_section(results))
        body.append(_family_section(results))
        body.append(_source_section(results))
    if models:
        body += ["<h2>Pass@1 against cost per task</h2>",
                 "<p>Each point is one evaluated model or checkpoint; the dashed line is the Pareto "
                 "frontier (no other result is both cheaper and better). Error bars: the 95% interval over "
                 "tasks.</p>",
                 _img("fig-pareto", fig_pareto(models), "Pass@1 against cost per task"),
                 _results_table(models),
                 "<h2>Per-category breakdown</h2>",
                 _img("fig-categories", fig_categories(models), "Pass@1 by task category"),
                 _category_table(models)]
    body.append(_validation_section([r for r in results if r.role == "validation"]))
    if runs:
        body.append("<h2>Training runs</h2>")
        body += [_img(f"fig-training-{i}", fig_training(run), f"training curves of {run.label}")
                 for i, run in enumerate(runs)]
    body += [recipe_section(source, data) for source, data in recipes]
    body += ["<h2>Configuration</h2>", _config_section(results, runs)]
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{_esc(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(b for b in body if b) + "\n</body></html>\n")


def _unique_labels(results: list[Result]) -> None:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.label] = counts.get(r.label, 0) + 1
    for r in results:
        if counts[r.label] > 1:
            r.label = f"{r.label} ({r.source})"


def write_report(dirs: list[str | Path], out_path: str | Path, *, prices: str | Path | None = None,
                 title: str = "albatross report") -> Path:
    """Write the HTML report of the eval / run directories ``dirs`` to ``out_path``; return its path.

    ``prices``: a price table (see ``albatross eval --prices``) that reprices each result by its label,
    else the ``["*"]`` entry. Raises ``ReportError`` (one line) for unusable inputs."""
    try:
        table = load_prices(prices) if prices is not None else None
    except ValueError as e:
        raise ReportError(str(e)) from None
    results: list[Result] = []
    runs: list[TrainingRun] = []
    recipes: list[tuple[Path, dict[str, Any]]] = []
    for d in dirs:
        recipe = load_recipe(d)
        if recipe is not None:
            recipes.append((Path(d), recipe))
        try:
            rs, ts = load_dir(d, table)
        except ReportError:
            if recipe is None:
                raise
            rs, ts = [], []  # a directory with only a bench recipe JSON
        results += rs
        runs += ts
    _unique_labels(results)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(results, runs, title, recipes), encoding="utf-8")
    return out.resolve()
