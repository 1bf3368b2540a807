"""The Linux system calls the isolated backend needs, through ctypes (no compiler, no dependency)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import socket
import struct

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
_KEYCTL_JOIN_SESSION_KEYRING = 1
# New mount API; the numbers are the same on every architecture (unified syscall table).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _AT_EMPTY_PATH, _MOVE_MOUNT_F_EMPTY_PATH = 1, 0x1000, 4
_AT_RECURSIVE, _AT_SYMLINK_NOFOLLOW = 0x8000, 0x100
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_MOUNT_ATTR_IDMAP = 0x00100000
_AT_FDCWD = -100

_libc = ctypes.CDLL(None, use_errno=True)


def supported_machine() -> bool:
    return platform.machine() in _SYS_PIVOT_ROOT


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {fstype or source} on {target}",
    )


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int = 0) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def prctl(option: int, arg: int) -> None:
    zero = ctypes.c_ulong(0)
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), zero, zero, zero), f"prctl {option}")


def drop_bounding_caps(keep: set[int]) -> None:
    """Drop every capability not in ``keep`` from the bounding set (inherited by every later exec)."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if cap not in keep:
            prctl(PR_CAPBSET_DROP, cap)


def join_new_session_keyring() -> None:
    """Give the calling process (and its future children) a new anonymous session keyring."""
    number = _SYS_KEYCTL.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"keyctl: unknown syscall number on {platform.machine()}")
    _check(_libc.syscall(ctypes.c_long(number), ctypes.c_int(_KEYCTL_JOIN_SESSION_KEYRING), None),
           "keyctl join session keyring")


_PARK_STACK = ctypes.create_string_buffer(64 << 10)  # clone_parked children only ever run sleep() on it
_CLONE_VM = 0x00000100
_SIGCHLD = 17


def clone_parked(flags: int, seconds: int = 5) -> int:
    """clone(2) a child with ``flags`` (e.g. CLONE_NEWUSER) that shares our memory and only sleeps for
    ``seconds``, then exits: a cheap holder of new namespaces (no copy of our address space, no Python
    in the child). It holds copies of our file descriptors while it lives, so the caller kills and reaps
    it at once; if the caller dies first, it is gone ``seconds`` later. Returns its pid."""
    address = ctypes.cast(_libc.sleep, ctypes.c_void_p).value
    if address is None:
        raise OSError("libc has no sleep")
    sleep = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(address)
    top = ctypes.c_void_p((ctypes.addressof(_PARK_STACK) + len(_PARK_STACK) - 64) & ~15)
    return _check(_libc.clone(sleep, top, ctypes.c_int(flags | _CLONE_VM | _SIGCHLD), ctypes.c_void_p(seconds)),
                  "clone")


def pivot_root_here() -> None:
    """Make the current directory the root and detach the old root (runc's pivot_root(".", ".") trick)."""
    number = _SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown syscall number on {platform.machine()}")
    _check(_libc.syscall(ctypes.c_long(number), b".", b"."), "pivot_root")
    mount("none", ".", None, MS_REC | MS_PRIVATE)
    umount(".", MNT_DETACH)
    os.chdir("/")


def idmapped_mount(source: str, target: str, userns_fd: int, readonly: bool = False) -> None:
    """Mount a clone of ``source`` (one file system, not its sub-mounts) at ``target`` with its owners
    shifted by the user namespace's mapping: host uid 0 appears as the namespace's uid 0 (``readonly``:
    and read-only, nosuid, nodev)."""
    fd = _check(
        _libc.syscall(
            ctypes.c_long(_SYS_OPEN_TREE),
            ctypes.c_int(_AT_FDCWD),
            source.encode(),
            ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC),
        ),
        f"open_tree {source}",
    )
    try:
        flags = _MOUNT_ATTR_IDMAP | (_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV if readonly else 0)
        attr = ctypes.create_string_buffer(struct.pack("QQQQ", flags, 0, 0, userns_fd), 32)
        _check(
            _libc.syscall(
                ctypes.c_long(_SYS_MOUNT_SETATTR),
                ctypes.c_int(fd),
                b"",
                ctypes.c_uint(_AT_EMPTY_PATH),
                attr,
                ctypes.c_size_t(32),
            ),
            f"idmap {source}",
        )
        _check(
            _libc.syscall(
                ctypes.c_long(_SYS_MOVE_MOUNT),
                ctypes.c_int(fd),
                b"",
                ctypes.c_int(_AT_FDCWD),
                target.encode(),
                ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH),
            ),
            f"move_mount {source} to {target}",
        )
    finally:
        os.close(fd)


def clone_tree(path: str, recursive: bool = True, readonly: bool = False, userns_fd: int | None = None) -> int:
    """A detached copy of the mount tree at ``path`` (``open_tree`` clone; with its sub-mounts when
    ``recursive``; ``readonly``: read-only, nosuid, nodev; ``userns_fd``: owners shifted by that user
    namespace, as ``idmapped_mount``), as a descriptor to ``attach_tree`` elsewhere, even in another mount
    namespace. A file works as well as a directory."""
    flags = _OPEN_TREE_CLONE | os.O_CLOEXEC | (_AT_RECURSIVE if recursive else 0) | _AT_SYMLINK_NOFOLLOW
    fd = _check(_libc.syscall(ctypes.c_long(_SYS_OPEN_TREE), ctypes.c_int(_AT_FDCWD), path.encode(),
                              ctypes.c_uint(flags)), f"open_tree {path}")
    attrs = (_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV if readonly else 0)
    attrs |= _MOUNT_ATTR_IDMAP if userns_fd is not None else 0
    if attrs:
        attr = ctypes.create_string_buffer(struct.pack("QQQQ", attrs, 0, 0, userns_fd or 0), 32)
        try:
            _check(_libc.syscall(ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(fd), b"",
                                 ctypes.c_uint(_AT_EMPTY_PATH | (_AT_RECURSIVE if recursive else 0)), attr,
                                 ctypes.c_size_t(32)), f"read-only {path}")
        except OSError:
            os.close(fd)
            raise
    return fd


def attach_tree(fd: int, target: str) -> None:
    """Mount the detached tree ``fd`` (``clone_tree``) at ``target`` of the current mount namespace."""
    _check(_libc.syscall(ctypes.c_long(_SYS_MOVE_MOUNT), ctypes.c_int(fd), b"", ctypes.c_int(_AT_FDCWD),
                         target.encode(), ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH)), f"move_mount to {target}")


def loopback_up() -> None:
    """Bring up ``lo`` in the current network namespace (new ones start with it down)."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, siocgifflags, req))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def write_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def close_fds_except(keep: set[int]) -> None:
    low = 0
    for fd in [*sorted(keep), os.sysconf("SC_OPEN_MAX")]:
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
