"""Inside an attempt: the holder, pid 1 of the attempt's pid namespace.

The zygote forks the holder into fresh mount/pid/net/ipc/uts namespaces. As host root it mounts the
attempt's root (an overlay of the parent layers over the base root, its writable upper layer on a tmpfs
of ``disk_mb``), the pseudo file systems and the devices, brings up loopback, pivots into the new root,
and then (user-namespace mode) joins the attempt's own user namespace as its uid 0, which is an
unprivileged uid on the host. It joins a new session keyring, sets no_new_privs and loads the seccomp
filter (``seccomp.py``), which every command inherits. From then on it serves the host over a Unix socket: run a command (posix_spawn in its
own session and its own pids sub-cgroup), open an interactive terminal, write a tar, read a file.
When the image has a ``USER`` (``cfg["user"]``: uid, gid, supplementary groups), every command runs as
that user: the holder forks, the child sets its groups, gid and uid (dropping every capability) and
execs, so the image needs no ``setpriv``; the holder itself stays root (tars, reads, cgroups). The shell
state file and ``/logs`` (where Harbor mounts the agent's and the verifier's logs) belong to the user.
When the holder dies, the kernel kills every process of the pid namespace and frees every mount.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import select
import shutil
import signal
import socket
import stat
import traceback
from pathlib import Path
from typing import Any

from albatross.sandbox import extract, linux, seccomp
from albatross.sandbox.build import DEFAULT_PATH
from albatross.sandbox.verifier import TOOLCHAIN
from albatross.sandbox.wire import recv, send

STATE_FILE = "/run/albatross/state"
INODES_PER_MB = 256  # files an attempt may make per MiB of its disk limit (one per 4 KiB block)
MAX_READ_BYTES = 64 << 20
_DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
_DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
    "ptmx": "pts/ptmx",
}
_TIOCSPTLCK, _TIOCGPTN = 0x40045431, 0x80045430
_PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
_PROC_MASKED = ("kcore", "keys", "timer_list", "sched_debug")
# Capabilities kept in the bounding set of sandboxed commands (Docker's default set minus MKNOD):
# CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID SETPCAP NET_BIND_SERVICE NET_RAW SYS_CHROOT
# AUDIT_WRITE SETFCAP. Dropped include SYS_ADMIN (mount), DAC_READ_SEARCH, SYS_PTRACE, MKNOD, SYS_MODULE.
KEPT_CAPS = {0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 29, 31}


def holder_main(cfg: dict[str, Any], sock_fd: int, userns_fd: int | None, zygote_fd: int | None = None,
                seccomp_filter: Any = None) -> None:  # a pyseccomp filter (no stubs)
    """Set up the attempt's root, tell the host, then serve it until it hangs up. Never returns.

    ``zygote_fd``: a pidfd of the zygote; the holder dies with it (its layers and mounts are gone).
    ``seccomp_filter``: the filter to load last (None: the set-up fails with ``cfg["seccomp_error"]``)."""
    sock = socket.socket(fileno=sock_fd)
    try:
        if seccomp_filter is None:
            raise OSError(cfg.get("seccomp_error") or "no seccomp filter")
        fds = setup_root(cfg, userns_fd)
        # Changing credentials (joining the user namespace) cleared the parent-death signal: set it
        # again, then make sure the zygote did not die before it was set (the signal would be lost).
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if zygote_fd is not None:
            poller = select.poll()
            poller.register(zygote_fd, select.POLLIN)
            if poller.poll(0):
                os._exit(1)
            os.close(zygote_fd)
        seccomp.load(seccomp_filter)  # last: set-up needed mount, setns and keyctl
    except BaseException as err:  # noqa: BLE001 - reported to the host, which raises SandboxError
        with contextlib.suppress(OSError):
            where = " > ".join(f"{f.name}:{f.lineno}" for f in traceback.extract_tb(err.__traceback__)[-3:])
            send(sock, {"error": f"sandbox setup failed at {where}: {err}"})
        os._exit(1)
    try:
        send(sock, {"ready": True})
        user = cfg.get("user")
        Holder(sock, *fds, user=(user[0], user[1], tuple(user[2])) if user else None).serve()
    finally:
        os._exit(0)


# ---- root file system -------------------------------------------------------------------------------


def setup_root(cfg: dict[str, Any], userns_fd: int | None) -> tuple[int, int | None]:
    """Build and enter the attempt's root; returns fds of its pids cgroup and of its scratch tmpfs. The host moves
    this process into the attempt's cgroups meanwhile (``AttemptCgroups.adopt``): the move waits for an RCU grace
    period (milliseconds, tens of them on a busy machine), which then overlaps with these mounts (the unmount of
    the old root waits for one too) instead of coming first. No command starts before the move is done."""
    merged = _mount_overlay(cfg)
    _mount_pseudo(merged, cfg)
    _mount_binds(merged, cfg.get("binds") or [], userns_fd)
    if cfg["new_net"]:
        _configure_net(cfg)
    socket.sethostname("sandbox")
    cgroup_fd = os.open(cfg["pids_cgroup"], os.O_RDONLY | os.O_DIRECTORY)
    scratch_fd = os.open(cfg["scratch"], os.O_RDONLY | os.O_DIRECTORY) if cfg["upper"] is None else None
    os.chdir(merged)
    linux.pivot_root_here()
    if userns_fd is not None:
        _enter_userns(userns_fd)
        linux.drop_bounding_caps(KEPT_CAPS)  # joining a user namespace gives a full bounding set
    linux.join_new_session_keyring()  # keys the agent adds die with the attempt; keyctl is denied after
    linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
    os.makedirs(os.path.dirname(STATE_FILE), exist_ok=True)
    Path(STATE_FILE).write_text(cfg["state"])
    if cfg["workdir"]:
        os.makedirs(cfg["workdir"], exist_ok=True)
    if cfg.get("user"):
        _give_to_user(cfg["user"][0], cfg["user"][1])
    linux.prctl(linux.PR_SET_DUMPABLE, 0)  # commands cannot open /proc/1/fd (our socket, cgroup dir)
    return cgroup_fd, scratch_fd


def _give_to_user(uid: int, gid: int) -> None:
    """What a non-root USER must be able to write in every attempt: its shell state (cwd and exports
    kept across commands) and ``/logs`` (the verifier makes ``/logs/verifier`` afresh there)."""
    for path in (os.path.dirname(STATE_FILE), STATE_FILE):
        os.chown(path, uid, gid)
    if not os.path.isdir("/logs") or os.path.islink("/logs"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink("/logs")
        os.mkdir("/logs", 0o755)
    os.chown("/logs", uid, gid, follow_symlinks=False)


def _mount_overlay(cfg: dict[str, Any]) -> str:
    scratch = cfg["scratch"]
    size_mb = cfg["disk_mb"] if cfg["upper"] is None else 64
    inodes = max(4096, size_mb * INODES_PER_MB)  # a file table as big as the disk's blocks: filling it is ENOSPC
    linux.mount("tmpfs", scratch, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"size={size_mb}m,nr_inodes={inodes},mode=755")
    upper, work, merged = cfg["upper"] or f"{scratch}/u", cfg["work"] or f"{scratch}/w", f"{scratch}/m"
    for path in (upper, work, merged):
        os.makedirs(path, exist_ok=True)
    os.mkdir(f"{scratch}/shm", 0o1777)
    os.chmod(f"{scratch}/shm", 0o1777)
    if cfg["upper"] is None and cfg["id_base"]:
        os.chown(upper, cfg["id_base"], cfg["id_base"])  # the root directory belongs to root inside
        os.chown(f"{scratch}/shm", cfg["id_base"], cfg["id_base"])
    data = f"lowerdir={':'.join(cfg['lower'])},upperdir={upper},workdir={work}"
    linux.mount("overlay", merged, "overlay", linux.MS_NODEV, data)  # a device node in the image opens nothing
    return merged


def _mount_binds(root: str, binds: list[list[Any]], userns_fd: int | None) -> None:
    """Bind host directories into the root (a builder's download caches; read-only where the third
    item says so), idmapped in user-namespace mode so that root inside owns what it writes there as host
    root does."""
    for host_dir, inside, *flags in binds:
        readonly = bool(flags and flags[0])
        target = f"{root}{inside}"
        os.makedirs(target, exist_ok=True)
        if userns_fd is not None:
            linux.idmapped_mount(host_dir, target, userns_fd, readonly=readonly)
            continue
        linux.mount(host_dir, target, None, linux.MS_BIND)
        extra = linux.MS_RDONLY if readonly else 0
        linux.mount(host_dir, target, None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_NOSUID | linux.MS_NODEV | extra)


def _mount_pseudo(root: str, cfg: dict[str, Any]) -> None:
    nosuid = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC
    for sub in ("proc", "sys", "dev"):
        os.makedirs(f"{root}/{sub}", exist_ok=True)
    linux.mount("proc", f"{root}/proc", "proc", nosuid)
    if cfg["new_net"]:  # sysfs shows the mounter's net namespace: only when that is the attempt's own
        linux.mount("sysfs", f"{root}/sys", "sysfs", linux.MS_RDONLY | nosuid)
    linux.mount("tmpfs", f"{root}/dev", "tmpfs", linux.MS_NOSUID | linux.MS_NOEXEC, "mode=755,size=64k")
    old_umask = os.umask(0)
    try:
        for name, (major, minor) in _DEVICES.items():
            os.mknod(f"{root}/dev/{name}", 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        for name, target in _DEV_LINKS.items():
            os.symlink(target, f"{root}/dev/{name}")
        os.mkdir(f"{root}/dev/shm", 0o1777)
        os.mkdir(f"{root}/dev/pts", 0o755)
    finally:
        os.umask(old_umask)
    linux.mount(f"{cfg['scratch']}/shm", f"{root}/dev/shm", None, linux.MS_BIND)  # counts as disk
    gid = f",gid={cfg['id_base'] + 5}" if cfg["id_base"] else ""
    linux.mount("devpts", f"{root}/dev/pts", "devpts", linux.MS_NOSUID | linux.MS_NOEXEC,
                f"newinstance,ptmxmode=0666,mode=0620{gid}")
    if not cfg["id_base"]:  # host root inside: kernel settings read-only, kernel memory hidden
        _protect_proc(f"{root}/proc")


def _protect_proc(proc: str) -> None:
    """What Docker does for a container of host root: /proc/sys & co. read-only, /proc/kcore & co.
    masked. (In user-namespace mode they belong to a uid that root inside is not: no need.)"""
    for name in _PROC_READ_ONLY:
        path = f"{proc}/{name}"
        if os.path.exists(path):
            linux.mount(path, path, None, linux.MS_BIND | linux.MS_REC)
            linux.mount(path, path, None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY)
    for name in _PROC_MASKED:
        path = f"{proc}/{name}"
        if os.path.isfile(path):
            linux.mount("/dev/null", path, None, linux.MS_BIND)


def _configure_net(cfg: dict[str, Any]) -> None:
    if cfg.get("net_ready"):  # a namespace the zygote prepared while idle
        return
    linux.loopback_up()
    if cfg["id_base"]:  # root inside has no capability over this namespace: open low ports and ping
        linux.write_file("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0")
        linux.write_file("/proc/sys/net/ipv4/ping_group_range", "0 2147483647")


def _enter_userns(userns_fd: int) -> None:
    """Become uid 0 of the sandbox user namespace (an unprivileged uid on the host)."""
    linux.setns(userns_fd, linux.CLONE_NEWUSER)
    os.close(userns_fd)
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


# ---- the request loop ----------------------------------------------------------------------------------


class Holder:
    """Serves the host. Commands are spawned into their own pids cgroup ``c<N>`` without a cgroup move
    on the way: a move waits for an RCU grace period (milliseconds, more on a busy machine). The holder
    sits in the cgroup where the next command will start and spawns it from there; when a command
    leaves background processes behind, the holder steps into a fresh cgroup for the next one. Each
    command's reply names the next command's cgroup; the host never kills the holder with a command."""

    def __init__(self, sock: socket.socket, cgroup_fd: int, scratch_fd: int | None,
                 user: tuple[int, int, tuple[int, ...]] | None = None) -> None:
        self.sock, self.cgroup_fd, self.scratch_fd = sock, cgroup_fd, scratch_fd
        self.user = user  # (uid, gid, supplementary groups) every command runs as; None: root
        self.running: dict[int, str] = {}  # pid -> its pids cgroup name
        self.current = "c0"  # the cgroup the holder is in: where the next command starts
        self.forkfails_seen: dict[str, int] = {}
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
                    msg, payload, fds = recv(self.sock)
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
                self.report(cgroup, {"exit": _exit_code(status)})

    def report(self, cgroup: str, reply: dict[str, Any]) -> None:
        """Send a command's end to the host; step into a fresh cgroup if this one is still in use."""
        total = self.forkfail(cgroup)
        reply["forkfail"] = total - self.forkfails_seen.get(cgroup, 0)
        self.forkfails_seen[cgroup] = total
        busy = self.current == cgroup and not self.only_us(cgroup)
        reply.update(disk_free=self.disk_free(), next=f"c{int(cgroup[1:]) + 1}" if busy else self.current)
        send(self.sock, reply)
        if busy:
            self.move_to(reply["next"])

    def only_us(self, cgroup: str) -> bool:
        try:
            fd = os.open(f"{cgroup}/cgroup.procs", os.O_RDONLY, dir_fd=self.cgroup_fd)
        except OSError:
            return False
        try:
            pids = os.read(fd, 4096).split()
        finally:
            os.close(fd)
        return pids == [str(os.getpid()).encode()]

    def move_to(self, cgroup: str) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(cgroup, dir_fd=self.cgroup_fd)
        fd = os.open(f"{cgroup}/cgroup.procs", os.O_WRONLY, dir_fd=self.cgroup_fd)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
        self.current = cgroup

    def forkfail(self, cgroup: str) -> int:
        """Forks the process limit refused in the command's cgroup (cgroup v1 counts them locally)."""
        try:
            fd = os.open(f"{cgroup}/pids.events", os.O_RDONLY, dir_fd=self.cgroup_fd)
        except OSError:
            return 0
        try:
            text = os.read(fd, 256).decode()
        finally:
            os.close(fd)
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "max" and value.strip().isdigit():
                return int(value)
        return 0

    def disk_free(self) -> int:
        """Bytes the writable layer can still take (0 once its file table is full, too)."""
        if self.scratch_fd is None:
            return -1
        st = os.fstatvfs(self.scratch_fd)
        return st.f_bavail * st.f_frsize if st.f_favail > 16 else 0

    def handle(self, msg: dict[str, Any], payload: bytes, fds: list[int]) -> None:
        op = msg.get("op")
        try:
            if op == "exec":
                self.start(msg, fds)  # the reply ({"exit": code}) is sent when the command ends
            elif op == "pty":
                self.start_pty(msg)
            elif op == "put":
                _put(fds[0] if fds else None, payload)
                send(self.sock, {"ok": True})
            elif op == "read":
                send(self.sock, {"ok": True}, _read_regular(msg["path"]))
            elif op == "changes":
                send(self.sock, {"ok": True, "changes": _system_changes(self.scratch_fd)})
            elif op == "mkdirs":
                os.makedirs(msg["path"], exist_ok=True)
                send(self.sock, {"ok": True})
            else:
                send(self.sock, {"error": f"unknown request {op!r}"})
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            send(self.sock, {"missing": True})
        except (OSError, ValueError) as err:
            if isinstance(err, OSError) and err.errno == errno.ELOOP and op == "read":
                send(self.sock, {"missing": True})  # a symbolic link where a file was asked for
            else:
                send(self.sock, {"error": f"{op} failed: {err}"})
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def start(self, msg: dict[str, Any], fds: list[int]) -> None:
        actions: list[tuple[Any, ...]] = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0)]  # posix_spawn's
        actions += [(os.POSIX_SPAWN_DUP2, fds[0], 1), (os.POSIX_SPAWN_DUP2, fds[0], 2)]
        try:
            pid = self.spawn(msg, actions)
        except OSError as err:  # no such program, or the agent exhausted its process limit
            os.write(fds[0], f"albatross: cannot run {msg['argv'][0]}: {err.strerror}\n".encode())
            code = 127 if isinstance(err, FileNotFoundError) else 126
            self.report(self.current, {"exit": code, "spawn_error": err.errno})
            return
        self.running[pid] = self.current

    def start_pty(self, msg: dict[str, Any]) -> None:
        """An interactive command on a new terminal of the attempt's devpts; the master goes to the host."""
        import fcntl
        import struct

        master = os.open("/dev/pts/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(master, _TIOCSPTLCK, struct.pack("i", 0))
            number = struct.unpack("i", fcntl.ioctl(master, _TIOCGPTN, struct.pack("i", 0)))[0]
            slave = f"/dev/pts/{number}"
            actions: list[tuple[Any, ...]] = [(os.POSIX_SPAWN_OPEN, 0, slave, os.O_RDWR, 0)]
            actions += [(os.POSIX_SPAWN_DUP2, 0, 1), (os.POSIX_SPAWN_DUP2, 0, 2)]
            pid = self.spawn(msg, actions)  # setsid + open of the slave: it is the controlling tty
            self.running[pid] = self.current
            send(self.sock, {"ok": True}, fds=[master])
        finally:
            os.close(master)

    def spawn(self, msg: dict[str, Any], actions: list[tuple[Any, ...]]) -> int:
        """posix_spawn (vfork: ~3x faster than fork here) in its own session, in the holder's cgroup."""
        argv, env = msg["argv"], msg["env"]
        with contextlib.suppress(OSError):
            os.chdir(msg["cwd"])
        try:
            path = shutil.which(argv[0], path=env.get("PATH", DEFAULT_PATH)) or argv[0]
            if self.user is not None:
                return _fork_exec_as(self.user, path, argv, env, actions)
            return os.posix_spawn(path, argv, env, file_actions=actions, setsid=True, setsigdef=_SIGDEF)
        finally:
            os.chdir("/")


_SIGDEF = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT)


