"""Device nodes: only the devices Docker gives a container (null, zero, full, random, urandom, tty, ptmx,
shm) are usable in an attempt or a build. A device node an image layer or an ADD archive carries is never
created, and the attempt's root is mounted ``nodev``, so a node that got there anyway opens nothing."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _probes import needs_local

from albatross.sandbox import LocalBackend, images
from sandbox_util import task_env


def char_device(name: str, major: int, minor: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor, info.mode = tarfile.CHRTYPE, major, minor, 0o666
    return info


def device_layer(*infos: tarfile.TarInfo) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info in infos:
            tar.addfile(info)
    return buf.getvalue()


def test_image_layer_device_nodes_are_not_created(tmp_path: Path) -> None:
    """kvm (10:232), loop-control (10:237) and the memory device (1:1) in a layer: no node on disk."""
    root = tmp_path / "root"
    root.mkdir()
    try:
        images.apply_layer(root, io.BytesIO(device_layer(
            char_device("opt/kvm", 10, 232), char_device("opt/loop-control", 10, 237),
            char_device("opt/mem", 1, 1))))
    except images.EnvBuildError:
        pass  # refusing the layer is fine too
    made = [p for p in (root / "opt").iterdir()] if (root / "opt").is_dir() else []
    assert not [p for p in made if p.is_char_device() or p.is_block_device()], made


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBackend]:
    backend = LocalBackend(warm=0, hide_paths=[tmp_path_factory.getbasetemp()])
    yield backend
    backend.close()


@needs_local
def test_attempt_root_and_writable_mounts_are_nodev(backend: LocalBackend) -> None:
    """The overlay root, /dev/shm and /tmp-like places carry nodev: a node found there opens nothing."""
    with backend.fork(None) as attempt:
        mounts = attempt.exec("cat /proc/self/mountinfo").output.splitlines()
    options = {line.split()[4]: line.split()[5] for line in mounts}
    assert "nodev" in options["/"].split(","), options["/"]
    assert "nodev" in options["/dev/shm"].split(","), options["/dev/shm"]


@needs_local
def test_add_of_an_archive_with_device_nodes_gives_no_usable_device(tmp_path: Path) -> None:
    """ADD extracts a local tar in the builder; without a user namespace the builder is host root, which
    could make any node. The zero device (1:5) planted this way must not read as zeros in an attempt."""
    env = task_env(tmp_path, "FROM python:3.11-slim-bookworm\nADD devs.tar /opt/\n")
    (env / "devs.tar").write_bytes(device_layer(char_device("zero", 1, 5), char_device("kvm", 10, 232)))
    backend = LocalBackend(warm=0, userns=False, hide_paths=[tmp_path])
    try:
        with backend.fork(env) as attempt:
            result = attempt.exec("head -c 4 /opt/zero | od -An -tx1; ls -l /opt", timeout_s=20)
    finally:
        backend.close()
    assert "00 00 00 00" not in result.output, result.output
