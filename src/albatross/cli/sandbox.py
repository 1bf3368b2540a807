"""`albatross sandbox`: a shell or one command in a fresh attempt of a task, and the debian base.

    albatross sandbox shell TASK_DIR              interactive shell (for writing and debugging tasks)
    albatross sandbox run TASK_DIR -- CMD [ARG...] one command; prints its output, exits with its code
    albatross sandbox base build                  build the cached debian base root (debootstrap, once)
    albatross sandbox image build REF             build (once) the base a FROM REF uses
    albatross sandbox image import PATH --tag REF import an OCI image layout / docker save archive
    albatross sandbox image list                  the built and imported bases, the built environments

``run`` takes one argument as a shell command line (``-- 'ls | wc -l'``), several as an argv
(``-- ls -la``). A command killed by its timeout exits 124; a limit it hit is named on stderr.
Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shlex
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:  # annotations only: these imports are heavy
    import select

    from albatross.sandbox.base import Attempt, Backend
    from albatross.tasks.format import Task

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # where commands are added

Command = Callable[[argparse.Namespace, list[str]], int]

EXIT_TIMEOUT = 124


def register(sub: Subparsers, tasks_sub: Subparsers) -> None:
    """Add the ``sandbox`` command group to the top-level subparsers."""
    group = sub.add_parser("sandbox", help="a shell or one command in a fresh sandboxed attempt of a task")
    gsub = group.add_subparsers(dest="sandbox_command", required=True)
    p = gsub.add_parser("shell", help="interactive shell in a fresh attempt of a task")
    p.add_argument("task_dir", help="task directory (with task.toml and environment/)")
    _options(p)
    p.set_defaults(fn=cmd_shell)
    p = gsub.add_parser("run", help="run one command in a fresh attempt; exit with its exit code",
                        usage="albatross sandbox run TASK_DIR [options] -- CMD [ARG...]")
    p.add_argument("task_dir", help="task directory (with task.toml and environment/)")
    _options(p)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    p.set_defaults(fn=cmd_run)
    base = gsub.add_parser("base", help="base root file systems of the isolated sandbox")
    bsub = base.add_subparsers(dest="base_command", required=True)
    p = bsub.add_parser("build", help="build the cached debian base root with debootstrap (once)")
    p.add_argument("--suite", default="bookworm", help="Debian suite (default: bookworm)")
    p.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror URL")
    p.add_argument("--force", action="store_true", help="rebuild even if it is already built")
    p.set_defaults(fn=cmd_base_build)
    image = gsub.add_parser("image", help="base images: the roots a Dockerfile's FROM builds on")
    isub = image.add_subparsers(dest="image_command", required=True)
    p = isub.add_parser("build", help="build (once) the base for FROM REF and print what it is")
    p.add_argument("ref", help="image reference, e.g. python:3.11-slim-bookworm")
    p.set_defaults(fn=cmd_image_build)
    p = isub.add_parser("import", help="import an OCI image layout or docker save archive under a tag")
    p.add_argument("path", help="OCI layout directory or tar, or docker save archive")
    p.add_argument("--tag", required=True, help="the FROM reference that will use it, e.g. myorg/env:1")
    p.set_defaults(fn=cmd_image_import)
    p = isub.add_parser("list", help="the built and imported bases in the cache")
    p.set_defaults(fn=cmd_image_list)
    p = isub.add_parser("prune", help="remove built task environments from the layer cache, least recently used "
                        "first (never one a running process uses)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--all", action="store_true", help="every built environment not in use")
    what.add_argument("--unused-days", type=float, metavar="D", help="those no run has loaded for D days")
    what.add_argument("--max-gb", type=float, metavar="GB", help="the least recently used until the cache holds "
                      "at most GB (what [sandbox] layer_cache_max_gb does after each build)")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    p.set_defaults(fn=cmd_image_prune)


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sandbox", choices=["local", "process"], default="local",
                   help="sandbox type: local (isolated, default) or process (no isolation, dev only)")
    p.add_argument("--base", choices=["image", "debian", "host"], default="image",
                   help="base root: image (the Dockerfile's FROM, default), debian, or host (not isolated "
                   "from the host's files)")
    p.add_argument("--tests", action="store_true", help="copy the task's tests/ to /tests first")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before the command is killed (default: the task's agent timeout)")


class CommandError(Exception):
    """A user error of a ``sandbox`` command: printed as one line, exit code 2."""


def _user_error(message: str) -> Exception:
    return CommandError(message)


class _OptionParser(argparse.ArgumentParser):
    """Parses the options given after TASK_DIR; a bad one is a one-line ``CommandError``, not usage text."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CommandError(f"sandbox run: {message}")


