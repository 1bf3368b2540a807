"""``albatross tasks swe``: bug-fix tasks made from a real project's source distribution.

Stages (each timed; ``Yield`` counts what each kept):

1. **image**: the project's base image (``image.py``: the sdist at /repo, its test dependencies), once per version.
2. **baseline**: the whole test suite, twice, in an attempt of the image; the tests that pass both times are the
   stable ones. The first run records which library functions each test calls.
3. **mutants**: for each library function that stable tests call (and whose tests run within
   ``max_run_seconds``), up to ``per_function`` edits of different kinds (``mutate.py``), in a random order;
   each is run against the tests that call it (in their test files, every other test deselected), until 1.6 x
   ``count`` (+4) are kept. A mutant is kept when some stable tests fail with it (FAIL_TO_PASS, at most
   ``max_fail_to_pass``), others of those files still pass (PASS_TO_PASS: the tests it ran that passed, and the
   ones that do not call the mutated code, unless their test file no longer collects), and it ends in time.
4. **combinations**: two edits of one function (``medium``) and edits of two or three functions (``hard``), made
   of kept mutants and run again; kept when every part still fails a test of its own.
5. **tasks**: easy (one single-line edit), medium (a multi-line edit, or two in one function) and hard tasks in
   the ``shares`` proportions, written (``writer.py``) and, unless ``validate`` is off, put through the nine
   gates as they are written until ``count`` tasks pass; a task that fails a gate is removed (its reasons kept
   in the yield report).

All project code runs in the sandbox; the host only reads the repository's files and the runs' JSON results.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from albatross.errors import UserError
from albatross.sandbox.base import Backend
from albatross.tasks.swe import mutate, project
from albatross.tasks.swe.image import REPO, ProjectImage
from albatross.tasks.swe.instruction import issue_text
from albatross.tasks.swe.sdist import Sdist
from albatross.tasks.swe.writer import (
    PLUGIN,
    RUNNER,
    RepoTask,
    git_commit_script,
    link_or_copy,
    unified_patch,
    write_repo_task,
)

SCRIPTS = "/tmp/albatross-swe"
DIFFICULTIES = ("easy", "medium", "hard")
T = TypeVar("T")


@dataclass
class SweOptions:
    count: int = 100  # tasks to make (validated ones, when validate is on)
    seed: int = 0
    python: str = "3.11"
    per_function: int = 3  # edits tried per function
    max_mutants: int = 0  # single edits tried at most; 0: 10 x count
    max_fail_to_pass: int = 40
    max_run_seconds: float = 30.0  # baseline seconds of the test files a function's tests live in
    max_test_files: int = 6
    workers: int = 0  # attempts run at once; 0: the number of cores
    batch: int = 6  # mutants per attempt
    shares: tuple[float, float, float] = (0.5, 0.3, 0.2)  # easy, medium, hard
    validate: bool = True
    heldout: int = 0  # tasks put in out/heldout (the rest in out/train); 0: all directly in out


@dataclass
class Baseline:
    stable: dict[str, float]  # test id -> seconds, for tests that passed in both runs
    calls: dict[str, list[list[Any]]]  # test id -> [[file, first line, name], ...]
    seconds: float


@dataclass
class Candidate:
    """Edits to try, the test files to run and, of their tests, the ones that call the edited functions."""

    edits: list[mutate.Mutation]
    files: list[str]
    tests: list[str]


@dataclass
class Bug:
    """A kept mutant (one or several edits): what it breaks and what still passes."""

    edits: list[mutate.Mutation]
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    failures: dict[str, dict[str, str]]
    difficulty: str = "easy"
    calling: list[str] = field(default_factory=list)  # the tests that call the edited functions (the ones run)

    @property
    def functions(self) -> list[str]:
        return sorted({f"{e.file}:{e.function}" for e in self.edits})


@dataclass
class Yield:
    """What each stage tried and kept, and how long it took (``swe.json``)."""

    project: str
    version: str
    image: str = ""
    tests: int = 0
    stable_tests: int = 0
    functions_covered: int = 0
    mutations_tried: int = 0
    mutants_kept: int = 0
    combinations_tried: int = 0
    combinations_kept: int = 0
    tasks_written: int = 0
    tasks_validated: int = 0
    by_difficulty: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, list[str]] = field(default_factory=dict)  # task -> failing gates' reasons
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Generator:
    """One run of ``tasks swe`` for one project version (see the module docstring)."""

    def __init__(self, sdist: Sdist, options: SweOptions, out: Path, backend: Backend, cache: Path,
                 log: Callable[[str], None] = print) -> None:
        self.sdist, self.opts, self.out, self.backend, self.cache, self.log = sdist, options, out, backend, cache, log
        self.rng = random.Random(options.seed)
        self.workers = options.workers or os.cpu_count() or 1
        self.report = Yield(sdist.name, sdist.version)
        self.image: ProjectImage | None = None
        self.pytest_args: list[str] = []  # extra pytest options of every run (baseline(): -o addopts= if needed)
        self._scripts = Path(tempfile.mkdtemp(prefix="albatross-swe-"))

    def _timed(self, stage: str, t0: float) -> None:
        self.report.seconds[stage] = round(self.report.seconds.get(stage, 0.0) + time.monotonic() - t0, 1)

    # ---- 1. image ----------------------------------------------------------------------------------
    def build_image(self, make_backend: Callable[[], Backend]) -> ProjectImage:
        from albatross.tasks.swe.image import project_image

        t0 = time.monotonic()
        self.image = project_image(self.sdist, self.opts.python, self.cache / "images", make_backend, self.log)
        self.report.image = self.image.tag
        self.repo = self.image.repo
        self.config_file = project.config_file(self.repo)
        self.pristine_list = project.pristine_files(self.repo)
        self._timed("image", t0)
        return self.image

    @property
    def built(self) -> ProjectImage:
        """The project's image (``build_image`` made it)."""
        if self.image is None:
            raise RuntimeError("build_image() has not run")
        return self.image

    # ---- sandbox runs -------------------------------------------------------------------------------
    def _config_path(self) -> str:
        return f"{REPO}/{self.config_file}" if self.config_file else f"{SCRIPTS}/{project.EMPTY_CONFIG}"

    def run_jobs(self, jobs: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
        """Run ``jobs`` (``runner.py``'s jobs mode) in one fresh attempt of the project image."""
        from albatross.sandbox.base import Limits, SandboxError

        here = Path(__file__).parent
        work = Path(tempfile.mkdtemp(dir=self._scripts))
        try:
            shutil.copyfile(here / "runner.py", work / RUNNER)
            shutil.copyfile(here / "plugin.py", work / PLUGIN)
            (work / project.EMPTY_CONFIG).write_text("[pytest]\n")
            (work / "jobs.json").write_text(json.dumps({"repo": REPO, "config_file": self._config_path(),
                                                        "pytest_args": self.pytest_args, "jobs": jobs}))
            limits = Limits(memory_mb=3072, disk_mb=1024, pids=1024, command_timeout_s=timeout_s + 120,
                            max_output_bytes=1 << 16)
            attempt = self.backend.fork(self.built.env_dir, REPO, limits)
            try:
                attempt.put_dir(work, SCRIPTS)
                run = attempt.exec(f"python3 {SCRIPTS}/{RUNNER} jobs {SCRIPTS}/jobs.json {SCRIPTS}/out.json",
                                   timeout_s + 60)
                raw = attempt.read_file(f"{SCRIPTS}/out.json")
            finally:
                attempt.close()
        except SandboxError as e:
            self.log(f"[swe] a batch of {len(jobs)} runs failed in the sandbox: {e}")
            return []
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if raw is None:
            self.log(f"[swe] a batch of {len(jobs)} runs wrote no results: {run.output[-300:]}")
            return []
        results: list[dict[str, Any]] = json.loads(raw)
        return results

    # ---- 2. baseline --------------------------------------------------------------------------------
    def baseline(self) -> Baseline:
        """The suite twice (the first run traced); when the project's own options stop pytest (a plugin its
        ``addopts`` name is not installed: a usage error), again without them (``-o addopts=``, kept for every run
        of the tasks)."""
        t0 = time.monotonic()
        limit = 1800.0
        jobs = [{"id": "traced", "files": {}, "tests": [], "timeout": limit, "trace": REPO},
                {"id": "plain", "files": {}, "tests": [], "timeout": limit}]
        runs = self.run_jobs(jobs, 2 * limit)
        if runs and runs[0].get("returncode") == 4 and not runs[0].get("tests"):
            self.log("[swe] pytest refuses the project's addopts here; running without them (-o addopts=)")
            self.pytest_args = ["-o", "addopts="]
            runs = self.run_jobs(jobs, 2 * limit)
        if len(runs) != 2 or any(r["status"] != "ok" for r in runs):
            detail = runs[0].get("output", "")[-500:] if runs else "no results"
            raise UserError(f"{self.sdist.name} {self.sdist.version}: its test suite does not run in the image "
                            f"({', '.join(r['status'] for r in runs) or 'no results'}): {detail}")
        traced, plain = runs
        stable = {t: plain.get("durations", {}).get(t, 0.0) for t, o in plain["tests"].items()
                  if o == "passed" and traced["tests"].get(t) == "passed" and project.test_file_of(t)}
        self.report.tests = len(plain["tests"])
        self.report.stable_tests = len(stable)
        if not stable:
            raise UserError(f"{self.sdist.name} {self.sdist.version}: no test passes in the image (is the test "
                            f"suite in the sdist?): {plain.get('output', '')[-400:]}")
        self.log(f"[swe] baseline: {len(stable)} of {len(plain['tests'])} tests pass twice "
                 f"({plain['seconds']:.1f} s a run)")
        self._timed("baseline", t0)
        self.base = Baseline(stable, traced.get("calls", {}), float(plain["seconds"]))
        return self.base

    # ---- 3. single mutants --------------------------------------------------------------------------
    def covered_functions(self) -> dict[tuple[str, mutate.Function], set[str]]:
        """(file, function) -> the stable tests that call it, for library functions whose tests run in time."""
        found: dict[tuple[str, str, int], set[str]] = {}
        for test, calls in self.base.calls.items():
            if test in self.base.stable:
                for file, first, name in calls:
                    found.setdefault((file, name, int(first)), set()).add(test)
        by_file: dict[str, list[mutate.Function]] = {}
        out: dict[tuple[str, mutate.Function], set[str]] = {}
        library = set(project.library_files(self.repo))
        for (file, name, first), tests in sorted(found.items()):
            if file not in library:
                continue
            if file not in by_file:
                by_file[file] = mutate.functions((self.repo / file).read_text(encoding="utf-8", errors="replace"))
            fn = next((f for f in by_file[file] if f.name == name and f.first <= first <= f.lineno), None)
            if fn is not None and self._runnable(tests):
                out[(file, fn)] = tests
        self.report.functions_covered = len(out)
        return out

    def _files_of(self, tests: Iterable[str]) -> list[str]:
        return sorted({f for f in map(project.test_file_of, tests) if f is not None})

    def _runnable(self, tests: set[str]) -> bool:
        files = self._files_of(tests)
        return 0 < len(files) <= self.opts.max_test_files and self._seconds(files) <= self.opts.max_run_seconds

    def _seconds(self, files: list[str]) -> float:
        wanted = set(files)
        return sum(s for t, s in self.base.stable.items() if project.test_file_of(t) in wanted)

    def _timeout(self, files: list[str]) -> float:
        return 30.0 + 10.0 * self._seconds(files)

    def single_candidates(self) -> list[Candidate]:
        """Up to ``per_function`` edits of different kinds per covered function, shuffled, at most
        ``max_mutants``."""
        out = []
        parsed: dict[str, tuple[str, Any]] = {}
        for (file, fn), tests in self.covered_functions().items():
            if file not in parsed:
                source = (self.repo / file).read_text(encoding="utf-8", errors="replace")
                parsed[file] = (source, mutate.parse(source))
            source, tree = parsed[file]
            edits = self._spread(mutate.mutations(source, file, fn, tree), 10 ** 6)  # all, kinds interleaved
            valid = (m for m in edits if mutate.valid(mutate.apply(source, [m])))
            for m in [m for _, m in zip(range(self.opts.per_function), valid, strict=False)]:
                out.append(Candidate([m], self._files_of(tests), sorted(tests)))
        self.rng.shuffle(out)
        return out[: self.opts.max_mutants or 10 * self.opts.count]

    def _spread(self, edits: list[mutate.Mutation], k: int) -> list[mutate.Mutation]:
        """``k`` edits of as many different kinds as there are, chosen at random."""
        by_kind: dict[str, list[mutate.Mutation]] = {}
        for m in edits:
            by_kind.setdefault(m.kind, []).append(m)
        kinds = sorted(by_kind)
        self.rng.shuffle(kinds)
        picked: list[mutate.Mutation] = []
        while len(picked) < k and any(by_kind.values()):
            for kind in kinds:
                if by_kind[kind] and len(picked) < k:
                    picked.append(by_kind[kind].pop(self.rng.randrange(len(by_kind[kind]))))
        return picked

    def evaluate(self, candidates: list[Candidate], enough: int | None = None) -> tuple[list[Bug], int]:
        """Run candidates in order, in batches on ``workers`` attempts, until ``enough`` are kept (None: all of
        them); returns the kept bugs in candidate order and how many candidates ran."""
        batches = [candidates[i:i + self.opts.batch] for i in range(0, len(candidates), self.opts.batch)]
        kept: list[Bug] = []
        lock = threading.Lock()
        ran = [0, 0]  # batches, candidates

        def one(batch: list[Candidate]) -> None:
            jobs: list[dict[str, Any]] = [{"id": str(i), "files": self._files(c.edits), "tests": c.files,
                                           "only": c.tests, "timeout": self._timeout(c.files)}
                                          for i, c in enumerate(batch)]
            results = self.run_jobs(jobs, sum(j["timeout"] for j in jobs))
            bugs = [self._judge(batch[int(r["id"])], r) for r in results]
            with lock:
                kept.extend(b for b in bugs if b is not None)
                ran[0], ran[1] = ran[0] + 1, ran[1] + len(batch)
                if ran[0] % 10 == 0:
                    self.log(f"[swe] ran {ran[1]} of {len(candidates)}, kept {len(kept)}")

        run_until(self.workers, batches, one, lambda: enough is not None and len(kept) >= enough)
        order = {id(c.edits[0]): i for i, c in enumerate(candidates)}
        return sorted(kept, key=lambda b: order.get(id(b.edits[0]), 0)), ran[1]

    def _files(self, edits: list[mutate.Mutation]) -> dict[str, str]:
        out = {}
        for file in sorted({e.file for e in edits}):
            source = (self.repo / file).read_text(encoding="utf-8", errors="replace")
            out[file] = mutate.apply(source, [e for e in edits if e.file == file])
        return out

    def _judge(self, candidate: Candidate, result: dict[str, Any]) -> Bug | None:
        """The bug a candidate's run shows, or None. The tests it did not run do not call the edited code, so
        they pass as in the baseline, unless their test file failed to collect (an import broken at load time):
        then they count as failing."""
        if result.get("status") != "ok":
            return None
        wanted = set(candidate.files)
        stable = [t for t in self.base.stable if project.test_file_of(t) in wanted]
        outcomes = result.get("tests", {})
        run = set(candidate.tests)
        uncollected = {t.removesuffix("::collect") for t in outcomes if t.endswith("::collect")}
        outcome = {t: outcomes.get(t) if t in run else "failed" if project.test_file_of(t) in uncollected else "passed"
                   for t in stable}
        failing = sorted(t for t in stable if outcome[t] != "passed")
        if not 1 <= len(failing) <= self.opts.max_fail_to_pass:
            return None
        broken_files = set(self._files_of(failing))
        passing = sorted(t for t in stable if outcome[t] == "passed" and project.test_file_of(t) in broken_files)
        if not passing:
            return None
        failures = {t: result.get("failures", {}).get(t, {}) for t in failing}
        # the candidate's own edits list: combinations are found by it
        return Bug(candidate.edits, failing, passing, failures, calling=candidate.tests)

    # ---- 4. combinations ----------------------------------------------------------------------------
    def combinations(self, singles: list[Bug], medium: int, hard: int) -> list[Candidate]:
        """Candidates of two edits in one function (``medium``) and of edits in two or three functions (``hard``)."""
        by_fn: dict[str, list[Bug]] = {}
        for bug in singles:
            by_fn.setdefault(bug.functions[0], []).append(bug)
        out: list[Candidate] = []
        same = [bugs for bugs in by_fn.values() if len(bugs) >= 2]
        for _ in range(medium * 3):
            if not same or len([c for c in out if len({e.function for e in c.edits}) == 1]) >= medium:
                break
            a, b = self.rng.sample(self.rng.choice(same), 2)
            self._add_combo(out, [a, b])
        fns = list(by_fn)
        for _ in range(hard * 3):
            if len(fns) < 2 or len(out) >= medium + hard:
                break
            picked = self.rng.sample(fns, min(len(fns), self.rng.choice((2, 2, 3))))
            self._add_combo(out, [self.rng.choice(by_fn[f]) for f in picked])
        return out

    def _add_combo(self, out: list[Candidate], bugs: list[Bug]) -> None:
        edits = [e for b in bugs for e in b.edits]
        spans = sorted((e.file, e.start, e.end) for e in edits)
        if any(a[0] == b[0] and b[1] < a[2] + 2 for a, b in zip(spans, spans[1:], strict=False)):
            return  # overlapping (or touching) edits
        if any(set(map(id, edits)) == set(map(id, c.edits)) for c in out):
            return
        out.append(Candidate(edits, self._files_of(t for b in bugs for t in b.fail_to_pass + b.pass_to_pass),
                             sorted({t for b in bugs for t in b.calling})))
        self._parts[id(edits)] = bugs

    def judge_combination(self, bug: Bug) -> Bug | None:
        """Keep a combination only when each part still fails a test of its own."""
        parts = self._parts.get(id(bug.edits), [])
        if not parts or any(not set(p.fail_to_pass) & set(bug.fail_to_pass) for p in parts):
            return None
        one_function = len({e.function for e in bug.edits}) == 1
        bug.difficulty = "medium" if one_function else "hard"
        return bug

    # ---- 5. tasks -----------------------------------------------------------------------------------
    def bugs(self) -> list[Bug]:
        """Every kept bug, in the order tasks are made: difficulties interleaved in the ``shares`` proportions."""
        t0 = time.monotonic()
        singles_in = self.single_candidates()
        self.log(f"[swe] {self.report.functions_covered} functions covered; {len(singles_in)} mutations to try")
        singles, self.report.mutations_tried = self.evaluate(singles_in, enough=math.ceil(1.6 * self.opts.count) + 4)
        for bug in singles:
            bug.difficulty = "medium" if bug.edits[0].multiline else "easy"
        self.report.mutants_kept = len(singles)
        self._timed("mutants", t0)
        t0 = time.monotonic()
        self._parts: dict[int, list[Bug]] = {}
        want = {d: int(round(s * self.opts.count * 1.3)) + 1 for d, s in zip(DIFFICULTIES, self.opts.shares, strict=True)}
        combos_in = self.combinations(singles, want["medium"], want["hard"])
        ran, self.report.combinations_tried = self.evaluate(combos_in)
        combos = [b for b in (self.judge_combination(b) for b in ran) if b is not None]
        self.report.combinations_kept = len(combos)
        self._timed("combinations", t0)
        self.log(f"[swe] kept {len(singles)} of {self.report.mutations_tried} mutations tried and {len(combos)} of "
                 f"{len(combos_in)} combinations")
        return _interleave(singles + combos, self.opts.shares)

    def task_of(self, bug: Bug, pristine: bytes) -> RepoTask:
        files = self._files(bug.edits)
        originals = {f: (self.repo / f).read_text(encoding="utf-8", errors="replace") for f in files}
        patch = unified_patch({f: (files[f], originals[f]) for f in files})
        test_files = self._files_of(bug.fail_to_pass)
        name, version = self.sdist.name, self.sdist.version
        task_id = project.safe_id(f"{name}-{version}-{_short_hash(patch)}")
        instruction = issue_text(name, version, REPO, bug.fail_to_pass, bug.failures, self._hidden(bug, patch),
                                 sorted({e.function.rsplit(".", 1)[-1] for e in bug.edits}))
        dockerfile = (f"FROM {self.built.tag}\nCOPY files/ {REPO}/\nRUN {git_commit_script(f'{name} {version}')}\n"
                      f"WORKDIR {REPO}\n")
        metadata = {"category": "swe", "family": f"swe-{name}", "source": f"swe/{name}", "project": name,
                    "project_version": version, "difficulty": bug.difficulty, "image": self.built.tag,
                    "mutations": [e.kind for e in bug.edits], "functions": len(bug.functions),
                    "fail_to_pass": len(bug.fail_to_pass), "pass_to_pass": len(bug.pass_to_pass),
                    "generator": "albatross tasks swe"}
        return RepoTask(task_id, instruction, dockerfile, {f"files/{f}": t for f, t in files.items()}, patch,
                        bug.fail_to_pass, bug.pass_to_pass, test_files, pristine,
                        self.config_file,
                        max(120.0, 60.0 + 10.0 * self._seconds(test_files)), metadata, pytest_args=self.pytest_args)

    def _hidden(self, bug: Bug, patch: str) -> list[str]:
        files = sorted({e.file for e in bug.edits})
        changed = [ln[1:].strip() for ln in patch.splitlines()
                   if ln[:1] in "+-" and not ln.startswith(("+++", "---")) and len(ln[1:].strip()) >= 6]
        private = [e.function.rsplit(".", 1)[-1] for e in bug.edits if e.function.rsplit(".", 1)[-1].startswith("_")]
        return [*files, *(Path(f).name for f in files), *(project.module_name(f) for f in files), *changed, *private]


def _short_hash(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _interleave(bugs: list[Bug], shares: tuple[float, float, float]) -> list[Bug]:
    """Bugs ordered so that any prefix holds the difficulties about in the ``shares`` proportions (smooth
    weighted round robin over the difficulties; a difficulty that runs out leaves its turns to the others)."""
    queues = {d: [b for b in bugs if b.difficulty == d] for d in DIFFICULTIES}
    weights = dict(zip(DIFFICULTIES, shares, strict=True))
    credit = dict.fromkeys(DIFFICULTIES, 0.0)
    out: list[Bug] = []
    while any(queues.values()):
        live = [d for d in DIFFICULTIES if queues[d] and weights[d] > 0] or [d for d in DIFFICULTIES if queues[d]]
        total = sum(weights[d] for d in live) or 1.0
        for d in live:
            credit[d] += weights[d] or 1.0
        pick = max(live, key=lambda d: credit[d])
        credit[pick] -= total
        out.append(queues[pick].pop(0))
    return out


# ---- the command ---------------------------------------------------------------------------------------


def make_swe_tasks(sdist: Sdist, options: SweOptions, out: Path, cache: Path, make_backend: Callable[[], Backend],
                   log: Callable[[str], None] = print) -> Yield:
    """Make ``options.count`` tasks of ``sdist``'s project in ``out`` (see the module docstring); returns the
    yield, also written to ``out/swe-<name>-<version>.json``."""
    t_all = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    backend = make_backend()
    gen = Generator(sdist, options, out, backend, cache, log)
    try:
        gen.build_image(make_backend)
        gen.baseline()
        bugs = gen.bugs()
        t0 = time.monotonic()
        made = _write_tasks(gen, bugs, out, backend)
        gen._timed("tasks", t0)
    finally:
        backend.close()
        shutil.rmtree(gen._scripts, ignore_errors=True)
    if options.heldout:
        _split(made, out, options.heldout, gen.rng)
    gen.report.by_difficulty = _count_difficulties(made)
    gen.report.seconds["total"] = round(time.monotonic() - t_all, 1)
    path = out / f"swe-{sdist.name}-{project.safe_id(sdist.version)}.json"
    path.write_text(json.dumps(gen.report.to_dict(), indent=1) + "\n")
    return gen.report


def _write_tasks(gen: Generator, bugs: list[Bug], out: Path, backend: Backend) -> list[tuple[Path, str]]:
    """Write tasks in order and (``validate``) gate them as they come, ``workers`` at a time, until ``count``
    pass; returns (task directory, difficulty) of the kept ones."""
    from albatross.tasks.gates import GateOptions, gate_task

    pristine = project.pristine_tar(gen.repo, gen.pristine_list)
    shared = gen.cache / "images" / gen.built.key / "pristine.tar"  # every task's tests/pristine.tar links to it
    shared.write_bytes(pristine)
    kept: list[tuple[Path, str, int]] = []
    lock = threading.Lock()
    report = gen.report

    def one(index: int, bug: Bug) -> None:
        task = gen.task_of(bug, pristine)
        if (out / task.task_id).exists():
            return
        path = write_repo_task(out, task)
        link_or_copy(shared, path / "tests" / "pristine.tar")
        with lock:
            report.tasks_written += 1
        if gen.opts.validate:
            result = gate_task(path, backend, GateOptions(reruns=3, parallelism=1))
            if not result.passed:
                reasons = [f"{g}: {r.reason}" for g, r in result.gates.items() if r.status == "fail"]
                with lock:
                    report.rejected[task.task_id] = reasons
                shutil.rmtree(path, ignore_errors=True)
                return
        with lock:
            kept.append((path, bug.difficulty, index))
            report.tasks_validated += gen.opts.validate
        gen.log(f"[swe] {task.task_id} ({bug.difficulty}): {'passed the nine gates' if gen.opts.validate else 'written'}"
                f" ({len(kept)} of {gen.opts.count} wanted)")

    run_until(gen.workers, list(enumerate(bugs)), lambda item: one(*item), lambda: len(kept) >= gen.opts.count)
    kept.sort(key=lambda k: k[2])
    for path, _difficulty, _index in kept[gen.opts.count:]:  # passed while the last ones were in flight
        shutil.rmtree(path, ignore_errors=True)
    report.tasks_validated = min(report.tasks_validated, gen.opts.count)
    return [(p, d) for p, d, _ in kept[: gen.opts.count]]


def run_until(workers: int, items: Sequence[T], fn: Callable[[T], None], enough: Callable[[], bool]) -> None:
    """``fn(item)`` for the items in order, ``workers`` at a time, starting no new one once ``enough()``."""
    todo = iter(items)
    with ThreadPoolExecutor(workers, thread_name_prefix="swe") as pool:
        running: set[Future[None]] = set()
        while True:
            while len(running) < workers and not enough():
                item = next(todo, None)
                if item is None:
                    break
                running.add(pool.submit(fn, item))
            if not running:
                break
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                f.result()


def _split(made: list[tuple[Path, str]], out: Path, heldout: int, rng: random.Random) -> None:
    """Move ``heldout`` tasks (chosen at random) to ``out/heldout`` and the rest to ``out/train``."""
    chosen = set(rng.sample(range(len(made)), min(heldout, len(made))))
    for i, (path, difficulty) in enumerate(made):
        dest = out / ("heldout" if i in chosen else "train") / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        path.rename(dest)
        made[i] = (dest, difficulty)


def _count_difficulties(made: list[tuple[Path, str]]) -> dict[str, int]:
    return {d: sum(1 for _p, x in made if x == d) for d in DIFFICULTIES}


def format_yield(y: Yield) -> str:
    """The yield as a few lines: what each stage tried and kept, and the seconds it took."""
    s = y.seconds
    lines = [f"{y.project} {y.version} ({y.image})",
             f"  tests: {y.stable_tests} of {y.tests} pass twice; {y.functions_covered} library functions covered",
             f"  mutations: {y.mutants_kept} of {y.mutations_tried} kept; combinations: {y.combinations_kept} of "
             f"{y.combinations_tried} kept",
             f"  tasks: {y.tasks_written} written, {y.tasks_validated} passed the nine gates, {len(y.rejected)} "
             f"rejected; by difficulty: " + ", ".join(f"{d} {n}" for d, n in y.by_difficulty.items()),
             "  seconds: " + ", ".join(f"{k} {v:g}" for k, v in s.items())]
    return "\n".join(lines)
