"""Isolated sandbox: Linux namespaces, a copy-on-write overlay of the host root, cgroup v1 limits.

Layout of one attempt::

    /            overlay: lowerdir=<parent layer>:/ (host root, read-only), upper+work on a tmpfs of
                 ``limits.disk_mb`` (the disk-write limit); entered with pivot_root
    /proc /sys   fresh procfs of the attempt's pid namespace, read-only sysfs of its net namespace
    /dev         tmpfs with null zero full random urandom tty, /dev/shm tmpfs, /dev/pts (new instance)
    /tmp /run    fresh tmpfs
    hidden       /work /root /home /tmp /var/tmp /run /mnt /media /srv /old_root /farm and every
                 ``hide_paths`` entry are opaque (empty) directories in every parent layer, so neither
                 builds nor attempts see the host's files there

Processes. A *zygote* (one small single-threaded Python process per backend, in a private mount
namespace that holds the parent layers on a tmpfs, so no mount of ours ever appears on the host) forks,
per attempt, a child that joins the attempt's cgroups, unshares mount/pid/net/ipc/uts namespaces and
forks the attempt's *holder*: pid 1 of the new pid namespace. The holder mounts the overlay, pivots
into it, drops dangerous capabilities from the bounding set, and then serves requests from the host
over a Unix socket: run a command (fork, setsid, join a per-command pids cgroup, exec), write a tar
into the attempt, read a file. Killing the holder kills the whole pid namespace, which frees every
mount. Output goes through a pipe the host passes with each command. Timeouts kill every process in
the command's pids cgroup (background jobs of earlier commands live in their own cgroups and survive).

Parents. A parent is built once per distinct environment directory (keyed by a hash of its files):
a *builder* holder whose overlay upper directory is the parent's layer applies the Dockerfile (COPY
through a tar, WORKDIR, RUN with ``bash -c`` in a new net namespace unless ``allow_internet``); the
layer is then frozen and used as the top lower layer of every attempt forked from it.

Limitations: needs root, cgroup v1 memory and pids controllers, overlayfs and tmpfs xattrs. The base
image named by FROM is not pulled: the host root is the base. The host root is live, so host changes
outside the hidden paths show through. USER is ignored (commands run as root, with a reduced capability
bounding set). ``.dockerignore`` is not read.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import hashlib
import io
import itertools
import json
import logging
import os
import platform
import select
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from albatross.sandbox.base import ExecResult, Limits, SandboxError
from albatross.sandbox.dockerfile import Arg, Copy, Env, From, Instruction, Run, Workdir, parse_dockerfile

log = logging.getLogger(__name__)

HIDDEN_PATHS = (
    "/work",
    "/root",
    "/home",
    "/tmp",
    "/var/tmp",
    "/run",
    "/mnt",
    "/media",
    "/srv",
    "/old_root",
    "/farm",
)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STATE_FILE = "/run/albatross/state"
# Restore cwd and exported env, run the command, save them again (also on `exit N`).
_PROLOGUE = (
    f"source {STATE_FILE} 2>/dev/null\n"
    'trap \'__albatross_rc=$?; { export -p; printf "cd -- %q\\n" "$PWD"; } '
    f">{STATE_FILE} 2>/dev/null; exit $__albatross_rc' EXIT\n"
)

# ---- Linux system calls (ctypes) --------------------------------------------------------------------

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_CAPBSET_DROP = 4, 24
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
# Capabilities kept in the bounding set of sandboxed commands (Docker's default set minus MKNOD):
# CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID SETPCAP NET_BIND_SERVICE NET_RAW SYS_CHROOT
# AUDIT_WRITE SETFCAP. Dropped include SYS_ADMIN (mount), DAC_READ_SEARCH, SYS_PTRACE, MKNOD, SYS_MODULE.
_KEPT_CAPS = {0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 29, 31}
_DEVICES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {fstype} on {target}",
    )


def _unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _prctl(option: int, arg: int) -> None:
    _check(
        _libc.prctl(
            ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)
        ),
        f"prctl {option}",
    )


def _pivot_root_here() -> None:
    """Make the current directory the root and detach the old root (runc's pivot_root(".", ".") trick)."""
    number = _SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown syscall number on {platform.machine()}")
    _check(_libc.syscall(ctypes.c_long(number), b".", b"."), "pivot_root")
    _mount("none", ".", None, MS_REC | MS_PRIVATE)
    _check(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.chdir("/")


# ---- wire protocol: 8-byte header (json length, payload length), json, payload; fds ride the header --


def _send(sock: socket.socket, msg: dict[str, Any], payload: bytes = b"", fds: Iterable[int] = ()) -> None:
    body = json.dumps(msg).encode()
    head = struct.pack("!II", len(body), len(payload))
    fds = list(fds)
    if fds:
        socket.send_fds(sock, [head], fds)
        sock.sendall(body + payload)
    else:
        sock.sendall(head + body + payload)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(size - got, 1 << 20))
        if not chunk:
            raise EOFError("peer closed the socket")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], bytes, list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(sock, 8, 4)
    if not head:
        raise EOFError("peer closed the socket")
    for fd in fds:
        os.set_inheritable(fd, False)
    head += _recv_exact(sock, 8 - len(head))
    body_len, payload_len = struct.unpack("!II", head)
    data = _recv_exact(sock, body_len + payload_len)
    return json.loads(data[:body_len]), data[body_len:], fds


