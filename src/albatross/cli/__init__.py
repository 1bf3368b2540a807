"""`albatross` command line. Heavy imports happen inside commands, so `--help` is instant.

User errors (bad config, bad task directory, missing file) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from albatross.errors import UserError  # the one user-error type: printed as one line, exit code 2

EXIT_USER_ERROR = 2
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # where commands are added


def _overrides(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """Overrides of any config field: ``--set a.b=v``, the ``--a.b v`` / ``--a.b=v`` flags taken out of the
    command line before parsing (``split_overrides``), ``--backend`` / ``--out``, and any left ``--name v``
    (top-level fields such as ``--seed 3``)."""
    # argparse: a command without --backend / --out has no such attribute
    out = list(args.set or []) + list(getattr(args, "overrides", []))
    if getattr(args, "backend", None):
        out.append(f"orchestrator.backend={args.backend}")
    if getattr(args, "out", None):
        out.append(f"out={json.dumps(args.out)}")
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or len(tok) == 2:
            raise UserError(f"unexpected argument {tok!r}")
        key = tok[2:]
        if "=" in key:
            out.append(key)
        elif i + 1 < len(extra):
            out.append(f"{key}={extra[i + 1]}")
            i += 1
        else:
            raise UserError(f"override {tok} needs a value, e.g. {tok} VALUE")
        i += 1
    return [_normalise_key(o) for o in out]


def _normalise_key(override: str) -> str:
    key, sep, value = override.partition("=")
    return key.replace("-", "_") + sep + value


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Take every ``--a.b VALUE`` / ``--a.b=VALUE`` (a dotted name: a config field) out of ``argv``, wherever it
    stands (before or after the config path); return (the other arguments, the ``a.b=VALUE`` overrides).
    Everything after ``--`` is left alone (``sandbox run TASK -- CMD``)."""
    rest: list[str] = []
    found: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            rest += argv[i:]
            break
        name = tok[2:].split("=", 1)[0]
        if tok.startswith("--") and "." in name and not name.startswith("."):
            if "=" in tok:
                found.append(tok[2:])
            elif i + 1 < len(argv):
                found.append(f"{name}={argv[i + 1]}")
                i += 1
            else:
                raise UserError(f"override {tok} needs a value, e.g. {tok} VALUE")
        else:
            rest.append(tok)
        i += 1
    return rest, found


