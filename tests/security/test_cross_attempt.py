"""Attempts share nothing: keyrings, per-user kernel counts (inotify), files, processes, IPC, network."""

from __future__ import annotations

import ctypes
import os

import pytest
from _probes import SYSCALL, needs_local, py

pytestmark = needs_local


ADD_USER_KEY = SYSCALL + "print(*sc(248, b'user', b'albatross-probe', b'secret-42', 9, -4))"  # add_key to @u
FIND_USER_KEY = SYSCALL + ("buf = ctypes.create_string_buffer(64)\n"
                           "r, e = sc(250, 10, -4, b'user', b'albatross-probe', 0)\n"  # KEYCTL_SEARCH @u
                           "print('found' if r > 0 and sc(250, 11, r, buf, 64)[0] > 0 and b'secret' in buf.raw "
                           "else 'absent')")


def test_keyring_key_does_not_reach_the_next_attempt(backend) -> None:
    with backend.fork(None) as first:
        py(first, ADD_USER_KEY)
        with backend.fork(None) as second:
            assert py(second, FIND_USER_KEY).output.split()[-1] == "absent"


def _inotify_instances_possible() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        return False
    os.close(fd)
    return True


HOLD_128_INOTIFY = ("nohup /usr/bin/python3 -c 'import ctypes, time\n"
                    "l = ctypes.CDLL(None)\n"
                    "fds = [l.inotify_init1(0) for _ in range(128)]\n"
                    "open(\"/app/held\", \"w\").write(str(sum(f >= 0 for f in fds)))\n"
                    "time.sleep(60)' >/dev/null 2>&1 & "
                    "for i in $(seq 200); do [ -s /app/held ] && break; sleep 0.02; done; cat /app/held")


def test_inotify_instances_are_charged_to_the_attempt_not_host_root(backend) -> None:
    if not _inotify_instances_possible():
        pytest.skip("host root has no inotify instance left before the probe")
    with backend.fork(None) as hog:
        held = int(hog.exec(HOLD_128_INOTIFY, timeout_s=30).output.split()[-1])
        assert held > 0
        assert _inotify_instances_possible(), "an attempt's inotify instances exhausted host root's"
        with backend.fork(None) as other:
            code = "import ctypes; print(ctypes.CDLL(None).inotify_init1(0) >= 0)"
            assert py(other, code).output.split()[-1] == "True"


def test_files_of_one_attempt_are_invisible_to_another(backend) -> None:
    with backend.fork(None) as first, backend.fork(None) as second:
        first.exec("echo secret > /app/mine; echo secret > /tmp/mine; echo secret > /dev/shm/mine")
        out = second.exec("cat /app/mine /tmp/mine /dev/shm/mine 2>&1; ls /proc/*/root/app 2>/dev/null").output
        assert "secret" not in out


def test_processes_of_one_attempt_are_invisible_to_another(backend) -> None:
    with backend.fork(None) as first, backend.fork(None) as second:
        first.exec("nohup sleep 123 >/dev/null 2>&1 &")
        assert "sleep 123" not in second.exec("ps -eo args").output
        assert "sleep 123" in first.exec("ps -eo args").output


def test_signals_cannot_reach_host_pids(backend) -> None:
    with backend.fork(None) as attempt:
        result = attempt.exec(f"kill -9 {os.getpid()} 2>&1 && echo reached; kill -0 1 && echo own-init")
    assert "reached" not in result.output and "own-init" in result.output  # pid 1 is the attempt's holder


def test_sysv_shared_memory_is_per_attempt(backend) -> None:
    code = ("import ctypes; l = ctypes.CDLL(None, use_errno=True)\n"
            "print(l.shmget(0x4242, 4096, 0o1666))")  # IPC_CREAT with key 0x4242
    look = "import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.shmget(0x4242, 0, 0))"
    with backend.fork(None) as first, backend.fork(None) as second:
        assert int(py(first, code).output.split()[-1]) >= 0
        assert int(py(second, look).output.split()[-1]) == -1


def test_hostname_change_does_not_leak(backend) -> None:
    before = os.uname().nodename
    with backend.fork(None) as attempt:
        attempt.exec("hostname evil 2>/dev/null; python3 -c 'import socket; socket.sethostname(\"evil\")' 2>/dev/null")
        with backend.fork(None) as other:
            assert other.exec("hostname").output.strip() == "sandbox"
    assert os.uname().nodename == before


def test_network_is_loopback_only(backend) -> None:
    with backend.fork(None) as attempt:
        links = attempt.exec("ls /sys/class/net").output.split()
        reach = attempt.exec("timeout 3 bash -c 'echo > /dev/tcp/1.1.1.1/53' 2>&1 && echo connected").output
    assert links == ["lo"] and "connected" not in reach


def test_abstract_unix_socket_is_per_attempt(backend) -> None:
    serve = ("nohup /usr/bin/python3 -c 'import socket, time\n"
             "s = socket.socket(socket.AF_UNIX); s.bind(\"\\0albatross-probe\"); s.listen(); time.sleep(30)' "
             ">/dev/null 2>&1 & sleep 0.3")
    dial = ("import socket\ns = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect('\\0albatross-probe'); print('connected')\nexcept OSError: print('refused')")
    with backend.fork(None) as first, backend.fork(None) as second:
        first.exec(serve)
        assert py(first, dial).output.split()[-1] == "connected"
        assert py(second, dial).output.split()[-1] == "refused"