# ---- inside the sandbox: root file system setup (runs in the holder, pid 1 of the new namespaces) ----


def _setup_root(cfg: dict[str, Any]) -> int:
    """Mount the overlay and pseudo file systems, pivot into it; return an fd of the pids cgroup dir."""
    for path in (cfg["memory_cgroup"], cfg["pids_cgroup"]):
        with open(f"{path}/cgroup.procs", "w") as f:
            f.write("0")
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    scratch = cfg["scratch"]
    size_mb = cfg["disk_mb"] if cfg["upper"] is None else 1
    _mount("tmpfs", scratch, "tmpfs", 0, f"size={size_mb}m,mode=755")
    upper, work = cfg["upper"] or f"{scratch}/u", cfg["work"] or f"{scratch}/w"
    merged = f"{scratch}/m"
    for path in (upper, work, merged):
        os.makedirs(path, exist_ok=True)
    _mount(
        "overlay", merged, "overlay", 0, f"lowerdir={':'.join(cfg['lower'])},upperdir={upper},workdir={work}"
    )
    _mount_pseudo(merged, cfg["disk_mb"], sysfs=cfg["new_net"])
    if cfg["new_net"]:
        _loopback_up()
    socket.sethostname("sandbox")
    cgroup_fd = os.open(cfg["pids_cgroup"], os.O_RDONLY | os.O_DIRECTORY)
    os.chdir(merged)
    _pivot_root_here()
    os.makedirs(os.path.dirname(STATE_FILE), exist_ok=True)
    with open(STATE_FILE, "w") as f:
        f.write(cfg["state"])
    if cfg["workdir"]:
        os.makedirs(cfg["workdir"], exist_ok=True)
    last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last_cap + 1):
        if cap not in _KEPT_CAPS:
            _prctl(PR_CAPBSET_DROP, cap)
    _prctl(PR_SET_DUMPABLE, 0)  # commands cannot open /proc/1/fd (our socket, the cgroup dir)
    return cgroup_fd


def _mount_pseudo(root: str, disk_mb: int, sysfs: bool) -> None:
    for sub in ("proc", "sys", "dev", "tmp", "run"):
        os.makedirs(f"{root}/{sub}", exist_ok=True)
    _mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if sysfs:  # sysfs shows the mounter's net namespace: only when that is the attempt's own
        _mount("sysfs", f"{root}/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("tmpfs", f"{root}/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=1m")
    old_umask = os.umask(0)
    try:
        for name, (major, minor) in _DEVICES.items():
            os.mknod(f"{root}/dev/{name}", 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        for name, target in (
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
            ("ptmx", "pts/ptmx"),
        ):
            os.symlink(target, f"{root}/dev/{name}")
        os.mkdir(f"{root}/dev/shm", 0o1777)
        os.mkdir(f"{root}/dev/pts", 0o755)
    finally:
        os.umask(old_umask)
    _mount("tmpfs", f"{root}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m")
    _mount(
        "devpts", f"{root}/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"
    )
    _mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={disk_mb}m")
    _mount("tmpfs", f"{root}/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=16m")


def _loopback_up() -> None:
    import fcntl

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, siocgifflags, req))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


# ---- inside the sandbox: the holder's request loop ------------------------------------------------------


def _holder_main(cfg: dict[str, Any], sock_fd: int) -> None:
    sock = socket.socket(fileno=sock_fd)
    try:
        cgroup_fd = _setup_root(cfg)
    except BaseException as err:  # noqa: BLE001 - reported to the host, which raises SandboxError
        with contextlib.suppress(OSError):
            where = traceback.extract_tb(err.__traceback__)[-1]
            _send(sock, {"error": f"sandbox setup failed at {where.name}:{where.lineno}: {err}"})
        os._exit(1)
    try:
        _send(sock, {"ready": True})
        _Holder(sock, cgroup_fd).serve()
    finally:
        os._exit(0)


