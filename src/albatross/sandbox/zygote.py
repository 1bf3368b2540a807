"""The zygote: one small single-threaded Python process per backend that forks the attempts' holders.

It lives in a private mount namespace holding, on a tmpfs, its scratch space and the base root file
systems' mounts, so no mount of ours ever appears on the host; the parents' layers are directories of
the layer store on the host's disk (``layers.py``), made here (``parent_new``). At start it creates the sandbox user namespace
(uid 0 inside = ``id_base`` on the host) and mounts the base roots *idmapped* into it, so files the
host owns as root are owned by root inside. It drops the dangerous capabilities from its bounding set,
which every command of every attempt inherits. While idle it prepares network namespaces with loopback
up, so forking an attempt does not wait for the kernel to build one.

Per attempt: unshare the mount/pid/ipc/uts namespaces (and take a prepared network namespace), fork the
holder (pid 1 of the new pid namespace), and step back into its own namespaces with setns. In
user-namespace mode each attempt also gets a user namespace of its own (same mapping as the shared one,
so the idmapped layers look the same), created by a host uid no other live attempt uses
(``creator_uid``): the kernel charges per-user counts (inotify instances and watches, user namespaces,
keyrings, ...) to that uid, so one attempt cannot exhaust them for another or for host root, and each
attempt's user keyring is its own. The seccomp filter (``seccomp.py``) is built here once; each holder
loads it.

Holders die with the zygote (parent-death signal SIGKILL): the parent layers and base mounts they were
built on live in the zygote's mount namespace, which goes away with it. The host side (``Zygote``) then
raises ``ZygoteDied`` and the backend starts a fresh zygote (``LocalBackend`` recovery).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albatross.sandbox import linux
from albatross.sandbox.base import ForkError, SandboxError
from albatross.sandbox.holder import KEPT_CAPS, holder_main
from albatross.sandbox.wire import recv, send

if TYPE_CHECKING:
    from albatross.sandbox.build import Parent

ID_COUNT = 65536
NETNS_POOL = 4
CREATOR_BASE = 2_000_000_000  # host uids that create the attempts' user namespaces (see creator_uid)
CREATOR_COUNT = 100_000_000


class ZygoteState:
    """What the zygote keeps between requests: its root, namespaces, bases and seccomp filter."""

    def __init__(self, root: str, opts: dict[str, Any]) -> None:
        self.root, self.id_base = root, int(opts["id_base"])
        self.layers = os.path.realpath(opts["layers"])  # the layer store: parent_new makes directories only there
        self.userns_fd: int | None = _make_userns(self.id_base) if self.id_base else None
        self.own_ns = [os.open(f"/proc/self/ns/{ns}", os.O_RDONLY) for ns in ("mnt", "pid", "net", "ipc", "uts")]
        self.netns: list[int] = []
        self.netns_target = int(opts.get("netns_pool", NETNS_POOL))
        self.bases: dict[str, str] = {}
        self.pidfd = os.pidfd_open(os.getpid())  # holders check it: did we die before they set PDEATHSIG?
        self.spawned = 0
        self.userns: list[int] = []  # attempts' user namespaces made while idle (fds)
        self.own_userns = bool(self.id_base)  # False once making one failed: attempts share userns_fd
        self.seccomp, self.seccomp_error = _build_seccomp()

    def wants_work(self) -> bool:
        """Idle work left: network or user namespaces to prepare."""
        return len(self.netns) < self.netns_target or (self.own_userns and len(self.userns) < self.netns_target)

    def fill(self) -> None:
        """Prepare one namespace of each kind that is short (forking waits for neither then)."""
        if len(self.netns) < self.netns_target:
            self.fill_netns()
        if self.own_userns and len(self.userns) < self.netns_target:
            self.userns.append(self._new_userns())

    def _new_userns(self) -> int:
        try:
            return _make_userns(self.id_base, self.creator_uid())
        except OSError as err:  # clone refused (user namespaces forbidden): fall back to the shared one
            if "clone" in str(err):
                self.own_userns = False
            raise

    def take_userns(self) -> int | None:
        """A user namespace fd for one attempt, its own (prepared, or made now) where possible, else a
        copy of the shared one's; None without user namespaces."""
        if self.userns_fd is None:
            return None
        if self.userns:
            return self.userns.pop(0)
        if self.own_userns:
            with contextlib.suppress(OSError):
                return self._new_userns()
        return os.dup(self.userns_fd)

    def creator_uid(self) -> int:
        """A host uid for the next attempt's user namespace: per zygote and attempt, so live attempts
        (of this and of other zygotes) practically never share one."""
        self.spawned += 1
        return CREATOR_BASE + ((os.getpid() << 16) + self.spawned) % CREATOR_COUNT

    def fill_netns(self) -> None:
        """Prepare one network namespace with loopback up (and, with a user namespace, low ports open)."""
        linux.unshare(linux.CLONE_NEWNET)
        try:
            linux.loopback_up()
            if self.id_base:
                linux.write_file("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0")
                linux.write_file("/proc/sys/net/ipv4/ping_group_range", "0 2147483647")
            self.netns.append(os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
        finally:
            linux.setns(self.own_ns[2], linux.CLONE_NEWNET)


def _build_seccomp() -> tuple[Any, str]:
    """The attempts' seccomp filter, or None and why it cannot be built (forks then fail, saying so)."""
    try:
        from albatross.sandbox import seccomp

        return seccomp.build(), ""
    except (ImportError, OSError, ValueError) as err:
        return None, f"cannot build the seccomp filter (pip install pyseccomp; needs libseccomp.so.2): {err}"


def _make_userns(id_base: int, creator: int = 0) -> int:
    """Create a sandbox user namespace (uid/gid 0..65535 inside = id_base.. on the host) owned by host
    uid ``creator`` (charged for what the namespace's users count against per-user limits). A child
    cloned straight into it (sharing our memory, parked in sleep()) holds it while we write its maps."""
    for tries_left in (2, 1, 0):
        if creator:
            os.setresuid(0, creator, 0)  # the owner is the effective uid; the saved uid is the way back
        try:
            pid = linux.clone_parked(linux.CLONE_NEWUSER)
        finally:
            if creator:
                os.setresuid(0, 0, 0)
        try:
            for name in ("uid_map", "gid_map"):
                linux.write_file(f"/proc/{pid}/{name}", f"0 {id_base} {ID_COUNT}\n")
            return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # the child's sleep ran out first (we were not scheduled for seconds): again
            if not tries_left:
                raise
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):  # with SIGCHLD ignored the kernel reaps it
                os.waitpid(pid, 0)
    raise AssertionError("unreachable")


