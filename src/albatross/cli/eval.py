"""`albatross eval` and `albatross report`. Nothing heavy is imported at module level.

``eval`` appends every try to OUT/attempts.jsonl as it finishes; rerun with the same OUT and it skips
the (task, trial) pairs already finished, so an interrupted evaluation resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeAlias

from albatross.cli.signals import sigterm_interrupts
from albatross.errors import UserError

if TYPE_CHECKING:  # annotations only: these imports are heavy
    from albatross.config import RunConfig, SandboxConfig
    from albatross.engine.base import Engine
    from albatross.eval.run import Price
    from albatross.harness.retry import Runner
    from albatross.records import Trajectory
    from albatross.sandbox.base import Backend
    from albatross.tasks.format import Task

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # where commands are added

AGENTS = ("model", "oracle", "noop")
NETWORK_POLICIES = ("none", "registries", "open")  # sandbox.base.NETWORK_POLICIES (not imported: it is heavy)
NOOP_ACTION = "```bash\nsubmit\n```"
ATTEMPTS_FILE, CONFIG_FILE, SUMMARY_FILE = "attempts.jsonl", "eval.json", "summary.json"
_IDENTITY = ("agent", "model", "label")

TINY_TOKENIZER = "albatross_tokenizer.json"
TOKENIZER_FILES = (TINY_TOKENIZER, "tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def register(sub: Subparsers, tasks_sub: Subparsers) -> None:
    """Add the ``eval`` and ``report`` commands to the top-level subparsers."""
    p = sub.add_parser("eval", help="evaluate a model (or the tasks' oracle) on tasks: Pass@1, pass@k, "
                       "tokens, cost; resumable")
    p.add_argument("--model", metavar="SPEC", help="a local model directory (served by the config's [engine]: "
                   "built-in, or vLLM / SGLang servers launched or attached), a LoRA adapter directory (a LoRA "
                   "run's <out>/final: its base served with the adapter) or the http(s) URL of a vLLM / SGLang "
                   "/ OpenAI-compatible server")
    p.add_argument("--agent", choices=AGENTS, default="model", help="model: the training harness driving "
                   "--model; oracle: each task's solution/solve.sh (checks the tasks); noop: submits at once")
    p.add_argument("--tasks", nargs="+", required=True, metavar="DIR", help="task directories or folders "
                   "of them")
    p.add_argument("--trials", type=int, default=5, help="attempts per task (default 5)")
    p.add_argument("--out", help="output directory (default runs/eval/<name>); rerun to resume")
    p.add_argument("--server", choices=("vllm", "sglang"), default="vllm", help="protocol of a --model URL: "
                   "vllm (also OpenAI-compatible servers taking token-id prompts, e.g. `albatross serve`) or sglang")
    p.add_argument("--tokenizer", metavar="DIR", help="the model's tokenizer (albatross_tokenizer.json or a "
                   "transformers one): required with a URL; default: the model directory")
    p.add_argument("--name", help="label of the model in tables and plots (default: from --model)")
    p.add_argument("--workers", type=int, default=16, help="attempts run concurrently (default 16)")
    p.add_argument("--retries", type=int, help="fresh forks after an infrastructure error (default: the config's "
                   "sandbox.max_infra_retries)")
    p.add_argument("--prices", metavar="TOML", help='price table: ["name"] input, cached_input, output '
                   "in USD per million tokens (default: 0, a local model)")
    p.add_argument("--sandbox", choices=("auto", "local", "process", "docker"), default="auto",
                   help="auto: local (isolated) where available, else process")
    p.add_argument("--config", help="run config TOML for the harness, sandbox limits and sampling")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. "
                   "--set harness.max_turns=8")
    p.add_argument("--network", choices=NETWORK_POLICIES, help="network policy of the attempts (default: the "
                   "config's sandbox.network): none, registries (the package registries through albatross's "
                   "egress proxy) or open; a task may narrow it; recorded with every attempt")
    p.add_argument("--overrides", dest="task_overrides", metavar="FILE|NAME", help="per-task overrides of "
                   "task.toml values, each with its reason: a TOML file, or a set albatross ships "
                   "(terminal-bench-2); docs/tasks.md")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("report", help="one self-contained HTML page: Pass@1 vs cost with the Pareto "
                       "frontier, training curves, per-category breakdown, configurations")
    p.add_argument("dirs", nargs="+", metavar="RUN_OR_EVAL_DIR")
    p.add_argument("--out", default="report.html", help="HTML file to write (default report.html)")
    p.add_argument("--prices", metavar="TOML", help="reprice every result by its name from this table")
    p.add_argument("--title", default="albatross report")
    p.set_defaults(fn=cmd_report)


# ---------------------------------------------------------------------------------------------- eval


@dataclass
class _Model:
    """What ``--agent`` / ``--model`` resolved to."""

    label: str  # the default name of the result
    spec: str | None = None  # a resolved model directory or a server URL
    directory: Path | None = None
    tokenizer: Path | None = None
    remote: Engine | None = None  # a connected remote engine (closed by cmd_eval)
    adapter: Path | None = None  # a LoRA adapter on ``directory`` (served as weight version 1)


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.config import load_config

    _check_counts(args)
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out}: exists and is not a directory")
    cfg = load_config(args.config, [_normalise(o) for o in args.set or []])
    cfg.sampling.temperature, cfg.sampling.seed = cfg.eval.temperature, cfg.eval.seed
    if args.retries is None:
        args.retries = cfg.sandbox.max_infra_retries
    if args.network:
        cfg.sandbox.network = args.network
    if args.sandbox == "docker" and cfg.sandbox.network != "none":
        raise UserError(f"--network {cfg.sandbox.network}: the docker sandbox runs attempts with no network "
                        "(the local sandbox enforces the registries and open policies)")
    tasks = _usable_tasks(args.tasks, args.agent == "oracle", args.task_overrides)
    model = _resolve_model(args)
    try:
        label = args.name or model.label
        out = Path(args.out or Path("runs") / "eval" / label).resolve()
        price = _price(args.prices, label)
        config = _eval_config(args, cfg, tasks, model, label, price)
        _check_resume(out, config)
        with sigterm_interrupts():
            return _run(args, cfg, tasks, model, out, config, price)
    finally:
        if model.remote is not None:
            model.remote.close()


def _normalise(override: str) -> str:
    key, sep, value = override.partition("=")
    return key.strip().replace("-", "_") + sep + value


def _check_counts(args: argparse.Namespace) -> None:
    for name in ("trials", "workers"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1")
    if args.retries is not None and args.retries < 0:
        raise UserError("--retries must be 0 or more")


def _resolve_model(args: argparse.Namespace) -> _Model:
    if args.agent != "model":
        return _Model(args.agent)
    spec = args.model
    if not spec:
        raise UserError("--model SPEC is required (or use --agent oracle / --agent noop)")
    if spec.startswith(("http://", "https://")):
        return _remote_model(args, spec)
    path = Path(spec)
    if (path / "adapter_config.json").is_file():
        return _adapter_model(args, path)
    if not (path / "config.json").is_file():
        raise UserError(f"{spec}: not a model directory (no config.json) and not an http(s) URL")
    return _Model(path.resolve().name, str(path.resolve()), path.resolve(), _tokenizer_dir(args.tokenizer or path))


def _adapter_model(args: argparse.Namespace, path: Path) -> _Model:
    """A LoRA adapter directory (a LoRA run's ``<out>/final``): its base model (``base_model_name_or_path``, a local
    directory) served by the engine with the adapter as weight version 1."""
    from albatross.engine.adapter import adapter_config

    try:
        base = Path(adapter_config(path)["base_model_name_or_path"] or "")
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path / 'adapter_config.json'}: base_model_name_or_path: unreadable ({e})") from None
    if not (base / "config.json").is_file():
        raise UserError(f"{path / 'adapter_config.json'}: base_model_name_or_path: {str(base) or '(empty)'} is not a "
                        "local model directory")
    tokenizer = _tokenizer_dir(args.tokenizer or (path if any((path / n).is_file() for n in TOKENIZER_FILES)
                                                  else base))
    return _Model(path.resolve().name, str(path.resolve()), base.resolve(), tokenizer, adapter=path.resolve())


def _tokenizer_dir(directory: str | Path) -> Path:
    path = Path(directory)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"{path}: no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}); pass --tokenizer DIR "
                        "(e.g. the run's base model directory)")
    return path.resolve()


def _remote_model(args: argparse.Namespace, url: str) -> _Model:
    """Connect to a vLLM / SGLang / OpenAI-compatible server; its tokenizer must be local (token-in/out)."""
    if not args.tokenizer:
        raise UserError(f"{url}: --tokenizer DIR is required with a server URL (the served model's tokenizer)")
    tokenizer = _tokenizer_dir(args.tokenizer)
    from albatross.engine.remote import RemoteError, SGLangEngine, VLLMEngine

    try:
        engine = {"vllm": VLLMEngine, "sglang": SGLangEngine}[args.server](url, connect_timeout=15.0)
    except RemoteError as e:
        raise UserError(str(e).splitlines()[0]) from None
    return _Model(str(engine.model), url, None, tokenizer, engine)


def _price(path: str | None, label: str) -> Price:
    from albatross.eval.run import Price, load_prices

    if path is None:
        return Price()
    try:
        prices = load_prices(path)
    except ValueError as e:
        raise UserError(str(e)) from None
    price = prices.get(label) or prices.get("*")
    if price is None:
        print(f'albatross: note: {path} has no ["{label}"] or ["*"] entry; cost counted as 0', file=sys.stderr)
    return price or Price()


def _usable_tasks(paths: list[str], oracle: bool, overrides: str | None = None) -> list[Task]:
    """The tasks under ``paths`` that can run here. A task that cannot (malformed, a Dockerfile the sandbox
    cannot build, no solve.sh for ``--agent oracle``) is reported on stderr and skipped; the others run."""
    from albatross.tasks.buildable import dockerfile_problem
    from albatross.tasks.format import TaskFormatError, find_task_dirs, load_task
    from albatross.tasks.overrides import apply_overrides, load_overrides

    try:
        changes = load_overrides(overrides)
    except TaskFormatError as e:
        raise UserError(str(e)) from None
    tasks: list[Task] = []
    seen: dict[str, Path] = {}
    dirs: list[str | Path] = [*paths]
    for task_dir in find_task_dirs(dirs):
        try:
            task = apply_overrides(load_task(task_dir), changes)
            problem = dockerfile_problem(task) or _solution_problem(task, oracle)
        except TaskFormatError as e:
            problem = str(e)
        if problem:
            print(f"albatross: skipping task {task_dir}: {problem.splitlines()[0]}", file=sys.stderr)
            continue
        if task.id in seen:
            raise UserError(f"{task_dir}: duplicate task id {task.id!r} (also {seen[task.id]})")
        seen[task.id] = task_dir
        tasks.append(task)
    if not tasks:
        raise UserError(f"no task in {' '.join(paths)} can run (each skipped above)")
    return tasks


def _solution_problem(task: Task, oracle: bool) -> str:
    solve = task.solution_dir / "solve.sh"
    return f"{solve}: missing (needed by --agent oracle)" if oracle and not solve.is_file() else ""


def _eval_config(args: argparse.Namespace, cfg: RunConfig, tasks: list[Task], model: _Model, label: str,
                 price: Price) -> dict[str, Any]:
    from dataclasses import asdict

    import albatross

    return {"agent": args.agent, "model": model.spec, "label": label,
            "tokenizer": str(model.tokenizer) if model.tokenizer else None,
            "server": args.server if model.remote is not None else None,
            "engine": cfg.engine.model_dump() if model.directory is not None else None,
            "tasks": [t.id for t in tasks], "task_dirs": [str(Path(d).resolve()) for d in args.tasks],
            "trials": args.trials, "retries": args.retries, "sandbox": args.sandbox,
            "price_per_million": asdict(price), "harness": cfg.harness.model_dump(),
            "sampling": cfg.sampling.model_dump(), "limits": cfg.sandbox.model_dump(),
            "albatross_version": albatross.__version__}


def _check_resume(out: Path, config: dict[str, Any]) -> None:
    path = out / CONFIG_FILE
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: invalid JSON: {e}") from None
        if not isinstance(old, dict):
            raise UserError(f"{path}: not an eval config (a JSON object); choose another --out")
        for key in _IDENTITY:
            if old.get(key) != config[key]:
                raise UserError(f"{path}: {out} holds an eval with {key} {old.get(key)!r}, not "
                                f"{config[key]!r}; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")


def _run(args: argparse.Namespace, cfg: RunConfig, tasks: list[Task], model: _Model, out: Path,
         config: dict[str, Any], price: Price) -> int:
    from albatross.eval.run import evaluate, finished_pairs, load_attempts

    try:
        records = load_attempts(out / ATTEMPTS_FILE)
        skip = finished_pairs(records)
    except (UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{out / ATTEMPTS_FILE}: not an attempts file ({type(e).__name__}: {e}); "
                        "choose another --out") from None
    todo = sum((t.id, i) not in skip for t in tasks for i in range(args.trials))
    print(f"[eval] {config['label']}: {len(tasks)} tasks x {args.trials} trials, {todo} attempts to run"
          + (f" ({len(records)} tries already in {out / ATTEMPTS_FILE})" if records else ""), flush=True)
    backend = _backend(args.sandbox, [out, *args.tasks, *(p for p in (model.directory, model.adapter) if p)],
                       cfg.sandbox)
    engine: Engine | None = None
    start = time.monotonic()
    try:
        agent, engine = _agent(args, cfg, backend, model, out)
        progress = Progress(todo)
        evaluate(agent, tasks, args.trials, workers=args.workers, retries=args.retries, progress=progress,
                 skip=skip, on_try=_writer(out / ATTEMPTS_FILE, tasks, config["label"], price, progress))
    except KeyboardInterrupt:
        print(f"\n[eval] interrupted: finished attempts are in {out / ATTEMPTS_FILE}; rerun the same "
              "command to resume", file=sys.stderr, flush=True)
        raise
    finally:
        if engine is not None:
            engine.close()
        backend.close()
    return _finish(out, tasks, args.trials, config, time.monotonic() - start)


def _backend(kind: str, hide: Sequence[str | Path], sc: SandboxConfig) -> Backend:
    from albatross.cache import cache_root
    from albatross.sandbox import local_available, make_backend

    if kind == "auto":
        kind = "local" if local_available() else "process"
    if kind in ("process", "docker"):  # docker: a container sees nothing of the host to hide
        return make_backend(kind)
    return make_backend("local", hide_paths=[str(p) for p in [*hide, cache_root()]], registries=sc.registries,
                        layer_cache=sc.layer_cache, build_min_free_mb=sc.build_min_free_mb)


def _agent(args: argparse.Namespace, cfg: RunConfig, backend: Backend, model: _Model, out: Path
           ) -> tuple[Runner, Engine | None]:
    """The runner for ``--agent`` and the engine to close afterwards (None when there is none). A model directory
    is served by the config's ``[engine]`` (its logs in ``OUT/engine/logs``)."""
    if args.agent == "oracle":
        from albatross.eval.oracle import OracleAgent
        from albatross.sandbox.base import Limits

        sc = cfg.sandbox
        return OracleAgent(backend, Limits.from_config(sc)), None
    if args.agent == "noop":
        from albatross.engine.scripted import ScriptedEngine
        from albatross.harness.agent import builtin_agent
        from albatross.harness.chat import TinyTokenizer
        from albatross.tasks.builtin import corpus_strings

        cfg.harness.action_format = "bash_block"  # the no-op's one action is a fenced `submit`
        agent = builtin_agent(cfg, None, backend, TinyTokenizer.from_corpus(corpus_strings()))
        agent.engine = ScriptedEngine([NOOP_ACTION], agent.fmt.action)
        return agent, None
    assert model.tokenizer is not None  # _resolve_model sets it for --agent model
    tokenizer = _load_tokenizer(model.tokenizer)
    if model.remote is not None:  # closed by cmd_eval
        return _harness_agent(cfg, model.remote, backend, tokenizer), None
    from albatross.pipeline.probe import model_agent

    assert model.directory is not None  # a model directory when there is no server
    return model_agent(cfg, backend, model.directory, model.tokenizer, out / "engine", adapter=model.adapter)


