"""The attempts' seccomp filter, built with libseccomp (through ``pyseccomp``, its ctypes binding).

At least as strict as Docker's default profile for what an agent could use to reach past its attempt:
every syscall below fails with EPERM (``clone3`` with ENOSYS, so libc falls back to ``clone``, whose
flags the filter can see). Anything else is allowed; syscalls of another ABI (i386 ``int 0x80``) kill
the process (libseccomp's default for a foreign architecture).

- nested user namespaces: ``clone``/``unshare`` with CLONE_NEWUSER, ``setns`` (a user namespace of its
  own would give root inside every capability over new network, mount and pid namespaces)
- io_uring (``io_uring_setup/enter/register``): a large kernel surface Docker also refuses
- keyrings (``keyctl``, ``add_key``, ``request_key``): after the holder joined the attempt's own
  session keyring, nothing may touch a keyring
- ``bpf``, ``perf_event_open``, ``userfaultfd``, ``fanotify_init``, ``lookup_dcookie``, ``kcmp``,
  ``open_by_handle_at`` (reads files by handle, past the mount namespace), ``syslog``, ``acct``
- kernel modules, kexec, reboot, swap, clock and time setting, quotas, ``iopl``/``ioperm``
- mounting anything (the classic and the new mount API, ``pivot_root``, ``umount2``)

The filter is built once in the zygote (``build``) and loaded by each holder just before it serves
(``load``): every command of the attempt inherits it, and no_new_privs (set before) makes it stick.
"""

from __future__ import annotations

import contextlib
import errno
from typing import Any

CLONE_NEWUSER = 0x10000000
DENIED = (
    "setns", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "fanotify_init", "lookup_dcookie", "kcmp",
    "open_by_handle_at", "name_to_handle_at", "syslog", "acct",
    "init_module", "finit_module", "delete_module", "create_module", "query_module", "get_kernel_syms",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
    "clock_settime", "clock_adjtime", "settimeofday", "adjtimex", "stime",
    "quotactl", "quotactl_fd", "iopl", "ioperm", "nfsservctl", "uselib", "_sysctl", "vm86", "vm86old",
    "mount", "umount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr",
)
WITH_NEW_USER = ("unshare", "clone")  # denied only when the flags (argument 0) ask for a user namespace


def build() -> Any:
    """A libseccomp filter context (not loaded) denying ``DENIED`` and new user namespaces."""
    import pyseccomp as sc

    flt = sc.SyscallFilter(sc.ALLOW)
    with contextlib.suppress(OSError):  # a binary tree of syscall numbers: every syscall pays a few checks
        flt.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
    for name in DENIED:
        _add(flt, sc.ERRNO(errno.EPERM), name)
    for name in WITH_NEW_USER:
        _add(flt, sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    _add(flt, sc.ERRNO(errno.ENOSYS), "clone3")  # its flags are behind a pointer: make libc use clone
    return flt


def _add(flt: Any, action: int, name: str, *args: Any) -> None:
    """Add one rule; a syscall this architecture does not have is skipped."""
    try:
        flt.add_rule(action, name, *args)
    except (OSError, ValueError) as err:
        # pyseccomp raises OSError, or ValueError (no errno)
        if getattr(err, "errno", errno.EDOM) not in (errno.EDOM, errno.EINVAL, errno.EFAULT, None):
            raise


def load(flt: Any) -> None:
    """Install the filter on the calling process (inherited by all its future children)."""
    flt.load()