def zygote_main() -> None:
    """Entry point of the zygote process (``python -c ... zygote_main()`` ROOT CONTROL_FD OPTIONS)."""
    root, ctrl = sys.argv[1], socket.socket(fileno=int(sys.argv[2]))
    opts = json.loads(sys.argv[3])
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount("none", "/", None, linux.MS_REC | linux.MS_PRIVATE)
    linux.mount("tmpfs", root, "tmpfs", 0, "mode=711")
    for sub in ("scratch", "bases"):
        os.mkdir(f"{root}/{sub}")
    state = ZygoteState(root, opts)
    linux.drop_bounding_caps(KEPT_CAPS)
    gc.freeze()  # holders are forks of us: a collection in one would touch (and copy) every page
    _serve(ctrl, state)


def _serve(ctrl: socket.socket, state: ZygoteState) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # holders are reaped by the kernel as they exit
    poller = select.poll()
    poller.register(ctrl, select.POLLIN)
    while True:
        if not poller.poll(0 if state.wants_work() else None):
            with contextlib.suppress(OSError):
                state.fill()
            continue
        try:
            msg, _payload, fds = recv(ctrl)
        except (EOFError, OSError):
            return
        out: list[int] = []
        try:
            reply, out = _handle(state, msg, fds)
        except Exception as err:  # noqa: BLE001 - every failure goes back to the host
            reply = {"error": str(err)}
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        try:
            send(ctrl, reply, fds=out)
        finally:
            for fd in out:
                os.close(fd)