def _load_tokenizer(directory: Path) -> Any:
    """The directory's transformers tokenizer (the demo's included; ``engine.tokenizer.load_tokenizer``)."""
    from albatross.engine.tokenizer import load_tokenizer

    return load_tokenizer(directory)


def _harness_agent(cfg: RunConfig, engine: Engine | None, backend: Backend, tokenizer: Any) -> Runner:
    """The training harness of the run config, with the tokenizer's chat format (``build_agent``; ``tokenizer``:
    a transformers tokenizer or the demo's)."""
    from albatross.harness.agent import build_agent

    return build_agent(cfg, engine, backend, tokenizer)


def _writer(path: Path, tasks: list[Task], label: str, price: Price, progress: Progress
            ) -> Callable[[Trajectory], None]:
    """Appends each try to the attempts file with its category, model, token usage and cost."""
    from dataclasses import asdict

    from albatross.eval.run import record_usage
    from albatross.records import append_jsonl

    categories = task_categories(tasks)
    sources = {t.id: str(t.metadata.get("source") or categories[t.id]) for t in tasks}  # per-source figures

    def write(traj: Trajectory) -> None:
        record = traj.to_dict()
        usage = record_usage(record)
        record.update(category=categories[traj.task_id], source=sources[traj.task_id], model=label,
                      usage=asdict(usage), cost=price.cost(usage))
        append_jsonl(path, record)
        progress.on_try(traj)

    return write