class _Holder:
    def __init__(self, sock: socket.socket, cgroup_fd: int) -> None:
        self.sock, self.cgroup_fd = sock, cgroup_fd
        self.running: dict[int, str] = {}  # pid -> its pids cgroup name
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def serve(self) -> None:
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        while True:
            for fd, _event in poller.poll():
                if fd == self.wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
                    self.reap()
                    continue
                try:
                    msg, payload, fds = _recv(self.sock)
                except (EOFError, OSError):
                    return  # the host is gone: exiting kills the pid namespace
                self.handle(msg, payload, fds)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            cgroup = self.running.pop(pid, None)
            if cgroup is not None:
                code = os.waitstatus_to_exitcode(status)
                with contextlib.suppress(OSError):
                    os.rmdir(cgroup, dir_fd=self.cgroup_fd)  # fails while background jobs live there
                _send(self.sock, {"exit": code if code >= 0 else 128 - code})

    def handle(self, msg: dict[str, Any], payload: bytes, fds: list[int]) -> None:
        op = msg.get("op")
        try:
            if op == "exec":
                self.start(msg, fds[0])
                return  # the reply ({"exit": code}) is sent when the command ends
            if op == "put":
                with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
                    kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
                    tar.extractall("/", numeric_owner=True, **kw)
                _send(self.sock, {"ok": True})
            elif op == "read":
                _send(self.sock, {"ok": True}, Path(msg["path"]).read_bytes())
            elif op == "mkdirs":
                os.makedirs(msg["path"], exist_ok=True)
                _send(self.sock, {"ok": True})
            else:
                _send(self.sock, {"error": f"unknown request {op!r}"})
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            _send(self.sock, {"missing": True})
        except (OSError, tarfile.TarError) as err:
            _send(self.sock, {"error": f"{op} failed: {err}"})
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def start(self, msg: dict[str, Any], out_fd: int) -> None:
        """Start a command with posix_spawn (vfork: ~3x faster than fork here) in its own session and
        pids cgroup: the holder steps into the command's cgroup for the spawn, then steps back."""
        cgroup, argv, env = msg["cgroup"], msg["argv"], msg["env"]
        try:
            os.mkdir(cgroup, dir_fd=self.cgroup_fd)
            self.join(cgroup)
            try:
                with contextlib.suppress(OSError):
                    os.chdir(msg["cwd"])
                path = shutil.which(argv[0], path=env.get("PATH", DEFAULT_PATH)) or argv[0]
                pid = os.posix_spawn(
                    path,
                    argv,
                    env,
                    file_actions=[
                        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                        (os.POSIX_SPAWN_DUP2, out_fd, 1),
                        (os.POSIX_SPAWN_DUP2, out_fd, 2),
                    ],
                    setsid=True,
                    setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT),
                )
            finally:
                os.chdir("/")
                self.join(".")
        except OSError as err:  # no such program, or the agent exhausted its pids limit
            os.write(out_fd, f"albatross: cannot run {argv[0]}: {err}\n".encode())
            with contextlib.suppress(OSError):
                os.rmdir(cgroup, dir_fd=self.cgroup_fd)
            _send(self.sock, {"exit": 127 if isinstance(err, FileNotFoundError) else 126})
            return
        self.running[pid] = cgroup

    def join(self, cgroup: str) -> None:
        fd = os.open(f"{cgroup}/cgroup.procs", os.O_WRONLY, dir_fd=self.cgroup_fd)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


# ---- the zygote: forks holders, owns the parent layers --------------------------------------------------