def _handle(state: ZygoteState, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    """The reply to one request, and the descriptors that go with it (closed here once sent)."""
    op = msg["op"]
    if op == "spawn":
        pid, listener = _spawn_holder(state, msg["cfg"], fds[0])
        return {"pid": pid}, [] if listener is None else [listener]
    if op == "verify":
        from albatross.sandbox import verifier

        return {"pid": verifier.start(state, msg, fds)}, []
    return _handle_plain(state, msg), []


def _handle_plain(state: ZygoteState, msg: dict[str, Any]) -> dict[str, Any]:
    op = msg["op"]
    if op == "base":
        return {"lower": _mount_base(state, msg["name"], msg["path"])}
    if op == "parent_new":
        return _parent_new(state, msg["top"], msg["hide"], msg["base"])
    if op == "export_root":
        _export_root(msg["base"], msg["layers"], msg["dest"])
        return {"root": msg["dest"]}
    raise ValueError(f"unknown zygote request {op!r}")


def _export_root(base: str, layers: list[str], dest: str) -> None:
    """Write the merged root of a built stage to ``dest``, a host directory (for ``COPY --from``; the
    host cannot see our mounts): the base hard-linked (same file system: no copy), then each overlay
    layer, bottom to top, with its whiteouts and opaque directories applied. A file a layer changes
    replaces the link, so the base is never written to."""
    if os.path.exists(dest):
        raise ValueError(f"refusing to export over {dest}")
    proc = subprocess.run(["cp", "-al", "--", base, dest], capture_output=True, text=True)
    if proc.returncode != 0:
        raise OSError(f"cp -al {base} {dest}: {proc.stderr.strip()[-300:]}")
    for layer in layers:
        _apply_overlay_layer(layer, dest)


def _apply_overlay_layer(layer: str, dest: str) -> None:
    for top, dirs, files in os.walk(layer):
        rel = os.path.relpath(top, layer)
        target_dir = os.path.normpath(os.path.join(dest, rel))
        if rel != "." and _is_opaque(top) and os.path.isdir(target_dir):
            for child in os.listdir(target_dir):
                _remove_path(os.path.join(target_dir, child))
        for name in [*dirs, *files]:
            src, dst = os.path.join(top, name), os.path.join(target_dir, name)
            st = os.lstat(src)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # whiteout: deleted in this layer
                _remove_path(dst)
            elif stat.S_ISDIR(st.st_mode):
                if not os.path.isdir(dst) or os.path.islink(dst):
                    _remove_path(dst)
                    os.mkdir(dst, stat.S_IMODE(st.st_mode))
            else:
                _remove_path(dst)
                if stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(src), dst)
                elif stat.S_ISREG(st.st_mode):
                    shutil.copy2(src, dst)


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def _remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _mount_base(state: ZygoteState, name: str, path: str) -> str:
    """The lower directory for a base root: itself, or (user namespace) an idmapped mount of it."""
    if state.userns_fd is None:
        return path
    if name not in state.bases:
        target = f"{state.root}/bases/{name}"
        os.mkdir(target)
        linux.idmapped_mount(path, target, state.userns_fd)
        state.bases[name] = target
    return state.bases[name]


def _parent_new(state: ZygoteState, top: str, hide: list[str], base: str) -> dict[str, str]:
    """A new layer (and overlay work directory) in ``top``, a fresh directory of the layer store; the
    hidden paths made empty in it."""
    top = os.path.realpath(top)
    if not top.startswith(f"{state.layers}/") or os.path.exists(top):
        raise ValueError(f"refusing to make a layer at {top}")
    layer, work = f"{top}/layer", f"{top}/work"
    os.makedirs(layer)
    os.makedirs(work)
    os.chown(layer, state.id_base, state.id_base)
    for path in hide:
        _hide(layer, path, base, state.id_base)
    return {"layer": layer, "work": work}


def _hide(layer: str, path: str, base: str, id_base: int) -> None:
    """Make ``path`` an empty opaque directory (or a whiteout, for a file) in the overlay layer.

    A path missing from the base becomes an empty directory too, so it stays hidden if created later.
    Directories on the way keep the base's mode and owner (shifted into the user namespace)."""
    parts = Path(path).parts[1:]
    for i in range(1, len(parts) + 1):
        seen, target = os.path.join(base, *parts[:i]), os.path.join(layer, *parts[:i])
        try:
            st = os.lstat(seen)
        except OSError:
            st = None
        if i == len(parts) and st is not None and not stat.S_ISDIR(st.st_mode):
            os.mknod(target, stat.S_IFCHR, os.makedev(0, 0))  # overlay whiteout
            return
        if not os.path.isdir(target):
            os.mkdir(target, 0o755)
            uid, gid = (0, 0) if st is None else (st.st_uid, st.st_gid)
            if st is not None and stat.S_ISDIR(st.st_mode):
                os.chmod(target, stat.S_IMODE(st.st_mode))
            os.chown(target, id_base + uid if uid < ID_COUNT else uid, id_base + gid if gid < ID_COUNT else gid)
    os.setxattr(os.path.join(layer, *parts), "trusted.overlay.opaque", b"y")


def _spawn_holder(state: ZygoteState, cfg: dict[str, Any], sock_fd: int) -> tuple[int, int | None]:
    """Unshare the namespaces, fork the holder (pid 1 of the new pid namespace), and step back into
    our own namespaces (setns), so no intermediate process is needed. With a network policy other than
    none (``cfg["proxy"]``), also the egress proxy's listening socket, made in the attempt's network
    namespace on its 127.0.0.1 (returned as a descriptor for the host)."""
    netns = state.netns.pop(0) if cfg["new_net"] and state.netns else None
    flags = linux.CLONE_NEWNS | linux.CLONE_NEWPID | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS
    if cfg["new_net"] and netns is None:
        flags |= linux.CLONE_NEWNET
    cfg = {**cfg, "net_ready": netns is not None, "id_base": state.id_base,
           "seccomp_error": state.seccomp_error}
    userns_fd = state.take_userns()
    try:
        linux.unshare(flags)
        if netns is not None:
            linux.setns(netns, linux.CLONE_NEWNET)
        pid = os.fork()
        if pid == 0:
            _become_holder(state, cfg, sock_fd, userns_fd)
        listener = _proxy_listener() if cfg.get("proxy", "none") != "none" else None
    finally:
        for fd in state.own_ns:
            linux.setns(fd)
        for held in (netns, userns_fd):
            if held is not None:
                os.close(held)
    return pid, listener


