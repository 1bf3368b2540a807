"""`albatross tasks validate | probe | filter | swe | import`: the gates, the probe, the difficulty filter, repository
tasks made from a project's sdist and SWE-bench instances imported.

Registered by ``albatross.cli`` (``register(sub, tasks_sub)``); nothing heavy is imported at module level.
Exit codes: 0 success, 1 some task failed a gate, 2 a user error (one line naming the file and field).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:  # annotations only: these imports are heavy
    from albatross.config import SandboxConfig
    from albatross.sandbox.base import Backend
    from albatross.tasks.format import Task
    from albatross.tasks.gates import TaskReport

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # where commands are added

EXIT_FAILED, EXIT_USER_ERROR = 1, 2
SANDBOXES = ("auto", "local", "process", "docker")
NETWORK_POLICIES = ("none", "registries", "open")  # sandbox.base.NETWORK_POLICIES (not imported: it is heavy)
OVERRIDES_HELP = ("per-task overrides of task.toml values, each with its reason: a TOML file, or a set albatross "
                  "ships (terminal-bench-2: the tasks whose tests check what the agent installed in system "
                  "paths run the verifier in the attempt's toolchain); docs/tasks.md")
NETWORK_HELP = ("network policy of builds' and attempts' egress: none (attempts have no network; builds reach the "
                "package registries), registries (attempts too reach the registries, through albatross's egress "
                "proxy), open (any host but the host's own services); a task may narrow it (default: %s)")


def register(sub: Subparsers, tasks_sub: Subparsers) -> None:
    _add_validate(tasks_sub)
    _add_probe(tasks_sub)
    _add_filter(tasks_sub)
    _add_swe(tasks_sub)
    _add_import(tasks_sub)


def _add_validate(tasks_sub: Subparsers) -> None:
    p = tasks_sub.add_parser("validate", help="run the nine validation gates on task directories")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="task directories, or folders of them")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON: every task's gates, a summary of "
                   "failures per gate and per reason category, and partial-credit test weights")
    p.add_argument("--parallel", type=int, default=0, metavar="N",
                   help="tasks gated at once (default: the number of cores)")
    p.add_argument("--reruns", type=int, default=3, metavar="N",
                   help="runs of the oracle and of the no-op for the determinism gate (default: 3)")
    p.add_argument("--network", choices=NETWORK_POLICIES, help=NETWORK_HELP % "the config's sandbox.network")
    p.add_argument("--config", metavar="TOML", help="the run's config: its sandbox.memory_mb, disk_mb and cpus "
                   "are the ceiling of every task's own limits, as in that run (without --config or --set: "
                   "each task's own limits)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (e.g. "
                   "sandbox.memory_mb=8192); implies the run's ceiling, as --config")
    p.add_argument("--overrides", dest="task_overrides", metavar="FILE|NAME", help=OVERRIDES_HELP)
    p.add_argument("--build-timeout-scale", type=float, default=1.0, metavar="X", help="give each build X times "
                   "its build_timeout_sec (a slow or shared machine builds slower than the task's author's; "
                   "default 1)")
    p.add_argument("--resume", metavar="REPORT", help="continue an interrupted run from its --json report "
                   "(written after every task): keep the tasks it reports, gate only the others, and update it")
    p.add_argument("--redo-failed", action="store_true", help="with --resume: gate again the tasks it "
                   "reports as failed")
    p.set_defaults(fn=cmd_validate)


def _add_probe(tasks_sub: Subparsers) -> None:
    p = tasks_sub.add_parser("probe", help="probe tasks (>= 4 attempts each) under the training configuration")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="task directories, or folders of them")
    p.add_argument("--model", required=True, metavar="DIR", help="the base model: a local transformers "
                   "checkpoint directory")
    p.add_argument("--tokenizer", metavar="DIR", help="directory of albatross_tokenizer.json (default: --model)")
    p.add_argument("--attempts", type=int, metavar="N", help="attempts per task, at least 4 (default: the "
                   "training group size, orchestrator.group_size)")
    p.add_argument("--config", metavar="TOML", help="the training run's config (default: built-in defaults)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--gates", metavar="PATH", help="a `tasks validate --json` report: its no-op test "
                   "weights give partial credit as in training")
    p.add_argument("--json", metavar="PATH", help="write the pass-rate table as JSON")
    p.add_argument("--sandbox", choices=SANDBOXES, help="sandbox backend (default: the config's sandbox.type)")
    p.add_argument("--network", choices=NETWORK_POLICIES, help=NETWORK_HELP % "the config's sandbox.network")
    p.add_argument("--overrides", dest="task_overrides", metavar="FILE|NAME", help=OVERRIDES_HELP)
    p.set_defaults(fn=cmd_probe)


def _add_filter(tasks_sub: Subparsers) -> None:
    p = tasks_sub.add_parser("filter", help="keep probed tasks whose pass rate lies in a band")
    p.add_argument("probe_json", metavar="PROBE_JSON", help="the table written by `tasks probe --json`")
    p.add_argument("--low", type=float, default=0.15, help="lowest pass rate kept (default: 0.15)")
    p.add_argument("--high", type=float, default=0.85, help="highest pass rate kept (default: 0.85)")
    p.add_argument("--group-size", type=int, metavar="G", help="training group size for the expected "
                   "zero-signal fraction (default: the probe's, else 8)")
    p.add_argument("--out", metavar="PATH", help="write the kept task directories, one per line")
    p.add_argument("--json", metavar="PATH", help="write the kept / dropped lists and fractions as JSON")
    p.set_defaults(fn=cmd_filter)


def _add_swe(tasks_sub: Subparsers) -> None:
    p = tasks_sub.add_parser("swe", help="make bug-fix tasks from a Python project's source distribution")
    p.add_argument("--package", required=True, metavar="NAME[==VERSION]", help="the project on the package index "
                   "(no version: its newest release with an sdist); its sdist must hold its test suite")
    p.add_argument("--count", type=int, default=100, metavar="N", help="tasks to make (that pass the nine gates, "
                   "unless --no-validate) (default: 100)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the task directories go")
    p.add_argument("--sdist", metavar="PATH", help="a local sdist archive or source directory instead of the index")
    p.add_argument("--python", default="3.11", metavar="VER", help="the image's Python (default: 3.11)")
    p.add_argument("--seed", type=int, default=0, help="seed of the choice of mutations (default: 0)")
    p.add_argument("--heldout", type=int, default=0, metavar="M", help="put M tasks in DIR/heldout and the rest in "
                   "DIR/train (default: 0, every task directly in DIR)")
    p.add_argument("--max-mutants", type=int, default=0, metavar="N", help="single mutations tried at most "
                   "(default: 10 x --count)")
    p.add_argument("--workers", type=int, default=0, metavar="N", help="attempts run at once (default: cores)")
    p.add_argument("--no-validate", action="store_true", help="write tasks without running the nine gates")
    p.set_defaults(fn=cmd_swe)


def _add_import(tasks_sub: Subparsers) -> None:
    p = tasks_sub.add_parser("import", help="turn SWE-bench instances into task directories")
    p.add_argument("format", choices=["swebench"], help="the instance format")
    p.add_argument("file", metavar="FILE.jsonl", help="one instance per line (repo, instance_id, base_commit, patch, "
                   "test_patch, problem_statement, FAIL_TO_PASS, PASS_TO_PASS, ...)")
    p.add_argument("--repos", required=True, metavar="DIR", help="local clones: DIR/<owner>__<name>, "
                   "DIR/<owner>/<name> or DIR/<name>")
    p.add_argument("--out", required=True, metavar="DIR", help="where the task directories go")
    p.add_argument("--python", default="3.11", metavar="VER", help="the Python of an instance that names none "
                   "(default: 3.11)")
    p.add_argument("--validate", action="store_true", help="run the nine gates on the imported tasks")
    p.set_defaults(fn=cmd_import)


# ------------------------------------------------------------------------------------------ commands


def cmd_swe(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.cache import cache_root
    from albatross.config import default
    from albatross.sandbox import local_available
    from albatross.tasks.swe.generate import SweOptions, format_yield, make_swe_tasks
    from albatross.tasks.swe.sdist import fetch_sdist, local_sdist

    if args.count < 1 or args.heldout < 0 or args.heldout >= max(args.count, 1) and args.heldout:
        return _user_error("--count must be at least 1 and --heldout below --count")
    if not local_available():
        return _user_error("tasks swe runs the project's tests in the isolated local sandbox (root, cgroup v1 "
                           "memory and pids, namespaces, overlayfs), which this machine lacks")
    cache = cache_root() / "swe"
    sdist = local_sdist(Path(args.sdist), args.package) if args.sdist else fetch_sdist(args.package, cache / "sdists")
    options = SweOptions(count=args.count, seed=args.seed, python=args.python, heldout=args.heldout,
                         max_mutants=args.max_mutants, workers=args.workers, validate=not args.no_validate)
    registries = default("sandbox", "registries")  # the image build installs the project from them
    report = make_swe_tasks(sdist, options, Path(args.out), cache, lambda: _backend("local", [args.out], registries),
                            log=lambda m: print(m, flush=True))
    print(format_yield(report), flush=True)
    return 0 if (report.tasks_validated if options.validate else report.tasks_written) >= args.count else EXIT_FAILED


def cmd_import(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.tasks.swe.swebench import import_instances

    paths = import_instances(Path(args.file), Path(args.repos), Path(args.out), python=args.python,
                             log=lambda m: print(m, flush=True))
    print(f"imported {len(paths)} instances into {args.out}", flush=True)
    if not args.validate:
        return 0
    from albatross.config import default
    from albatross.tasks.gates import GateOptions, format_table, validate

    backend = _backend("local", [args.out], default("sandbox", "registries"))
    try:
        reports = validate(paths, backend, GateOptions())
    finally:
        backend.close()
    print(format_table(reports), flush=True)
    return 0 if all(r.passed for r in reports) else EXIT_FAILED




def cmd_validate(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.cli.signals import sigterm_interrupts
    from albatross.config import load_config
    from albatross.sandbox.base import Limits
    from albatross.tasks.format import find_task_dirs
    from albatross.tasks.gates import GateOptions, first_failure, format_table, validate
    from albatross.tasks.overrides import load_overrides

    if args.reruns < 2 or args.parallel < 0:
        return _user_error("--reruns must be at least 2 and --parallel at least 0")
    if args.redo_failed and not args.resume:
        return _user_error("--redo-failed needs --resume REPORT (the report whose failed tasks to gate again)")
    if args.resume:
        if args.json and Path(args.json).resolve() != Path(args.resume).resolve():
            return _user_error(f"--resume {args.resume} updates that report: leave out --json, or give the same path")
        args.json = args.resume
    cfg = load_config(args.config, [_normalise(o) for o in args.set or []])
    dirs = find_task_dirs(args.dirs)
    from albatross.sandbox import local_available

    if not local_available():  # leakage and offline cannot be judged without isolation
        from albatross.sandbox.local import unavailable_reason

        return _user_error("the gates need the isolated local sandbox (root, the memory and pids cgroup "
                           f"controllers, namespaces, overlayfs), which this machine lacks: {unavailable_reason()}")
    network = args.network or cfg.sandbox.network
    ceiling = Limits.from_config(cfg.sandbox) if args.config or args.set else None
    if not (0 < args.build_timeout_scale <= 100):
        return _user_error("--build-timeout-scale must be above 0 and at most 100")
    options = GateOptions(reruns=args.reruns, parallelism=args.parallel, network=network, ceiling=ceiling,
                          overrides=load_overrides(args.task_overrides), build_timeout_scale=args.build_timeout_scale)
    record = {"network": network, "reruns": args.reruns, "overrides": args.task_overrides or "",
              "build_timeout_scale": args.build_timeout_scale,
              "ceiling": None if ceiling is None else {"memory_mb": ceiling.memory_mb, "disk_mb": ceiling.disk_mb,
                                                       "cpus": ceiling.cpus}}
    done = _resumed(args, record, [str(d) for d in dirs]) if args.resume else {}
    todo = [d for d in dirs if str(d) not in done]
    if done:
        print(f"[gates] resuming {args.json}: {len(done)} tasks already gated, {len(todo)} to go", flush=True)
    workers = max(1, min(args.parallel or os.cpu_count() or 1, len(todo) or 1))
    print(f"[gates] {len(todo)} tasks to gate, {workers} at a time, network {network}", flush=True)
    finished = dict(done)
    start = time.monotonic()

    def progress(report: TaskReport) -> None:
        gated = len(finished) - len(done) + 1
        failed = first_failure(report)
        print(f"[gates] {gated}/{len(todo)} {report.task}: "
              f"{'passed' if failed is None else 'FAILED ' + failed[0] + ': ' + failed[1][:160]} "
              f"({report.seconds:.1f} s; {(time.monotonic() - start) / 60:.1f} min elapsed)", flush=True)
        finished[report.path] = report
        if args.json:  # a checkpoint after every task: --resume REPORT picks up from here
            _write_report(args.json, [finished[str(d)] for d in dirs if str(d) in finished], record)

    backend = _backend("local", [], cfg.sandbox.registries, cfg.sandbox)
    try:
        with sigterm_interrupts():
            validate(todo, backend, options, progress=progress)
    except KeyboardInterrupt:
        where = f"; `--resume {args.json}` gates the other {len(dirs) - len(finished)}" if args.json else ""
        print(f"\n[gates] interrupted: {len(finished)} of {len(dirs)} tasks gated{where}", file=sys.stderr,
              flush=True)
        raise
    finally:
        backend.close()
    reports = [finished[str(d)] for d in dirs]
    print(format_table(reports), flush=True)
    if args.json:
        _write_report(args.json, reports, record)
    return 0 if all(r.passed for r in reports) else EXIT_FAILED


def _resumed(args: argparse.Namespace, record: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """The reports an earlier run with the same options wrote to ``args.json`` (path -> report), less the
    failed ones with ``--redo-failed``; {} when there is no such file."""
    from albatross.errors import UserError
    from albatross.tasks.gates import TaskReport

    path = Path(args.json)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        reports = [TaskReport.from_dict(t) for t in data["tasks"]]
        options = data.get("options", {})
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{path}: not a `tasks validate --json` report ({type(e).__name__}: {e})") from None
    if options != record:
        raise UserError(f"{path}: written with other options ({options}); rerun with the same ones, or write "
                        "to another --json")
    return {r.path: r for r in reports if r.path in paths and (r.passed or not args.redo_failed)}


def _write_report(path: str, reports: list[TaskReport], record: dict[str, Any]) -> None:
    from albatross.tasks.gates import reports_json

    data = {**reports_json(reports), "options": record}
    tmp = Path(f"{path}.tmp")
    _write_json(str(tmp), data)
    tmp.replace(path)


def cmd_probe(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.config import load_config
    from albatross.pipeline.probe import model_agent, probe
    from albatross.tasks.probe import MIN_ATTEMPTS, format_table, write_json

    cfg = load_config(args.config, [_normalise(o) for o in args.set or []])
    if args.network:
        cfg.sandbox.network = args.network
    if (args.sandbox or cfg.sandbox.type) == "docker" and cfg.sandbox.network != "none":
        return _user_error(f"--network {cfg.sandbox.network}: the docker sandbox runs attempts with no network "
                           "(the local sandbox enforces the registries and open policies)")
    attempts = args.attempts or cfg.orchestrator.group_size
    if attempts < MIN_ATTEMPTS:
        return _user_error(f"--attempts must be at least {MIN_ATTEMPTS}, got {attempts}")
    tasks = _buildable_tasks(args.dirs, args.task_overrides)
    if not tasks:
        return _user_error(f"no task in {' '.join(args.dirs)} can be built here (each skipped above)")
    try:
        weights = _weights(args.gates)
    except ValueError as e:
        return _user_error(f"{args.gates}: not a `tasks validate --json` report ({e})")
    backend = _backend(args.sandbox or cfg.sandbox.type, [*args.dirs, args.model], cfg.sandbox.registries,
                       cfg.sandbox)
    engine = None
    engine_dir = Path(tempfile.mkdtemp(prefix="albatross-probe-engine-"))  # server logs, an untied model copy
    try:
        agent, engine = model_agent(cfg, backend, Path(args.model), Path(args.tokenizer or args.model), engine_dir)
        from albatross.rl.scoring import GroupScorer

        rows = probe(agent, tasks, attempts, GroupScorer(cfg.rl, weights), retries=cfg.sandbox.max_infra_retries,
                     workers=cfg.orchestrator.rollout_workers,
                     progress=lambda r: print(f"[probe] {r.task}: {r.successes}/{r.attempts}", flush=True))
    finally:
        if engine is not None:
            engine.close()
        backend.close()
    shutil.rmtree(engine_dir, ignore_errors=True)  # kept when the probe failed: its logs say why
    print(format_table(rows), flush=True)
    if args.json:
        config = {"model": str(Path(args.model).resolve()), "attempts": attempts,
                  "group_size": cfg.orchestrator.group_size, "config": args.config, "overrides": args.set or []}
        write_json(args.json, rows, config)
    return 0


def cmd_filter(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.tasks.filter import filter_rows, format_report
    from albatross.tasks.probe import read_json

    try:
        rows, config = read_json(args.probe_json)
        group_size = args.group_size or int(config.get("group_size") or 8)
        result = filter_rows(rows, args.low, args.high, group_size)
    except ValueError as e:
        return _user_error(str(e))
    print(format_report(result), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("".join(f"{r.path}\n" for r in result.kept))
    if args.json:
        _write_json(args.json, result.to_dict())
    return 0


# ------------------------------------------------------------------------------------------- helpers


def _buildable_tasks(paths: list[str], overrides: str | None = None) -> list[Task]:
    """The tasks under ``paths`` whose Dockerfile the sandbox can build (with ``overrides`` applied); each
    other one is reported on stderr and skipped (the build gate's check), so one bad task does not stop the
    others."""
    from albatross.tasks.buildable import dockerfile_problem
    from albatross.tasks.format import load_tasks
    from albatross.tasks.overrides import apply_overrides, load_overrides

    changes = load_overrides(overrides)
    tasks: list[Task] = []
    dirs: list[str | Path] = [*paths]
    for task in (apply_overrides(t, changes) for t in load_tasks(dirs)):
        problem = dockerfile_problem(task)
        if problem:
            print(f"albatross: skipping task {task.path}: {problem.splitlines()[0]}", file=sys.stderr)
        else:
            tasks.append(task)
    return tasks


def _backend(kind: str, hide: list[str], registries: list[str], sc: SandboxConfig | None = None) -> Backend:
    """The sandbox for a command (``sc``: the config's ``[sandbox]``, its defaults when None)."""
    from albatross.cache import cache_root
    from albatross.config import SandboxConfig
    from albatross.sandbox import local_available, make_backend

    sc = sc or SandboxConfig()

    if kind == "auto":
        kind = "local" if local_available() else "process"
    if kind in ("process", "docker"):  # docker: a container sees nothing of the host to hide
        return make_backend(kind)
    return make_backend("local", hide_paths=[str(p) for p in [*hide, cache_root()]], registries=registries,
                        layer_cache=sc.layer_cache, build_min_free_mb=sc.build_min_free_mb)


def _weights(path: str | None) -> dict[str, dict[str, float]]:
    if not path:
        return {}
    from albatross.tasks.gates import load_test_weights

    try:
        return load_test_weights(path)
    except (AttributeError, TypeError) as e:
        raise ValueError(str(e)) from None


def _normalise(override: str) -> str:
    key, sep, value = override.partition("=")
    return key.replace("-", "_") + sep + value


def _write_json(path: str, data: dict[str, Any]) -> None:
    from albatross.errors import UserError

    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except (FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        raise UserError(f"{path}: cannot write the JSON there: {e.strerror}") from None


def _user_error(message: str) -> int:
    print(f"albatross: error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR
