"""Progress a person can plan by: the phases of a run with an estimate each, printed at the start; a bar with
elapsed time and ETA for the phase under way (tqdm on a terminal, plain lines with the same figures otherwise); a
line when a phase ends saying why it stopped, and the run's remaining time.

Estimates come from earlier runs of the same model and sandbox type on this machine (seconds per warm-start step,
per evaluation attempt, per trainer step, kept in ``<cache>/timings.json``), else from rough defaults; a phase with a
time budget (RL's ``orchestrator.max_minutes``) is never estimated above it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# Seconds per unit when no earlier run of this model measured them: the demo's tiny model on a 2-core laptop.
# A model given by `model.path` has no default (its estimate is "unknown" until a run has measured it).
TINY_RATES = {"warmstart_step": 0.4, "eval_attempt": 0.12, "rl_step": 4.0, "sandbox": 20.0, "tasks": 2.0}
PLAIN_EVERY_S = 30.0  # plain (non-terminal) progress lines: at least every 10% and every this many seconds


def fmt_duration(seconds: float | None) -> str:
    """``1h02m``, ``3m05s``, ``42s``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    s = int(round(max(0.0, seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def clock(after_s: float) -> str:
    """The wall-clock time ``after_s`` seconds from now, ``HH:MM``."""
    return time.strftime("%H:%M", time.localtime(time.time() + after_s))


class Timings:
    """Measured seconds per unit (``warmstart_step``, ``eval_attempt``, ``rl_step``, ``sandbox``, ``tasks``) of one
    model and sandbox type, kept across runs in a JSON file."""

    def __init__(self, path: Path, key: str, defaults: dict[str, float] | None = None) -> None:
        self.path, self.key, self.defaults = path, key, dict(defaults or {})
        self.saved = self._load().get(key, {})

    def _load(self) -> dict[str, dict[str, float]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def rate(self, unit: str) -> float | None:
        value = self.saved.get(unit, self.defaults.get(unit))
        return float(value) if isinstance(value, (int, float)) else None

    def record(self, unit: str, seconds: float, units: float) -> None:
        """Keep ``seconds / units`` as the rate of ``unit`` (nothing when no unit was done)."""
        if units <= 0 or seconds <= 0:
            return
        self.saved[unit] = seconds / units
        data = self._load()
        data[self.key] = self.saved
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(self.path)
        except OSError:  # a read-only cache: estimates stay the defaults
            pass


@dataclass
class Phase:
    """One phase of a run: its name, estimated seconds (None: unknown) and whether that is an upper bound."""

    name: str
    estimate_s: float | None
    bound: bool = False
    elapsed_s: float | None = None

    def describe(self) -> str:
        return f"{self.name} {'<= ' if self.bound else '~'}{fmt_duration(self.estimate_s)}"


@dataclass
class Plan:
    """The phases of a run, announced at the start; each phase's end updates the remaining estimate."""

    phases: list[Phase]
    log: Callable[[str], None] = print
    start: float = field(default_factory=time.monotonic)

    def announce(self) -> None:
        total = self.remaining_s()
        known = all(p.estimate_s is not None for p in self.phases)
        eta = f"eta {fmt_duration(total)} (about {clock(total)})" if known else \
            f"eta at least {fmt_duration(total)} (phases marked ? have no estimate yet)"
        self.log("[plan] " + ", ".join(p.describe() for p in self.phases) + f"; {eta}")

    def remaining_s(self, current: str | None = None, current_left_s: float | None = None) -> float:
        """Seconds left: the phases not yet done (the current one by ``current_left_s`` when given)."""
        left = 0.0
        for p in self.phases:
            if p.elapsed_s is not None:
                continue
            if p.name == current and current_left_s is not None:
                left += current_left_s
            else:
                left += p.estimate_s or 0.0
        return left

    @contextmanager
    def phase(self, name: str) -> Iterator[PhaseRun]:
        """Run one phase: on exit a line with how long it took and why it stopped (``PhaseRun.reason``, else
        ``done``; Ctrl-C says so and is re-raised)."""
        run = PhaseRun(self, name)
        try:
            yield run
        except KeyboardInterrupt:
            self.log(f"[{name}] stopped: Ctrl-C after {fmt_duration(time.monotonic() - run.t0)}")
            raise
        phase = self._get(name)
        phase.elapsed_s = time.monotonic() - run.t0
        left = self.remaining_s()
        tail = f"; run: {fmt_duration(time.monotonic() - self.start)} elapsed" + \
            (f", about {fmt_duration(left)} left" if left > 0 else "")
        self.log(f"[{name}] stopped: {run.reason} after {fmt_duration(phase.elapsed_s)}{tail}")

    def _get(self, name: str) -> Phase:
        for p in self.phases:
            if p.name == name:
                return p
        phase = Phase(name, None)
        self.phases.append(phase)
        return phase


@dataclass
class PhaseRun:
    plan: Plan
    name: str
    reason: str = "done"
    t0: float = field(default_factory=time.monotonic)


class Bar:
    """Progress of one phase over ``total`` units: a tqdm bar on a terminal, else a plain line at each further 10%
    (and at least every ``PLAIN_EVERY_S`` seconds), each with done/total, elapsed, ETA and ``extra`` figures. ``eta_cap_s``:
    a time budget the ETA never exceeds (RL's ``max_minutes`` left)."""

    def __init__(self, label: str, total: int, log: Callable[[str], None] = print, stream: IO[str] | None = None,
                 unit: str = "steps", plan: Plan | None = None) -> None:
        self.label, self.total, self.log, self.unit, self.plan = label, max(0, total), log, unit, plan
        self.stream = stream or sys.stdout
        self.tty = _isatty(self.stream)
        self.t0 = time.monotonic()
        self.done = 0
        self._mark: tuple[float, int] | None = None  # (time, done) of the first update: the pace is measured from
        # there, so set-up before the first unit (collecting demonstrations, loading an engine) does not count
        self._decile, self._last_line = 0, time.monotonic()
        self._tqdm = _tqdm(label, self.total, unit, self.stream) if self.tty else None

    def eta_s(self, cap_s: float | None = None) -> float | None:
        """Seconds left at the pace since the first update, never above ``cap_s``; unknown (``cap_s``) until a
        second update gives a pace (the time before the first one is set-up, not the pace: counting it made a
        600-step warm start behind 2 minutes of demonstrations read "eta 23h")."""
        if self.total and self.done >= self.total:
            return 0.0
        if not self.done or self._mark is None or self.done <= self._mark[1]:
            return cap_s
        pace = (time.monotonic() - self._mark[0]) / (self.done - self._mark[1])
        eta = pace * max(0, self.total - self.done)
        return min(eta, cap_s) if cap_s is not None else eta

    def update(self, done: int, extra: str = "", eta_cap_s: float | None = None) -> None:
        self.done = min(done, self.total) if self.total else done
        if self._mark is None and self.done > 0:
            self._mark = (time.monotonic(), self.done)
        eta = self.eta_s(eta_cap_s)
        if self._tqdm is not None:
            self._tqdm.n = self.done
            self._tqdm.set_postfix_str(f"eta {fmt_duration(eta)}" + (f"  {extra}" if extra else ""), refresh=False)
            self._tqdm.refresh()
            return
        decile = 10 * self.done // max(1, self.total)
        now = time.monotonic()
        if decile > self._decile or now - self._last_line >= PLAIN_EVERY_S or self.done == self.total:
            self._decile, self._last_line = decile, now
            self.log(self.line(eta) + (f"  {extra}" if extra else ""))

    def line(self, eta: float | None) -> str:
        run_left = self.plan.remaining_s(self.label, eta) if self.plan is not None else None
        return (f"[{self.label}] {self.done}/{self.total} {self.unit}  elapsed "
                f"{fmt_duration(time.monotonic() - self.t0)}  eta {fmt_duration(eta)}"
                + (f"  (run: about {fmt_duration(run_left)} left)" if run_left is not None else ""))

    def write(self, text: str) -> None:
        """A log line that does not break the bar."""
        if self._tqdm is not None:
            self._tqdm.write(text, file=self.stream)
        else:
            self.log(text)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _tqdm(label: str, total: int, unit: str, stream: IO[str]) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=f"[{label}]", unit=f" {unit}", file=stream, dynamic_ncols=True, leave=True,
                bar_format="{desc} {bar} {n_fmt}/{total_fmt}{unit} elapsed {elapsed} {postfix}")
