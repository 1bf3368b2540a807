"""The verifier's own view of a finished attempt: a mount namespace of its own, made by a child of the
zygote (which may mount), in which test.sh runs as a command of the attempt (its pid, network, IPC and
user namespaces, its cgroups, its seccomp filter, the image's USER).

Its root is a fresh tmpfs holding:

* with ``toolchain = "image"`` (the default): ``/usr``, ``/etc`` and the top-level ``bin``, ``sbin``,
  ``lib*`` of the task's *pristine* image (the read-only lower layers of the attempt, without what the
  attempt wrote over them), under a scratch layer of the verifier's own (a tmpfs the size of the attempt's
  disk: test.sh may ``pip install`` its test tools, as in a container; nothing of the agent sees it and it
  goes with the verification): the interpreter, the shell, the libraries, the loader and its
  configuration, python's site-packages and sitecustomize are the image's, whatever the agent did;
  with ``"attempt"`` these are the attempt's own;
* every other top-level entry of the attempt (``/app``, ``/tmp``, ``/root``, ``/var``, ``/proc``,
  ``/dev``, ...): the attempt's working state, where the tests look at it;
* ``/tests`` (a fresh copy of the task's tests), ``/logs/verifier`` (empty; the reward goes there) and the
  offline toolkit (read-only): nowhere in the attempt's own namespace, so no process of the agent (a task
  with ``keep_agent_processes``) can see or change them.

For ``keep_agent_processes`` the verifier's processes also run with a real group id of their own
(``VERIFIER_GID``; their groups keep the user's): the kernel then refuses the agent's processes, whose
ids differ, any ``ptrace`` or ``/proc/<pid>/root`` access to them.

The child reports on a socket of the host: test.sh's exit status and the reward files it read back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
from typing import Any, Protocol

from albatross.sandbox import linux, seccomp
from albatross.sandbox.wire import send

TOOLCHAIN = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
VERIFIER_GID = 65533  # keep_agent_processes: the real gid of the verifier's processes (the agent's differ)
MAX_READ_BYTES = 64 << 20
_OOM_FIRST = "1000"  # the verifier's processes are the memory limit's first victims, as commands are
_NS = ("mnt", "pid", "net", "ipc", "uts")


class ZygoteView(Protocol):
    """What a verification reads of the zygote's state (``zygote.ZygoteState``)."""

    root: str  # the zygote's root: its scratch directory is where the verifier's root is made
    id_base: int  # host uid of root inside the attempts' user namespace (0: none)
    seccomp: Any  # the attempts' seccomp filter (pyseccomp, no stubs)