def _fork_exec_as(user: tuple[int, int, tuple[int, ...]], path: str, argv: list[str], env: dict[str, str],
                  actions: list[tuple[Any, ...]]) -> int:
    """What ``posix_spawn`` does (new session, the file actions, default signals), then become the
    image's USER (groups, gid, uid: every capability goes) and exec. A program that cannot run exits
    127 (not found) or 126 with a line on stderr, as a shell would."""
    pid = os.fork()
    if pid:
        return pid
    code = 126
    try:
        os.setsid()
        for action in actions:
            if action[0] == os.POSIX_SPAWN_OPEN:
                fd = os.open(action[2], action[3], action[4])
                if fd != action[1]:
                    os.dup2(fd, action[1])
                    os.close(fd)
            else:
                os.dup2(action[1], action[2])
        for sig in _SIGDEF:
            signal.signal(sig, signal.SIG_DFL)
        uid, gid, groups = user
        os.setgroups(list(groups))
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        os.execve(path, argv, env)
    except OSError as err:
        code = 127 if isinstance(err, FileNotFoundError) else 126
        with contextlib.suppress(OSError):
            os.write(2, f"albatross: cannot run {argv[0]}: {err.strerror}\n".encode())
    finally:
        os._exit(code)
    raise AssertionError("unreachable")


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _put(fd: int | None, payload: bytes) -> None:
    """Unpack a tar into the attempt's root: read from the pipe ``fd`` as it comes (the host writes it),
    or ``payload``; every path resolved inside the root, no device node made (``extract``)."""
    if fd is None:
        extract.unpack(io.BytesIO(payload), "/")
        return
    with os.fdopen(os.dup(fd), "rb", buffering=1 << 16) as stream:
        try:
            extract.unpack(stream, "/")
        finally:
            while stream.read(1 << 16):  # drain what is left, so the writer is never stuck
                pass