def cmd_demo(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.pipeline.demo import demo_config
    from albatross.pipeline.driver import Pipeline
    from albatross.pipeline.summary import format_table

    cfg = demo_config(args.config, args.quick, None, _overrides(args, extra))
    pipeline = Pipeline(cfg, log=_log, command="demo --quick" if args.quick else "demo", overwrite=args.overwrite)
    summary = pipeline.run()
    print(format_table(summary, pipeline.title), flush=True)
    if args.quick:
        print("\nalbatross demo --quick is a smoke test: a few steps on a few tasks, so the difference above is "
              "mostly noise; the full demo (`albatross demo`) measures learning.", flush=True)
    print(f"\nwritten: {pipeline.out / 'summary.json'} and {pipeline.out / 'report.html'}", flush=True)
    return 0


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    """A training run of a config file, for any model; `--resume DIR` continues one."""
    from albatross.config import load_config
    from albatross.pipeline.driver import Pipeline
    from albatross.pipeline.summary import format_table

    if args.resume:
        if args.config or extra or args.set or args.backend or args.overrides or args.out or args.overwrite:
            raise UserError("--resume takes the run directory only; its config.json is reused")
        pipeline = Pipeline.resumed(args.resume, log=_log)
    elif args.config:
        pipeline = Pipeline(load_config(args.config, _overrides(args, extra)), log=_log, overwrite=args.overwrite)
    else:
        raise UserError("train needs a CONFIG file or --resume RUN_DIR")
    summary = pipeline.run()
    print(format_table(summary, pipeline.title), flush=True)
    print(f"\nwritten: {pipeline.out / 'summary.json'} and {pipeline.out / 'report.html'}", flush=True)
    return 0


def cmd_config(args: argparse.Namespace, extra: list[str]) -> int:
    """A config file (and overrides) resolved: every field's value, defaults included; without one, every field
    with its default and meaning."""
    from albatross.config import describe_fields, load_config

    if args.config or extra or args.set or args.overrides:
        cfg = load_config(args.config, _overrides(args, extra))
        data = cfg.model_dump()
        if not data["out"]:
            data["out"] = f"runs/{cfg.name}-<YYYYmmdd-HHMMSS> (a new directory each run)"
        print(json.dumps(data, indent=2))
        return 0
    for name, default, desc in describe_fields():
        print(f"{name:<36} {default:<14} {desc}")
    return 0


MAX_NEW_TASKS = 100_000


def _check_tasks_new(args: argparse.Namespace) -> None:
    """One-line errors for `tasks new` arguments: counts, families, and an --out that is not a directory."""
    from albatross.tasks.builtin import list_families

    for flag, n in (("--count", args.count), ("--heldout", args.heldout)):
        if not 0 <= n <= MAX_NEW_TASKS:
            raise UserError(f"tasks new: {flag} must be between 0 and {MAX_NEW_TASKS}, got {n}")
    if args.count + args.heldout == 0:
        raise UserError("tasks new: --count and --heldout are both 0: nothing to generate")
    known = list_families()
    unknown = [f for f in args.family or [] if f != "all" and f not in known]
    if unknown:
        raise UserError(f"tasks new: unknown family {unknown[0]!r}; known: all, {', '.join(known)}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"tasks new: --out {args.out}: exists and is not a directory")


def cmd_tasks_new(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.tasks.builtin import generate_tasks

    if args.scaffold:
        return _scaffold(args)
    _check_tasks_new(args)
    try:
        paths = generate_tasks(Path(args.out), families=args.family or None, n_train=args.count,
                               n_heldout=args.heldout, seed=args.seed, difficulty=args.difficulty)
    except (ValueError, FileExistsError) as e:  # no more distinct instances; --out already holds tasks
        raise UserError(f"tasks new: {e}") from None
    for split, ps in paths.items():
        print(f"{split}: {len(ps)} tasks under {Path(args.out) / split}")
    return 0


def _scaffold(args: argparse.Namespace) -> int:
    """``tasks new --scaffold NAME``: one complete task directory to edit into your own."""
    from albatross.tasks.scaffold import write_scaffold

    if args.family:
        raise UserError("tasks new: --scaffold writes one task of your own; it takes no FAMILY")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"tasks new: --out {args.out}: exists and is not a directory")
    try:
        task = write_scaffold(Path(args.out), args.scaffold)
    except ValueError as e:
        raise UserError(f"tasks new: {e}") from None
    print(f"wrote {task}: edit instruction.md, environment/, solution/ and tests/, then "
          f"`albatross tasks validate {task}`")
    return 0


def cmd_tasks_families(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.tasks.builtin import list_families

    for name in list_families():
        print(name)
    return 0


def cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    import importlib

    from albatross.bench import BENCHES

    module = importlib.import_module(BENCHES[args.bench_name])
    module.run(args)
    return 0


# The other command groups, one module each in this package: `register(subparsers, tasks_subparsers)`; they import
# nothing heavy at module level.
PLUGINS = ("albatross.cli.sandbox", "albatross.cli.tasks", "albatross.cli.engine", "albatross.cli.eval")


def _register_plugins(sub: Subparsers, tasks_sub: Subparsers) -> None:
    import importlib

    for name in PLUGINS:
        importlib.import_module(name).register(sub, tasks_sub)


def _add_bench(sub: Subparsers) -> None:
    import importlib
    import importlib.util

    from albatross.bench import BENCHES

    bench = sub.add_parser("bench", help="benchmarks: print a table and write JSON")
    bsub = bench.add_subparsers(dest="bench_name", required=True)
    for name, mod in BENCHES.items():
        if importlib.util.find_spec(mod) is None:
            continue
        module = importlib.import_module(mod)
        p = bsub.add_parser(name, help=_summary(module.__doc__ or ""), description=_paragraph(module.__doc__ or ""))
        p.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
        module.add_arguments(p)  # every bench module has add_arguments(parser)
        p.set_defaults(fn=cmd_bench)


def _paragraph(doc: str) -> str:
    """The first paragraph of a docstring on one line, without parenthesised references to design notes."""
    import re

    return re.sub(r"\s*\([^()]*\.md\b[^()]*\)", "", " ".join(doc.strip().split("\n\n", 1)[0].split()))


def _summary(doc: str) -> str:
    """A whole first sentence of a docstring for a command list (never cut mid-sentence)."""
    import re

    text = _paragraph(doc)
    match = re.search(r"^(.+?[.!?])(\s|$)", text)
    return (match.group(1) if match else text).rstrip(".")


def _log(line: str) -> None:
    print(line, flush=True)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config field, e.g. --set trainer.lr=1e-4 (or --trainer.lr 1e-4)")


def _add_out_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="run directory (config field `out`; default: a new runs/<name>-<time>); one that "
                   "already holds files is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in the run directory")


def _add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("local", "ray"), help="where the trainer, engines and rollout "
                   "workers run (orchestrator.backend): this machine, or Ray actors on the cluster of "
                   "[ray] address")


def build_parser() -> argparse.ArgumentParser:
    from albatross import __version__

    parser = argparse.ArgumentParser(
        prog="albatross", description="Asynchronous RL for terminal agents. Any config field can be set on the "
        "command line as --section.field VALUE (or --section.field=VALUE), before or after the config file; "
        "list fields take a comma-separated list.")
    parser.add_argument("--version", action="version", version=f"albatross {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the whole loop on a laptop: tasks, warm start, async GRPO, eval")
    p.add_argument("--quick", action="store_true", help="a smaller run that finishes in about 3 minutes")
    _add_out_args(p)
    p.add_argument("--config", help="TOML config (default: the demo's own, configs/demo.toml)")
    _add_backend_arg(p)
    _add_config_args(p)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("train", help="train with a TOML config, or resume a run")
    p.add_argument("config", nargs="?", help="TOML file describing the run")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped or crashed run (its out directory)")
    _add_out_args(p)
    _add_backend_arg(p)
    _add_config_args(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("config", help="print every config field with its default and meaning, or a "
                       "resolved config")
    p.add_argument("config", nargs="?", help="TOML file to resolve")
    _add_config_args(p)
    p.set_defaults(fn=cmd_config)
    tasks = sub.add_parser("tasks", help="task tools").add_subparsers(dest="tasks_command", required=True)
    p = tasks.add_parser("families", help="list built-in task families")
    p.set_defaults(fn=cmd_tasks_families)
    p = tasks.add_parser("new", help="generate built-in task directories, or one task of your own to edit")
    p.add_argument("family", nargs="*", help="families to generate, or `all` (default: the demo's three)")
    p.add_argument("--scaffold", metavar="NAME", help="write one small, complete task directory OUT/NAME to edit "
                   "into your own (it passes the nine gates as written)")
    p.add_argument("--difficulty", choices=("easy", "medium", "hard"), default="easy", help="difficulty knob")
    p.add_argument("--count", type=int, default=16, help=f"training tasks (0 to {MAX_NEW_TASKS})")
    p.add_argument("--heldout", type=int, default=0, help=f"held-out tasks (0 to {MAX_NEW_TASKS})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(fn=cmd_tasks_new)
    _add_bench(sub)
    _register_plugins(sub, tasks)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """``UserError`` (config, task, model errors subclass it), and a missing file the user named."""
    return (UserError, FileNotFoundError)


def _runtime_failures() -> tuple[type[BaseException], ...]:
    """Failures of a component that stop a run cleanly (no traceback; the message says what to do)."""
    from albatross.orchestrator.loop import TrainerDied

    return (TrainerDied,)


def main(argv: list[str] | None = None) -> int:
    try:
        argv, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        print(f"albatross: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    fn: Callable[[argparse.Namespace, list[str]], int] = args.fn
    takes_overrides = fn in (cmd_demo, cmd_train, cmd_config)
    if overrides and not takes_overrides:
        if not hasattr(args, "set"):  # argparse: only commands with --set have it
            parser.error(f"{args.command} takes no config fields: unrecognized arguments: "
                         + " ".join(f"--{o}" for o in overrides))
        args.set = [*(args.set or []), *overrides]  # commands with --set (eval, tasks probe)
        overrides = []
    args.overrides = overrides
    if extra and not takes_overrides:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = fn(args, extra)
        sys.stdout.flush()  # a full disk behind stdout fails here, not in the interpreter's exit
        return code
    except _user_errors() as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"albatross: error: {msg}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("albatross: interrupted; a training run can be continued with --resume", file=sys.stderr)
        return 130
    except _runtime_failures() as e:
        print(f"albatross: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        where = f" writing {e.filename}" if e.filename else ""
        print(f"albatross: error: no space left on the device{where}; free some space and rerun (a run or an "
              "eval resumes where it stopped)", file=sys.stderr)
        return EXIT_USER_ERROR