def task_categories(tasks: list[Task]) -> dict[str, str]:
    """Task id -> its [metadata] category (else family, else "uncategorized")."""
    from albatross.tasks.format import UNCATEGORIZED

    return {t.id: str(t.metadata.get("category") or t.metadata.get("family") or UNCATEGORIZED)
            for t in tasks}


def _finish(out: Path, tasks: list[Task], trials: int, config: dict[str, Any], seconds: float) -> int:
    from albatross.eval.run import load_attempts, summarize

    summary = summarize(load_attempts(out / ATTEMPTS_FILE), tasks=[t.id for t in tasks], trials=trials)
    summary = {"label": config["label"], "agent": config["agent"], "model": config["model"],
               **summary, "session_seconds": round(seconds, 1)}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary), flush=True)
    print(f"\nwritten: {out / SUMMARY_FILE}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------- output


class Progress:
    """A progress bar on a terminal; plain lines (about every 10%) when stdout is not a TTY."""

    def __init__(self, total: int, stream: IO[str] | None = None) -> None:
        self.total, self.stream = total, stream or sys.stdout
        self.tty = self.stream.isatty()
        self.solved = self.infra = 0
        self.start = time.monotonic()
        self._last_line = -1

    def on_try(self, traj: Trajectory) -> None:
        self.solved += bool(traj.success)
        self.infra += traj.status == "infra_error"

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.monotonic() - self.start
        eta = elapsed / done * (total - done) if done else 0.0
        text = (f"{done}/{total} attempts  solved {self.solved}  infra errors {self.infra} (retried)  "
                f"{elapsed:.0f}s elapsed, eta {eta:.0f}s")
        if self.tty:
            width = 24
            bar = "#" * (width * done // max(total, 1))
            end = "\n" if done == total else ""
            self.stream.write(f"\r[eval] [{bar:<{width}}] {text}\x1b[K{end}")
        elif done == total or 10 * done // max(total, 1) > self._last_line:
            self._last_line = 10 * done // max(total, 1)
            self.stream.write(f"[eval] {text}\n")
        self.stream.flush()


def format_summary(s: dict[str, Any]) -> str:
    """The eval's figures as plain-text tables."""
    se = s.get("pass_at_1_se")
    tok = s["tokens_per_task"]
    lines = ["", f"albatross eval: {s['label']}  ({s['tasks']} tasks x {s['trials']} trials, "
             f"{s['attempts']} scored attempts)", "-" * 72,
             f"Pass@1              {s['pass_at_1']:.3f}" + (f" ± {se:.3f} (s.e. over tasks; 95% CI {ci[0]:.3f} to {ci[1]:.3f})"
                                                   if se is not None and (ci := s.get("pass_at_1_ci95")) else ""),
             "pass@k              " + "  ".join(f"k={k} {v:.3f}" for k, v in s["pass_at_k"].items()),
             f"tokens per task     input {tok['input']:.0f}  cached {tok['cached_input']:.0f}  "
             f"output {tok['output']:.0f}",
             f"turns per task      {s['turns_per_task']:.2f}",
             f"wall s per task     {s['wall_seconds_per_task']:.2f}",
             f"cost per task       ${s['cost_per_task']:.6f}  (total ${s['cost_total']:.4f})",
             f"infra errors        {s['infra_errors']} tries (retried, never scored); "
             f"{s['unscored_attempts']} attempts left unscored",
             "", _table(["category", "tasks", "attempts", "pass@1", "cost/task"],
                        [[r["category"], r["tasks"], r["attempts"], f"{r['pass_at_1']:.3f}",
                          f"${r['cost_per_task']:.6f}"] for r in s["per_category"]]),
             *_source_lines(s),
             "", _table(["task", "category", "n", "pass@1", "turns", "out tok", "wall s", "cost"],
                        [[r["task"], r["category"], r["n"], f"{r['pass_at_1']:.3f}", f"{r['turns']:.1f}",
                          f"{r['output_tokens']:.0f}", f"{r['wall_seconds']:.1f}", f"${r['cost']:.6f}"]
                         for r in s["per_task"]])]
    return "\n".join(lines)


def _source_lines(s: dict[str, Any]) -> list[str]:
    """Per source, when some are repository tasks: Pass@1 and the share of FAIL_TO_PASS tests fixed."""
    rows = s.get("per_source", [])
    if not any(r["fail_to_pass_fixed"] is not None for r in rows):
        return []
    return ["", _table(["source", "tasks", "attempts", "pass@1", "FAIL_TO_PASS fixed"],
                       [[r["source"], r["tasks"], r["attempts"], f"{r['pass_at_1']:.3f}",
                         "-" if r["fail_to_pass_fixed"] is None else f"{r['fail_to_pass_fixed']:.3f}"] for r in rows])]


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in cells)


# -------------------------------------------------------------------------------------------- report


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.eval.report import ReportError, write_report

    try:
        path = write_report(args.dirs, args.out, prices=args.prices, title=args.title)
    except ReportError as e:
        raise UserError(str(e)) from None
    except UnicodeDecodeError as e:  # a binary attempts / summary file among the inputs
        raise UserError(f"{' '.join(args.dirs)}: a results file is not UTF-8 text ({e.reason})") from None
    except IsADirectoryError as e:
        raise UserError(f"--out {args.out}: is a directory ({e.strerror})") from None
    print(f"written: {path}")
    return 0
