"""Kernel interfaces an attempt must not reach (Docker's default seccomp profile and more). Each probe
makes the call from inside an attempt and checks that the kernel refused it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _probes import SYSCALL, needs_local, py

from albatross.sandbox import LocalBackend
from albatross.sandbox.local import LocalAttempt

pytestmark = needs_local
EPERM, ENOSYS = 1, 38
# x86_64 syscall numbers (aarch64 uses the unified table for the newer ones)
NR = {"io_uring_setup": 425, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250,
      "add_key": 248, "setns": 308, "clone3": 435, "init_module": 175, "finit_module": 313,
      "delete_module": 176, "clock_settime": 227, "settimeofday": 164, "kexec_load": 246, "reboot": 169,
      "swapon": 167, "fsopen": 430, "open_tree": 428, "mount": 165, "unshare": 272, "adjtimex": 159}


@pytest.fixture(scope="module")
def attempt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAttempt]:
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("syscall numbers below are x86_64's")
    backend = LocalBackend(warm=0, hide_paths=[tmp_path_factory.getbasetemp()])
    attempt = backend.fork(None)
    yield attempt
    attempt.close()
    backend.close()


def call(attempt: LocalAttempt, expr: str) -> tuple[int, int]:
    """(result, errno) of ``expr`` (calls of ``sc``) run inside the attempt."""
    out = py(attempt, SYSCALL + f"print(*{expr})").output.split()
    return int(out[-2]), int(out[-1])


def test_nested_user_namespace_unshare_urn(attempt) -> None:
    result = attempt.exec("unshare -Urn true; echo rc=$?")
    assert "rc=0" not in result.output


def test_veth_creation_in_a_nested_namespace(attempt) -> None:
    result = attempt.exec("unshare -Urn ip link add v0 type veth peer name v1 && echo made")
    assert "made" not in result.output


def test_nested_mount_namespace_mount(attempt) -> None:
    result = attempt.exec("unshare -Urm sh -c 'mount -t tmpfs none /mnt && echo mounted'")
    assert "mounted" not in result.output


def test_unshare_syscall_with_newuser(attempt) -> None:
    assert call(attempt, f"sc({NR['unshare']}, 0x10000000)") == (-1, EPERM)


def test_clone3_is_unavailable(attempt) -> None:
    """clone3's flags are behind a pointer the filter cannot read: libc falls back to clone."""
    assert call(attempt, f"sc({NR['clone3']}, 0, 0)") == (-1, ENOSYS)


def test_setns(attempt) -> None:
    code = f"fd = os.open('/proc/self/ns/net', os.O_RDONLY); print(*sc({NR['setns']}, fd, 0))"
    out = py(attempt, SYSCALL + code).output.split()
    assert (int(out[-2]), int(out[-1])) == (-1, EPERM)


def test_io_uring_setup(attempt) -> None:
    assert call(attempt, f"sc({NR['io_uring_setup']}, 8, ctypes.create_string_buffer(120))") == (-1, EPERM)


def test_bpf(attempt) -> None:
    attr = "ctypes.create_string_buffer(b'\\x02' + bytes(127))"  # BPF_MAP_CREATE of an array map
    assert call(attempt, f"sc({NR['bpf']}, 0, {attr}, 128)") == (-1, EPERM)


def test_perf_event_open(attempt) -> None:
    attr = "ctypes.create_string_buffer(bytes(4) + (112).to_bytes(4, 'little') + bytes(8) + bytes(104))"
    result, err = call(attempt, f"sc({NR['perf_event_open']}, {attr}, 0, -1, -1, 0)")
    assert (result, err) == (-1, EPERM)


def test_userfaultfd_user_mode_only(attempt) -> None:
    assert call(attempt, f"sc({NR['userfaultfd']}, 1)") == (-1, EPERM)


def test_add_key_to_session_keyring(attempt) -> None:
    code = f"sc({NR['add_key']}, b'user', b'probe', b'secret', 6, -3)"  # KEY_SPEC_SESSION_KEYRING
    assert call(attempt, code) == (-1, EPERM)


def test_keyctl(attempt) -> None:
    assert call(attempt, f"sc({NR['keyctl']}, 0, -4, 0)") == (-1, EPERM)  # GET_KEYRING_ID of @u


@pytest.mark.parametrize("name,args", [("init_module", "0, 0, b''"), ("finit_module", "0, b'', 0"),
                                       ("delete_module", "b'loop', 0")])
def test_kernel_module_calls(attempt, name: str, args: str) -> None:
    assert call(attempt, f"sc({NR[name]}, {args})") == (-1, EPERM)


@pytest.mark.parametrize("name,args", [("clock_settime", "0, ctypes.create_string_buffer(16)"),
                                       ("settimeofday", "ctypes.create_string_buffer(16), 0"),
                                       ("adjtimex", "ctypes.create_string_buffer(208)")])
def test_clock_calls(attempt, name: str, args: str) -> None:
    assert call(attempt, f"sc({NR[name]}, {args})") == (-1, EPERM)


@pytest.mark.parametrize("name,args", [("kexec_load", "0, 0, 0, 0"), ("reboot", "0, 0, 0, 0"),
                                       ("swapon", "b'/app/swap', 0")])
def test_machine_calls(attempt, name: str, args: str) -> None:
    assert call(attempt, f"sc({NR[name]}, {args})") == (-1, EPERM)


@pytest.mark.parametrize("name,args", [("mount", "b'none', b'/mnt', b'tmpfs', 0, 0"), ("fsopen", "b'tmpfs', 0"),
                                       ("open_tree", "-100, b'/', 1")])
def test_mount_calls(attempt, name: str, args: str) -> None:
    assert call(attempt, f"sc({NR[name]}, {args})") == (-1, EPERM)


def test_sysrq_trigger_is_not_writable(attempt) -> None:
    assert "wrote" not in attempt.exec("echo h > /proc/sysrq-trigger && echo wrote").output


def test_ptrace_of_the_holder(attempt) -> None:
    code = "import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.ptrace(16, 1, 0, 0), ctypes.get_errno())"
    out = py(attempt, code).output.split()
    assert int(out[-2]) == -1


def test_i386_syscalls_are_refused(attempt) -> None:
    """A syscall through the 32-bit ABI (int 0x80) kills the process: the filter covers only x86_64."""
    code = ("import ctypes, mmap\n"
            "buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
            "buf.write(bytes([0xb8, 20, 0, 0, 0, 0xcd, 0x80, 0xc3]))\n"  # mov eax, 20 (getpid); int 0x80; ret
            "f = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))\n"
            "print('got', f())\n")
    result = py(attempt, code)
    assert "got " not in result.output and result.exit_code == 128 + 31, result.output  # SIGSYS
