"""What a run reports: ``summary.json`` (its keys are a contract that outside checks read) and the printed table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from albatross.eval.run import EvalResult
    from albatross.tasks.format import Task

SUMMARY_KEYS = (
    "base_pass_at_1", "trained_pass_at_1", "heldout_tasks", "train_steps", "wall_seconds",
    "tokens_per_solve_base", "tokens_per_solve_trained", "zero_signal_group_fraction",
    "dropped_stale_tokens", "max_staleness_seen", "infra_error_attempts", "model", "engine",
    "weight_version_final", "parameters", "trainable_parameters",
)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def eval_fields(prefix: str, result: EvalResult | None) -> dict[str, Any]:
    """``<prefix>_pass_at_1`` and its standard error over tasks (``eval/stats.py``; None when nothing was
    evaluated)."""
    if result is None:
        return {f"{prefix}_pass_at_1": None, f"{prefix}_pass_at_1_se": None}
    return {f"{prefix}_pass_at_1": _round(result.pass_at_1), f"{prefix}_pass_at_1_se": _round(result.pass_at_1_se)}


def by_family(heldout: list[Task], **results: EvalResult | None) -> dict[str, dict[str, float | None]]:
    """``heldout_pass_at_1_by_family``: {"base": {family: pass@1}, "trained": {...}} (``family_of`` each task)."""
    from albatross.eval.run import pass_at_1_by_family
    from albatross.tasks.format import family_of

    families = {t.id: family_of(t) for t in heldout}
    return {name: {k: _round(v) for k, v in pass_at_1_by_family(r, families).items()} if r is not None else {}
            for name, r in results.items()}


def difference_fields(base: EvalResult | None, trained: EvalResult | None) -> dict[str, Any]:
    """``trained_minus_base``: the paired difference over the held-out tasks, its 95% interval and a verdict
    (``eval/stats.py``, the interval every figure uses); nothing when either evaluation is missing."""
    from albatross.eval.stats import outcome_rates, paired_difference, verdict

    if base is None or trained is None:
        return {}
    diff = paired_difference(outcome_rates(base.per_task()), outcome_rates(trained.per_task()))
    return {"trained_minus_base": {**diff.as_dict(), "verdict": verdict(diff)}}


def split_fields(heldout: list[Task], reward_only: list[str], **results: EvalResult | None) -> dict[str, Any]:
    """With ``tasks.reward_only_families``: ``<name>_pass_at_1_reward_only`` / ``_warm_started`` (and their
    ``_se``) for each result, over the held-out tasks of the reward-only families and of the others."""
    from albatross.tasks.format import family_of

    if not reward_only:
        return {}
    ids = {"reward_only": {t.id for t in heldout if family_of(t) in set(reward_only)}}
    ids["warm_started"] = {t.id for t in heldout} - ids["reward_only"]
    out: dict[str, Any] = {}
    for name, result in results.items():
        for part, task_ids in ids.items():
            fields = eval_fields(name, result.only(task_ids) if result is not None and task_ids else None)
            out.update({f"{name}_pass_at_1_{part}": fields[f"{name}_pass_at_1"],
                        f"{name}_pass_at_1_{part}_se": fields[f"{name}_pass_at_1_se"]})
    return out


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def format_table(summary: dict[str, Any], title: str = "albatross train: results") -> str:
    width = max(len(k) for k in summary)
    lines = ["", title, "-" * (width + 14)]
    lines += [f"{k:<{width}}  {json.dumps(v) if isinstance(v, dict) else v}" for k, v in summary.items()]
    d = summary.get("trained_minus_base")
    if isinstance(d, dict) and d.get("mean") is not None:
        ci = (f" (95% CI {d['ci95_low']:+.3f} to {d['ci95_high']:+.3f}, over {d['tasks']} tasks)"
              if d.get("ci95_low") is not None else "")
        lines.append(f"{'trained - base':<{width}}  {d['mean']:+.3f}{ci}: {d.get('verdict', '')}")
    return "\n".join(lines)