def _split_command(args: argparse.Namespace) -> list[str]:
    """Options given after TASK_DIR land in the remainder: parse those before ``--``."""
    rest = list(args.cmd)
    if "--" in rest:
        cut = rest.index("--")
        options, rest = rest[:cut], rest[cut + 1:]
        if options:
            parser = _OptionParser(prog="albatross sandbox run", add_help=False)
            _options(parser)
            parser.parse_args(options, namespace=args)
    if not rest:
        raise _user_error("sandbox run: give the command after --, e.g. sandbox run TASK_DIR -- ls -la")
    return rest


def _open(args: argparse.Namespace) -> tuple[Task, Backend, Attempt]:
    """Load the task, make the backend, fork one attempt (tests copied in if asked)."""
    from albatross.sandbox import Limits, make_backend
    from albatross.sandbox.local import local_available, unavailable_reason
    from albatross.tasks.format import load_task

    task = load_task(args.task_dir)
    _check(args, task)
    if args.sandbox == "local" and not local_available():
        raise _user_error(f"the local sandbox is unavailable here ({unavailable_reason()}); "
                          "use --sandbox process (no isolation)")
    options = {"warm": 0, "base": args.base} if args.sandbox == "local" else {}
    backend = make_backend(args.sandbox, **options)
    limits = Limits(memory_mb=task.memory_mb, disk_mb=task.storage_mb,
                    command_timeout_s=args.timeout if args.timeout is not None else task.agent_timeout_s)
    try:
        attempt = backend.fork(task.env_dir, task.workdir, limits)
        if args.tests:
            attempt.put_dir(task.tests_dir, "/tests")
    except BaseException:
        backend.close()
        raise
    return task, backend, attempt