def _proxy_listener() -> int:
    """A listening socket on 127.0.0.1:3128 of the current (the attempt's) network namespace."""
    from albatross.sandbox.egress import listen_socket

    linux.loopback_up()  # a namespace not prepared ahead has loopback down: 127.0.0.1 is not there yet
    return listen_socket().detach()


def _become_holder(state: ZygoteState, cfg: dict[str, Any], sock_fd: int, userns_fd: int | None) -> None:
    try:
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the zygote (set again in holder_main)
        gc.disable()  # a holder allocates little and lives for one attempt
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        keep = {0, 1, 2, sock_fd, state.pidfd} | ({userns_fd} if userns_fd is not None else set())
        linux.close_fds_except(keep)
    finally:
        holder_main(cfg, sock_fd, userns_fd, state.pidfd, state.seccomp)


# ---- host side: the zygote client ----------------------------------------------------------------------


def _module_dirs(name: str) -> list[str]:
    """The directory a module is imported from here (the zygote runs without site-packages)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    return [str(Path(spec.origin).parent)] if spec is not None and spec.origin else []


class ZygoteDied(ForkError):
    """The zygote process is gone (killed, crashed): every holder, parent layer and base mount it held
    went with it. The backend starts a fresh one."""


class Zygote:
    """Starts the zygote process and sends it requests (one at a time). ``parents``, ``lowers`` and
    ``base_lowers`` are the host's record of what lives in this zygote's mount namespace (they die with it)."""

    def __init__(self, id_base: int, layers: str | Path) -> None:
        import albatross

        self.parents: dict[str, Parent] = {}  # env key -> the parent whose layer this zygote holds
        self.lowers: dict[str, list[str]] = {}  # env key -> the lower directories under its parent's layer
        self.base_lowers: dict[str, str] = {}  # base key -> its lower directory here, once mounted
        self.dead = False  # a request found it gone
        self.root = tempfile.mkdtemp(prefix="albatross-zygote-")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        src = str(Path(albatross.__file__).resolve().parents[1])
        # -S: no site-packages (a smaller process forks faster); the zygote needs only the stdlib
        late = _module_dirs("pyseccomp")  # after the stdlib: nothing else of site-packages shadows it
        code = (f"import sys; sys.path.insert(0, {src!r}); sys.path += {late!r}; "
                "from albatross.sandbox.zygote import zygote_main; zygote_main()")
        opts = json.dumps({"id_base": id_base, "layers": str(layers)})
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", code, self.root, str(theirs.fileno()), opts],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    def died_within(self, timeout_s: float) -> bool:
        """True if the zygote is gone or exits within ``timeout_s`` (after a holder of it died)."""
        if not self.alive():
            return True
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)
        return not self.alive()

    def request(self, msg: dict[str, Any], fds: Iterable[int] = ()) -> dict[str, Any]:
        reply, got = self.request_fds(msg, fds)
        for fd in got:
            os.close(fd)
        return reply

    def request_fds(self, msg: dict[str, Any], fds: Iterable[int] = ()) -> tuple[dict[str, Any], list[int]]:
        """``request``, with the descriptors that came back (the caller closes them)."""
        with self.lock:
            try:
                if self.dead:
                    raise EOFError("it died earlier")
                send(self.sock, msg, fds=fds)
                reply, _payload, got = recv(self.sock)
            except (EOFError, OSError) as err:
                self.dead = True
                raise ZygoteDied(f"sandbox zygote {self.proc.pid} died (exit code {self.proc.poll()}): {err}") \
                    from err
        if "error" in reply:
            for fd in got:
                os.close(fd)
            kind = ForkError if msg["op"] == "spawn" else SandboxError
            raise kind(f"sandbox zygote: {msg['op']} failed: {reply['error']}")
        return reply, got

    def close(self) -> None:
        """Stop the zygote (or reap it, if it died) and remove its directory. Idempotent."""
        with self.lock:  # never close the socket under a request in flight (its fd could be reused)
            self.dead = True
            self.sock.close()  # the zygote exits on EOF, and its mount namespace with it
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.rmdir(self.root)