def _system_changes(scratch_fd: int | None, shown: int = 20, scanned: int = 5000) -> list[str]:
    """What the attempt wrote over the image's system paths (/usr, /etc, /bin, /lib ...): entries of its
    writable layer there (a deletion is a whiteout), the first ``shown`` of them and how many in all."""
    if scratch_fd is None:
        return []
    found: list[str] = []
    for name in TOOLCHAIN:
        try:
            st = os.stat(f"u/{name}", dir_fd=scratch_fd, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            found.append(f"/{name}")
            continue
        for top, _dirs, files, _fd in os.fwalk(f"u/{name}", dir_fd=scratch_fd):
            found += [f"{top[1:]}/{entry}" for entry in files]  # a deletion is a whiteout: a file too
            if len(found) > scanned:
                break
    total = len(found)
    return sorted(found)[:shown] + ([f"... {total - shown} more"] if total > shown else [])


def _read_regular(path: str) -> bytes:
    """A regular file's bytes; never blocks on a FIFO or device the agent put in the way, never
    follows a symbolic link (a link is reported as missing)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)  # a link is no file
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a directory, FIFO or device is not a file to read
            raise FileNotFoundError(path)
        if st.st_size > MAX_READ_BYTES:
            raise ValueError(f"{path}: larger than {MAX_READ_BYTES >> 20} MiB")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