def start(state: ZygoteView, msg: dict[str, Any], fds: list[int]) -> int:
    """Fork the child that runs one verification (``fds``: the report socket, the output pipe's write end);
    the zygote goes on serving at once. Returns the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    report = socket.socket(fileno=fds[0])
    code = 1
    try:
        _verify(state, msg, report, fds[1])
        code = 0
    except BaseException as err:  # noqa: BLE001 - reported to the host, which raises SandboxError
        with contextlib.suppress(OSError):
            send(report, {"error": f"{type(err).__name__}: {err}"})
    finally:
        os._exit(code)
    raise AssertionError("unreachable")


def _verify(state: ZygoteView, msg: dict[str, Any], report: socket.socket, out_fd: int) -> None:
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)  # gone with the zygote
    linux.close_fds_except({0, 1, 2, report.fileno(), out_fd})  # the zygote's socket and namespaces
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote ignores it; we wait for test.sh
    holder = int(msg["holder"])
    names = [*_NS, *(["user"] if state.id_base else [])]
    ns = {name: os.open(f"/proc/{holder}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC) for name in names}
    groups = [os.open(f"{path}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for path in msg["cgroups"] if path]
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount("none", "/", None, linux.MS_REC | linux.MS_PRIVATE)
    root = _build_root(state, msg, ns["mnt"], ns.get("user"))
    os.chdir(root)
    linux.pivot_root_here()
    for name in ("pid", "net", "ipc", "uts"):  # "pid": for the child about to be forked
        linux.setns(ns[name])
    pid = os.fork()
    if pid == 0:
        _exec_test(state, msg, out_fd, groups, ns.get("user"))
    os.close(out_fd)
    for fd in [*groups, *ns.values()]:
        os.close(fd)
    _pid, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    files, payload = _read_back(msg["reads"])
    send(report, {"exit": code if code >= 0 else 128 - code, "files": files}, payload)


def _build_root(state: ZygoteView, msg: dict[str, Any], attempt_mnt: int, userns: int | None) -> str:
    """The verifier's root, under ``<zygote root>/scratch`` of this (private) namespace (``userns``: the
    attempt's user namespace, which the host's files put here read-only are shown through)."""
    work = f"{state.root}/scratch"
    linux.mount("tmpfs", work, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=1m,mode=700")
    root, pristine = f"{work}/root", f"{work}/pristine"
    os.mkdir(root)
    os.mkdir(pristine)
    size = max(64, int(msg.get("disk_mb", 256)))
    linux.mount("tmpfs", root, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, f"size={size}m,mode=755")
    os.chown(root, state.id_base, state.id_base)  # root inside owns "/" (a new top-level entry stays in here)
    image = msg["toolchain"] == "image"
    if image:  # the pristine image under a scratch layer of the verifier's own (test.sh's pip install)
        scratch = f"{work}/layer"
        os.mkdir(scratch)
        linux.mount("tmpfs", scratch, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, f"size={size}m,mode=700")
        os.mkdir(f"{scratch}/upper", 0o755)
        os.mkdir(f"{scratch}/work", 0o700)
        lowers = ":".join(msg["lowers"])
        linux.mount("overlay", pristine, "overlay", linux.MS_NOSUID | linux.MS_NODEV,
                    f"lowerdir={lowers},upperdir={scratch}/upper,workdir={scratch}/work")
    own = [p.strip("/").split("/")[0] for p in [msg["tests_path"], msg["reward_dir"], *[i for _h, i, _c in msg["puts"]]]]
    skip = {*own, *(TOOLCHAIN if image else ())}
    taken = _clone_attempt(attempt_mnt, skip)
    if image:
        for name in TOOLCHAIN:
            _place_pristine(f"{pristine}/{name}", f"{root}/{name}")
    for name, entry in taken.items():
        _place(entry, f"{root}/{name}")
    uid, gid = _owner(state, msg)
    os.makedirs(f"{root}{msg['tests_path']}", exist_ok=True)
    shutil.copytree(msg["tests_dir"], f"{root}{msg['tests_path']}", symlinks=True, dirs_exist_ok=True)
    _chown_tree(f"{root}{msg['tests_path']}", state.id_base, state.id_base)
    reward = f"{root}{msg['reward_dir']}"
    os.makedirs(reward, mode=0o755)
    for path in (os.path.dirname(reward), reward):
        os.chown(path, uid, gid)
    for host, inside, copy in msg["puts"]:
        target = f"{root}{inside}"
        os.makedirs(target, exist_ok=True)
        if copy:
            shutil.copytree(host, target, symlinks=True, dirs_exist_ok=True)
            _chown_tree(target, state.id_base, state.id_base)
        else:
            fd = linux.clone_tree(host, recursive=False, readonly=True, userns_fd=userns)
            try:
                linux.attach_tree(fd, target)
            finally:
                os.close(fd)
    return root


def _clone_attempt(attempt_mnt: int, skip: set[str]) -> dict[str, tuple[str, Any]]:
    """Every top-level entry of the attempt's root but ``skip``: ("link", target) or ("dir" / "file", a
    detached copy of its mount tree), taken inside the attempt's mount namespace."""
    own = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    taken: dict[str, tuple[str, Any]] = {}
    try:
        linux.setns(attempt_mnt, linux.CLONE_NEWNS)  # our root is now the attempt's
        for name in os.listdir("/"):
            if name in skip:
                continue
            with contextlib.suppress(OSError):
                st = os.lstat(f"/{name}")
                if stat.S_ISLNK(st.st_mode):
                    taken[name] = ("link", os.readlink(f"/{name}"))
                elif stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                    kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
                    taken[name] = (kind, linux.clone_tree(f"/{name}"))
    finally:
        linux.setns(own, linux.CLONE_NEWNS)
        os.close(own)
    return taken