def _check(args: argparse.Namespace, task: Task) -> None:
    """One-line errors for a bad ``--timeout`` and for a Dockerfile the sandbox cannot build (unsupported
    instruction, an image it cannot stand in for, ...: the build gate's own check)."""
    from albatross.tasks.buildable import dockerfile_problem

    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise _user_error(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    problem = dockerfile_problem(task)
    if problem:
        raise _user_error(problem)


def _sandbox_errors(fn: Command) -> Command:
    """User errors (and a failed environment build: the task author's) are one line, exit code 2; an
    infrastructure failure is one line, exit code 1."""
    @functools.wraps(fn)
    def wrapped(args: argparse.Namespace, extra: list[str]) -> int:
        from albatross.sandbox import DockerfileError, EnvBuildError, SandboxError

        try:
            return fn(args, extra)
        except (CommandError, EnvBuildError, DockerfileError) as err:
            print(f"albatross: error: {str(err).splitlines()[0]}", file=sys.stderr)
            return 2
        except SandboxError as err:
            print(f"albatross: sandbox error: {str(err).splitlines()[0]}", file=sys.stderr)
            return 1
    return wrapped


@_sandbox_errors
def cmd_run(args: argparse.Namespace, extra: list[str]) -> int:
    command = _split_command(args)
    text = command[0] if len(command) == 1 else shlex.join(command)
    _task, backend, attempt = _open(args)
    try:
        result = attempt.exec(text)
    finally:
        attempt.close()
        backend.close()
    sys.stdout.write(result.output)
    sys.stdout.flush()
    if result.truncated_bytes:
        print(f"albatross: {result.truncated_bytes} bytes of output were dropped", file=sys.stderr)
    if result.limit:
        print(f"albatross: the command hit its {result.limit} limit", file=sys.stderr)
    return EXIT_TIMEOUT if result.timed_out else result.exit_code


@_sandbox_errors
def cmd_shell(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.sandbox.holder import STATE_FILE
    from albatross.sandbox.local import LocalAttempt
    from albatross.sandbox.process import ProcessAttempt

    task, backend, attempt = _open(args)
    try:
        print(f"albatross: shell in a fresh attempt of {task.id} (exit to leave; nothing is kept)",
              file=sys.stderr)
        if isinstance(attempt, LocalAttempt):
            return attempt.terminal(["/bin/bash", "--rcfile", STATE_FILE, "-i"], relay_terminal)
        assert isinstance(attempt, ProcessAttempt)  # --sandbox is local or process
        import subprocess

        return subprocess.call(["bash", "-i"], cwd=attempt.host_path(task.workdir))
    finally:
        attempt.close()
        backend.close()


def relay_terminal(master: int) -> None:
    """Copy our stdin to the sandbox terminal and its output to our stdout until it closes."""
    import select
    import termios
    import tty

    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    saved = termios.tcgetattr(stdin) if os.isatty(stdin) else None
    if saved is not None:
        _copy_window_size(stdin, master)
        tty.setraw(stdin)
    poller = select.poll()
    poller.register(master, select.POLLIN)
    poller.register(stdin, select.POLLIN)
    try:
        while _pump(poller, master, stdin, stdout):
            pass
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)


def _pump(poller: select.poll, master: int, stdin: int, stdout: int) -> bool:
    for fd, _event in poller.poll():
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the last process holding the terminal has exited
            data = b""
        if fd == master:
            if not data:
                return False
            os.write(stdout, data)
        elif data:
            os.write(master, data)
        else:  # our stdin ended: end the shell's input too (EOF at the start of a line)
            poller.unregister(stdin)
            with contextlib.suppress(OSError):
                os.write(master, b"\n\x04")
    return True


def _copy_window_size(tty_fd: int, master: int) -> None:
    import fcntl
    import termios

    with contextlib.suppress(OSError):
        size = fcntl.ioctl(tty_fd, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(master, termios.TIOCSWINSZ, size)


@_sandbox_errors
def cmd_base_build(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.sandbox.rootfs import BaseUnavailable, build_debian, is_built

    try:
        path = build_debian(args.suite, args.mirror, force=args.force, log=print)
    except BaseUnavailable as err:
        raise _user_error(str(err)) from None
    state = "built" if is_built(path) else "missing"
    print(f"debian base ({args.suite}): {state} at {path}")
    return 0


@_sandbox_errors
def cmd_image_build(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.sandbox.images import resolve_base
    from albatross.sandbox.rootfs import BaseUnavailable

    try:
        base = resolve_base(args.ref, log=print)
    except BaseUnavailable as err:
        raise _user_error(str(err)) from None
    print(f"{base.ref}: {base.root}")
    for note in base.notes:
        print(f"  note: {note}")
    return 0


@_sandbox_errors
def cmd_image_import(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.sandbox.images import import_image

    if not os.path.exists(args.path):
        raise _user_error(f"sandbox image import: {args.path}: no such file or directory")
    base = import_image(args.path, args.tag, log=print)
    print(f"{base.ref}: {base.root}")
    return 0


@_sandbox_errors
def cmd_image_prune(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.errors import UserError
    from albatross.sandbox.layers import prune

    for name in ("unused_days", "max_gb"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise UserError(f"--{name.replace('_', '-')} {value}: must be >= 0")
    result = prune(everything=args.all, max_bytes=None if args.max_gb is None else int(args.max_gb * (1 << 30)),
                   unused_s=None if args.unused_days is None else args.unused_days * 86400, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{result['root']}: {verb} {len(result['removed'])} built environments "
          f"({result['freed_bytes'] / (1 << 30):.2f} GiB); {result['kept']} kept "
          f"({result['kept_bytes'] / (1 << 30):.2f} GiB)"
          + (f", {result['in_use']} of them in use by a running process" if result["in_use"] else ""))
    return 0


@_sandbox_errors
def cmd_image_list(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.sandbox.images import list_images
    from albatross.sandbox.layers import disk_usage

    for entry in list_images():
        what = entry.get("recipe") or {"source": entry.get("source", "?")}
        print(f"{entry['key']}  {json.dumps(what)}")
    built = disk_usage()
    if built["parents"]:
        total = sum(p["mb"] for p in built["parents"])
        print(f"\nbuilt environments in {built['root']} ({len(built['parents'])}, {total:.0f} MB):")
        for parent in built["parents"]:
            print(f"{parent['key']}  {parent['mb']:.0f} MB")
    return 0