def zygote_main() -> None:
    """Entry point of the zygote process (``python -c ... zygote_main()`` ROOT CONTROL_FD)."""
    root, ctrl = sys.argv[1], socket.socket(fileno=int(sys.argv[2]))
    _unshare(CLONE_NEWNS)
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", 0, "mode=700")
    os.mkdir(f"{root}/scratch")
    os.mkdir(f"{root}/parents")
    own_ns = [os.open(f"/proc/self/ns/{ns}", os.O_RDONLY) for ns in ("mnt", "pid", "net", "ipc", "uts")]
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    poller = select.poll()
    poller.register(ctrl, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        for fd, _event in poller.poll():
            if fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap_all()
                continue
            try:
                msg, _payload, fds = _recv(ctrl)
            except (EOFError, OSError):
                return
            try:
                reply = _zygote_handle(root, msg, fds, own_ns)
            except Exception as err:  # noqa: BLE001 - every failure goes back to the host
                reply = {"error": str(err)}
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _send(ctrl, reply)


def _reap_all() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _zygote_handle(root: str, msg: dict[str, Any], fds: list[int], own_ns: list[int]) -> dict[str, Any]:
    op = msg["op"]
    if op == "spawn":
        return {"pid": _spawn_holder(msg["cfg"], fds[0], own_ns)}
    if op == "parent_new":
        base = f"{root}/parents/{msg['key']}"
        os.makedirs(f"{base}/layer")
        os.makedirs(f"{base}/work")
        for path in msg["hide"]:
            _hide(f"{base}/layer", path)
        return {"layer": f"{base}/layer", "work": f"{base}/work"}
    if op == "rmtree":
        path = os.path.realpath(msg["path"])
        if not path.startswith(f"{root}/parents/"):
            raise ValueError(f"refusing to remove {path}")
        shutil.rmtree(path, ignore_errors=True)
        return {"ok": True}
    raise ValueError(f"unknown zygote request {op!r}")


def _hide(layer: str, path: str) -> None:
    """Make ``path`` (a host path) an empty opaque directory, or a whiteout, in the overlay layer.

    A path missing on the host becomes an empty directory too, so it stays hidden if created later."""
    parts = Path(path).parts[1:]
    for i in range(1, len(parts) + 1):  # parent directories keep the host's mode and owner
        host, target = "/" + "/".join(parts[:i]), os.path.join(layer, *parts[:i])
        try:
            st = os.lstat(host)
        except FileNotFoundError:
            st = None
        if i == len(parts) and st is not None and not stat.S_ISDIR(st.st_mode):
            os.mknod(target, stat.S_IFCHR, os.makedev(0, 0))  # overlay whiteout
            return
        if not os.path.isdir(target):
            os.mkdir(target, 0o755)
            if st is not None and stat.S_ISDIR(st.st_mode):
                os.chmod(target, stat.S_IMODE(st.st_mode))
                os.chown(target, st.st_uid, st.st_gid)
    os.setxattr(os.path.join(layer, *parts), "trusted.overlay.opaque", b"y")


def _spawn_holder(cfg: dict[str, Any], sock_fd: int, own_ns: list[int]) -> int:
    """Unshare the namespaces, fork the holder (pid 1 of the new pid namespace), and step back into
    our own namespaces (setns), so no intermediate process is needed."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    _unshare(flags | (CLONE_NEWNET if cfg["new_net"] else 0))
    try:
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                _close_fds_except({0, 1, 2, sock_fd})
            finally:
                _holder_main(cfg, sock_fd)
    finally:
        for fd in own_ns:
            _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(0)), "setns back to the zygote's namespace")
    return pid


def _close_fds_except(keep: set[int]) -> None:
    low = 0
    for fd in sorted(keep) + [os.sysconf("SC_OPEN_MAX")]:
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1


# ---- host side: cgroups ------------------------------------------------------------------------------


def _cgroup_root(controller: str) -> Path:
    """``/sys/fs/cgroup/<controller>/<our own cgroup>/albatross`` (so our limits nest under ours)."""
    mount = Path("/sys/fs/cgroup") / controller
    own = "/"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _id, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                own = path
    return mount / own.lstrip("/") / "albatross"


class _Cgroups:
    """The attempt's memory and pids cgroups (v1); commands get pids sub-cgroups ``c<N>``."""

    def __init__(self, attempt_id: str, limits: Limits) -> None:
        self.memory = _cgroup_root("memory") / attempt_id
        self.pids = _cgroup_root("pids") / attempt_id
        try:
            for path in (self.memory, self.pids):
                path.mkdir(parents=True)
            limit = str(limits.memory_mb << 20)
            (self.memory / "memory.limit_in_bytes").write_text(limit)
            memsw = self.memory / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(limit)
            (self.pids / "pids.max").write_text(str(limits.pids))
        except OSError as err:
            self.remove()
            raise SandboxError(f"cannot create cgroups for attempt {attempt_id}: {err}") from err

    def kill(self, name: str) -> None:
        """SIGKILL every process of one command's cgroup (repeat: a dying tree may still fork)."""
        procs = self.pids / name / "cgroup.procs"
        for _ in range(100):
            try:
                pids = [int(p) for p in procs.read_text().split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)

    def remove(self) -> None:
        dirs = [p for p in self.pids.glob("c*") if p.is_dir()] + [self.pids, self.memory]
        for path in dirs:
            for delay in (0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0):
                time.sleep(delay)
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as err:
                    if err.errno != errno.EBUSY:
                        log.warning("cannot remove cgroup %s: %s", path, err)
                        break
            else:
                log.warning("cgroup %s still busy; left behind", path)


def _remove_stale_cgroups() -> None:
    """Remove empty attempt cgroups left by processes that died without closing (named <pid>-<n>)."""
    for controller in ("memory", "pids"):
        root = _cgroup_root(controller)
        for path in root.glob("*-*") if root.is_dir() else ():
            age = 0.0
            owner = path.name.split("-", 1)[0]
            with contextlib.suppress(OSError):
                age = time.time() - path.stat().st_mtime
            if owner.isdigit() and not Path(f"/proc/{owner}").exists() and age > 600:
                for sub in [*path.glob("c*"), path]:
                    with contextlib.suppress(OSError):
                        sub.rmdir()


# ---- host side: the zygote client ----------------------------------------------------------------------


class _Zygote:
    def __init__(self) -> None:
        import albatross

        self.root = tempfile.mkdtemp(prefix="albatross-zygote-")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        src = str(Path(albatross.__file__).resolve().parents[1])
        # -S: no site-packages (a smaller process forks faster); the zygote needs only the stdlib
        code = f"import sys; sys.path.insert(0, {src!r}); from albatross.sandbox.local import zygote_main; zygote_main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", code, self.root, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()

    def request(self, msg: dict[str, Any], fds: Iterable[int] = ()) -> dict[str, Any]:
        with self.lock:
            try:
                _send(self.sock, msg, fds=fds)
                reply, _payload, _fds = _recv(self.sock)
            except (EOFError, OSError) as err:
                raise SandboxError(f"sandbox zygote died (exit code {self.proc.poll()}): {err}") from err
        if "error" in reply:
            raise SandboxError(f"sandbox zygote: {msg['op']} failed: {reply['error']}")
        return reply

    def close(self) -> None:
        self.sock.close()  # the zygote exits on EOF, and its mount namespace with it
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.rmdir(self.root)


# ---- host side: attempts -----------------------------------------------------------------------------


def _wait_readable(fd: int, timeout_s: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


class _Output:
    """Collects output up to a cap; counts (and discards) the rest."""

    def __init__(self, cap: int) -> None:
        self.cap, self.chunks, self.kept, self.dropped = cap, [], 0, 0

    def add(self, data: bytes) -> None:
        room = max(0, self.cap - self.kept)
        if room:
            self.chunks.append(data[:room])
            self.kept += min(room, len(data))
        self.dropped += max(0, len(data) - room)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


class LocalAttempt:
    """One attempt: a holder process in its own namespaces, driven over a Unix socket."""

    def __init__(
        self,
        backend: LocalBackend,
        attempt_id: str,
        sock: socket.socket,
        pid: int,
        cgroups: _Cgroups,
        limits: Limits,
    ) -> None:
        self.id, self.pid, self.limits = attempt_id, pid, limits
        self._backend, self._sock, self._cgroups = backend, sock, cgroups
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = None  # it died during setup; _wait_ready reports why
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        self._commands = itertools.count()

    def _wait_ready(self, timeout_s: float = 30.0) -> None:
        if not _wait_readable(self._sock.fileno(), timeout_s):
            raise SandboxError(f"attempt {self.id}: sandbox did not start within {timeout_s:.0f} s")
        reply = self._request_reply()
        if "error" in reply:
            raise SandboxError(f"attempt {self.id}: {reply['error']}")

    def _request_reply(self) -> dict[str, Any]:
        try:
            return _recv(self._sock)[0]
        except (EOFError, OSError) as err:
            raise SandboxError(f"attempt {self.id}: sandbox holder died ({err})") from err

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        """Run ``command`` with ``bash -c`` in the attempt; cwd and exported env persist."""
        return self.run_argv(["/bin/bash", "-c", _PROLOGUE + command], {}, "/", timeout_s)

    def run_argv(
        self, argv: list[str], env: dict[str, str], cwd: str, timeout_s: float | None = None
    ) -> ExecResult:
        """Run ``argv`` with exactly ``env`` in ``cwd`` (no shell state); used for builds."""
        timeout = self.limits.command_timeout_s if timeout_s is None else timeout_s
        cgroup = f"c{next(self._commands)}"
        start = time.monotonic()
        with self._lock:
            self._check_open()
            read_fd, write_fd = os.pipe()
            try:
                try:
                    _send(
                        self._sock,
                        {"op": "exec", "argv": argv, "env": env, "cwd": cwd, "cgroup": cgroup},
                        fds=[write_fd],
                    )
                except OSError as err:
                    raise SandboxError(f"attempt {self.id}: sandbox holder died ({err})") from err
                finally:
                    os.close(write_fd)
                out = _Output(self.limits.max_output_bytes)
                code, timed_out = self._collect(read_fd, out, start + timeout, cgroup)
            finally:
                os.close(read_fd)
        return ExecResult(
            out.text(), -1 if timed_out else code, timed_out, time.monotonic() - start, out.dropped
        )

    def _collect(self, read_fd: int, out: _Output, deadline: float, cgroup: str) -> tuple[int, bool]:
        poller = select.poll()
        poller.register(read_fd, select.POLLIN)
        poller.register(self._sock, select.POLLIN)
        reply: dict[str, Any] | None = None
        timed_out, give_up = False, 0.0
        while reply is None:
            wait = max(0.0, deadline - time.monotonic())
            for fd, _event in poller.poll(wait * 1000):
                if fd == read_fd:
                    data = os.read(read_fd, 1 << 16)
                    if data:
                        out.add(data)
                    else:
                        poller.unregister(read_fd)
                else:
                    reply = self._request_reply()
            now = time.monotonic()
            if reply is None and now >= deadline:
                if not timed_out:
                    timed_out, give_up = True, now + 10.0
                elif now > give_up:
                    raise SandboxError(f"attempt {self.id}: command did not die after its timeout")
                self._cgroups.kill(cgroup)
                deadline = now + 0.2
        os.set_blocking(read_fd, False)
        with contextlib.suppress(BlockingIOError):
            while data := os.read(read_fd, 1 << 16):  # what was written before the command exited
                out.add(data)
        return int(reply.get("exit", -1)), timed_out

    def _call(self, msg: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
        with self._lock:
            self._check_open()
            try:
                _send(self._sock, msg, payload)
                reply, data, _fds = _recv(self._sock)
            except (EOFError, OSError) as err:
                raise SandboxError(f"attempt {self.id}: sandbox holder died ({err})") from err
        if "error" in reply:
            raise SandboxError(f"attempt {self.id}: {reply['error']}")
        return reply, data

    def put_dir(self, host_dir: Path, sandbox_path: str) -> None:
        """Copy the contents of ``host_dir`` into the attempt at ``sandbox_path``."""
        host_dir = Path(host_dir)
        if not host_dir.is_dir():
            raise FileNotFoundError(f"put_dir: {host_dir} is not a directory")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            _tar_add(tar, host_dir, sandbox_path)
        self._call({"op": "put"}, buf.getvalue())

    def put_tar(self, data: bytes) -> None:
        """Extract an uncompressed tar (member names relative to /) into the attempt."""
        self._call({"op": "put"}, data)

    def mkdirs(self, sandbox_path: str) -> None:
        self._call({"op": "mkdirs", "path": sandbox_path})

    def read_file(self, sandbox_path: str) -> bytes | None:
        """The file's bytes as the attempt sees them, or None if it does not exist."""
        reply, data = self._call({"op": "read", "path": sandbox_path})
        return None if reply.get("missing") else data

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"attempt {self.id} is closed")

    def close(self) -> None:
        """Kill the holder (and so the whole pid namespace and its mounts), remove the cgroups."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            if not _wait_readable(self._pidfd, 10.0):
                log.warning("attempt %s: holder %d did not exit within 10 s", self.id, self.pid)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._lock:  # a concurrent exec sees EOF and lets go
            self._sock.close()
            if self._pidfd is not None:
                os.close(self._pidfd)
        self._cgroups.remove()
        self._backend._forget(self)

    def __enter__(self) -> LocalAttempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tar_add(tar: tarfile.TarFile, source: Path, dest: str) -> None:
    """Add ``source`` (a file, or a directory's contents) to the tar as ``dest`` (absolute)."""
    arc = dest.strip("/")
    if source.is_dir() and not source.is_symlink():
        if arc:
            info = tar.gettarinfo(str(source), arcname=arc)
            tar.addfile(info)
        for child in sorted(source.iterdir()):
            tar.add(str(child), arcname=f"{arc}/{child.name}" if arc else child.name)
    else:
        tar.add(str(source), arcname=arc)


# ---- host side: the backend and its parents ------------------------------------------------------------


class EnvBuildError(SandboxError):
    """A Dockerfile instruction failed while building an environment (e.g. RUN exited non-zero)."""


@dataclass
class Parent:
    key: str
    layer: str
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    image: str | None = None


def env_key(env_dir: Path | None) -> str:
    """A hash of every file (path, mode, content or link target) of an environment directory."""
    digest = hashlib.sha256(b"albatross-env-v1")
    if env_dir is None:
        return "empty"
    for path in sorted(Path(env_dir).rglob("*")):
        st = path.lstat()
        digest.update(f"{path.relative_to(env_dir)}\0{st.st_mode:o}\0".encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:24]


def _state_script(env: dict[str, str], workdir: str) -> str:
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    return "\n".join([*lines, f"cd -- {shlex.quote(workdir)}", ""])


_LIVE: weakref.WeakSet[LocalBackend] = weakref.WeakSet()


@atexit.register
def _close_live_backends() -> None:
    for backend in list(_LIVE):
        backend.close()


class LocalBackend:
    """Attempts isolated with namespaces, overlayfs and cgroups (see the module docstring)."""

    name = "local"
    isolated = True

    def __init__(
        self,
        hide_paths: Iterable[str | Path] = (),
        allow_internet: bool = False,
        build_limits: Limits | None = None,
        build_timeout_s: float = 1800.0,
    ) -> None:
        """``hide_paths``: extra host paths made empty in every sandbox (e.g. the run directory).
        ``allow_internet``: give Dockerfile RUN steps the host network (attempts never get it)."""
        self.hide_paths = [*HIDDEN_PATHS, *(str(Path(p).resolve()) for p in hide_paths)]
        self.allow_internet = allow_internet
        self.build_limits = build_limits or Limits(memory_mb=4096, pids=4096, disk_mb=4096)
        self.build_timeout_s = build_timeout_s
        self._zygote: _Zygote | None = None
        self._lock = threading.Lock()
        self._parents: dict[str, Parent] = {}
        self._building: dict[str, threading.Lock] = {}
        self._attempts: set[LocalAttempt] = set()
        self._ids = itertools.count()
        self._token = os.urandom(3).hex()  # pids cgroups may be shared with other pid namespaces
        _remove_stale_cgroups()
        _LIVE.add(self)

    def _zyg(self) -> _Zygote:
        with self._lock:
            if self._zygote is None:
                self._zygote = _Zygote()
            return self._zygote

    def fork(self, env_dir: Path | None, workdir: str = "/app", limits: Limits | None = None) -> LocalAttempt:
        """Fork a fresh attempt from the (cached) parent built from ``env_dir``."""
        parent = self.prepare(env_dir)
        start_dir = parent.workdir or workdir
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", **parent.env}
        return self._spawn(
            limits or Limits(),
            lower=[parent.layer, "/"],
            upper=None,
            work=None,
            new_net=True,
            workdir=start_dir,
            state=_state_script(env, start_dir),
        )

    def _spawn(
        self,
        limits: Limits,
        *,
        lower: list[str],
        upper: str | None,
        work: str | None,
        new_net: bool,
        workdir: str | None,
        state: str,
    ) -> LocalAttempt:
        zygote = self._zyg()
        attempt_id = f"{os.getpid()}-{self._token}-{next(self._ids)}"
        cgroups = _Cgroups(attempt_id, limits)
        cfg = {
            "lower": lower,
            "upper": upper,
            "work": work,
            "new_net": new_net,
            "workdir": workdir,
            "state": state,
            "scratch": f"{zygote.root}/scratch",
            "disk_mb": limits.disk_mb,
            "memory_cgroup": str(cgroups.memory),
            "pids_cgroup": str(cgroups.pids),
        }
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = zygote.request({"op": "spawn", "cfg": cfg}, fds=[theirs.fileno()])["pid"]
        except BaseException:
            ours.close()
            cgroups.remove()
            raise
        finally:
            theirs.close()
        attempt = LocalAttempt(self, attempt_id, ours, pid, cgroups, limits)
        with self._lock:
            self._attempts.add(attempt)
        try:
            attempt._wait_ready()
        except BaseException:
            attempt.close()
            raise
        return attempt

    def _forget(self, attempt: LocalAttempt) -> None:
        with self._lock:
            self._attempts.discard(attempt)

    def prepare(self, env_dir: Path | None) -> Parent:
        """Build (once) and return the parent for ``env_dir``; safe to call from many threads."""
        key = env_key(env_dir)
        with self._lock:
            if key in self._parents:
                return self._parents[key]
            building = self._building.setdefault(key, threading.Lock())
        with building:
            with self._lock:
                if key in self._parents:
                    return self._parents[key]
            parent = self._build(env_dir, key)
            with self._lock:
                self._parents[key] = parent
            return parent

    def _build(self, env_dir: Path | None, key: str) -> Parent:
        instructions: list[Instruction] = []
        if env_dir is not None:
            dockerfile = Path(env_dir) / "Dockerfile"
            if not dockerfile.is_file():
                raise SandboxError(f"{env_dir}: no Dockerfile")
            instructions = parse_dockerfile(dockerfile)
        zygote = self._zyg()
        dirs = zygote.request({"op": "parent_new", "key": key, "hide": self.hide_paths})
        parent = Parent(key, dirs["layer"])
        try:
            if any(isinstance(i, (Copy, Run, Workdir)) for i in instructions):
                builder = self._spawn(
                    self.build_limits,
                    lower=["/"],
                    upper=dirs["layer"],
                    work=dirs["work"],
                    new_net=not self.allow_internet,
                    workdir=None,
                    state="",
                )
                try:
                    _apply(instructions, parent, builder, Path(env_dir or "."), self.build_timeout_s)
                finally:
                    builder.close()
            else:
                _apply(instructions, parent, None, Path(env_dir or "."), self.build_timeout_s)
        except BaseException:
            zygote.request({"op": "rmtree", "path": str(Path(dirs["layer"]).parent)})
            raise
        zygote.request({"op": "rmtree", "path": dirs["work"]})
        return parent

    def close(self) -> None:
        """Close every attempt, drop every parent, stop the zygote. Idempotent."""
        with self._lock:
            attempts, self._attempts = list(self._attempts), set()
            zygote, self._zygote = self._zygote, None
            self._parents.clear()
        for attempt in attempts:
            attempt.close()
        if zygote is not None:
            zygote.close()


def _apply(
    instructions: list[Instruction],
    parent: Parent,
    builder: LocalAttempt | None,
    env_dir: Path,
    timeout_s: float,
) -> None:
    """Apply the Dockerfile to the parent layer through the builder attempt."""
    args: dict[str, str] = {}
    for ins in instructions:
        cwd = parent.workdir or "/"
        if isinstance(ins, Arg):
            args[ins.name] = ins.default or args.get(ins.name, "")
        elif isinstance(ins, Env):
            parent.env.update(ins.pairs)
        elif isinstance(ins, Workdir):
            parent.workdir = os.path.normpath(os.path.join(cwd, ins.path))
            assert builder is not None
            builder.mkdirs(parent.workdir)
        elif isinstance(ins, Copy):
            assert builder is not None
            builder.put_tar(copy_tar(ins, env_dir, cwd))
        elif isinstance(ins, Run):
            assert builder is not None
            env = {"PATH": DEFAULT_PATH, "HOME": "/root", **args, **parent.env}
            argv = ["/bin/bash", "-c", ins.command] if isinstance(ins.command, str) else list(ins.command)
            result = builder.run_argv(argv, env, cwd, timeout_s)
            if result.exit_code != 0:
                what = "timed out" if result.timed_out else f"exited with {result.exit_code}"
                raise EnvBuildError(
                    f"{env_dir / 'Dockerfile'}:{ins.line}: RUN {what}: {result.output[-2000:]}"
                )
        elif isinstance(ins, From):
            parent.image = ins.image


def copy_tar(ins: Copy, env_dir: Path, cwd: str) -> bytes:
    """A tar (names relative to /) holding what COPY/ADD ``ins`` puts into the image."""
    root = env_dir.resolve()
    sources: list[Path] = []
    for pattern in ins.sources:
        matches = sorted(root.glob(pattern)) if any(c in pattern for c in "*?[") else [root / pattern]
        for path in matches:
            if not path.resolve().is_relative_to(root):
                raise EnvBuildError(f"{env_dir / 'Dockerfile'}:{ins.line}: {pattern} is outside {env_dir}")
            if not path.exists():
                raise EnvBuildError(
                    f"{env_dir / 'Dockerfile'}:{ins.line}: {ins.keyword} source "
                    f"{pattern} not found in {env_dir}"
                )
            sources.append(path)
    if not sources:
        raise EnvBuildError(f"{env_dir / 'Dockerfile'}:{ins.line}: nothing matches {list(ins.sources)}")
    dest = os.path.join(cwd, ins.dest)
    into_dir = ins.dest.endswith("/") or ins.dest in (".", "") or len(sources) > 1
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for src in sources:
            if src.is_dir():
                _tar_add(tar, src, dest)
            else:
                _tar_add(tar, src, os.path.join(dest, src.name) if into_dir else dest)
    return buf.getvalue()


_PROBE = """
import os, sys, tempfile
sys.path.insert(0, sys.argv[1])
from albatross.sandbox import local as L
L._unshare(L.CLONE_NEWNS | L.CLONE_NEWPID | L.CLONE_NEWNET | L.CLONE_NEWIPC | L.CLONE_NEWUTS)
L._mount("none", "/", None, L.MS_REC | L.MS_PRIVATE)
root = tempfile.mkdtemp(prefix="albatross-probe-")
try:
    L._mount("tmpfs", root, "tmpfs", 0, "size=1m")
    for d in ("u", "w", "m"):
        os.mkdir(f"{root}/{d}")
    os.setxattr(f"{root}/u", "trusted.overlay.opaque", b"y")
    L._mount("overlay", f"{root}/m", "overlay", 0, f"lowerdir=/,upperdir={root}/u,workdir={root}/w")
    assert os.path.isdir(f"{root}/m/usr"), "overlay of / is empty"
finally:
    os.system(f"umount -R {root} 2>/dev/null")
    os.rmdir(root)
"""


@lru_cache(maxsize=1)
def local_available() -> bool:
    """True when this machine can run LocalBackend: Linux, root, cgroup v1 memory and pids controllers,
    unshare(2) of mount/pid/net/ipc/uts namespaces, and an overlay whose lower layer is the host root
    (probed in a throwaway process)."""
    if sys.platform != "linux" or os.geteuid() != 0 or platform.machine() not in _SYS_PIVOT_ROOT:
        return False
    if not all(_cgroup_root(c).parent.is_dir() for c in ("memory", "pids")):
        return False
    import albatross

    src = str(Path(albatross.__file__).resolve().parents[1])
    try:
        probe = subprocess.run([sys.executable, "-S", "-c", _PROBE, src], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.info("local sandbox unavailable: %s", err)
        return False
    if probe.returncode != 0:
        log.info("local sandbox unavailable: %s", probe.stderr.decode(errors="replace")[-500:])
    return probe.returncode == 0