def _place(entry: tuple[str, Any], target: str) -> None:
    kind, value = entry
    if kind == "link":
        os.symlink(value, target)
        return
    if kind == "dir":
        os.mkdir(target)
    else:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    try:
        linux.attach_tree(value, target)
    finally:
        os.close(value)


def _place_pristine(source: str, target: str) -> None:
    """The image's ``source`` at ``target``: a link as the same link, a directory mounted (its writes go to the
    verifier's scratch layer, which no process of the agent sees and which goes with the verification)."""
    try:
        st = os.lstat(source)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(source), target)
    elif stat.S_ISDIR(st.st_mode):
        os.mkdir(target)
        fd = linux.clone_tree(source, recursive=False)
        try:
            linux.attach_tree(fd, target)
        finally:
            os.close(fd)


def _owner(state: ZygoteView, msg: dict[str, Any]) -> tuple[int, int]:
    """Host ids of the verifier's user (what owns the reward directory)."""
    user = msg.get("user")
    uid, gid = (user[0], user[1]) if user else (0, 0)
    return state.id_base + uid, state.id_base + gid


def _chown_tree(top: str, uid: int, gid: int) -> None:
    """Give a copied tree to root inside the sandbox (as a put of the tests always did)."""
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*dirnames, *filenames]:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)
    os.chown(top, uid, gid)


def _exec_test(state: ZygoteView, msg: dict[str, Any], out_fd: int, groups: list[int], userns: int | None) -> None:
    """In the forked child: become a command of the attempt and exec test.sh's command. Never returns."""
    code = 126
    try:
        for fd in groups:  # the attempt's memory, pids (a group of its own) and cpu cgroups
            os.write(fd, b"0")
        linux.write_file("/proc/self/oom_score_adj", _OOM_FIRST)
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if userns is not None:
            linux.setns(userns, linux.CLONE_NEWUSER)
        linux.join_new_session_keyring()
        user = msg.get("user")
        uid, gid, extra = (user[0], user[1], list(user[2])) if user else (0, 0, [])
        if msg.get("isolate"):
            os.setgroups(sorted({gid, *extra}))
            os.setresgid(VERIFIER_GID, gid, gid)
        else:
            os.setgroups(extra)
            os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
        os.setsid()
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        linux.close_fds_except({0, 1, 2})
        with contextlib.suppress(OSError):
            os.chdir("/")
            os.chdir(msg["cwd"])
        env = dict(msg["env"])
        argv = list(msg["argv"])
        path = shutil.which(argv[0], path=env.get("PATH", "/usr/bin:/bin")) or argv[0]
        seccomp.load(state.seccomp)  # last: set-up needed setns and keyctl
        os.execve(path, argv, env)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.write(2, f"albatross: cannot run the verifier: {err}\n".encode())
    finally:
        os._exit(code)


def _read_back(paths: list[str]) -> tuple[dict[str, int | None], bytes]:
    """The files ``paths`` as the verifier left them: {path: length in the payload, or None}."""
    files: dict[str, int | None] = {}
    chunks: list[bytes] = []
    for path in paths:
        data = _regular(path)
        files[path] = None if data is None else len(data)
        if data is not None:
            chunks.append(data)
    return files, b"".join(chunks)


def _regular(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_READ_BYTES:
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
