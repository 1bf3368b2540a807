"""The layer store (``sandbox/layers.py``), the disk guard of builds and the wheel pick of uv images."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from albatross.sandbox.layers import DiskGuard, LayerStore, free_mb
from albatross.sandbox.rootfs import BaseUnavailable
from albatross.sandbox.wheels import pick_wheel


def test_persistent_store_commits_loads_and_keeps(tmp_path: Path) -> None:
    store = LayerStore(True, tmp_path)
    with store.locked("k1"):
        assert store.load("k1") is None
        build = store.new_build("k1")
        (build / "s0" / "layer").mkdir(parents=True)
        final = store.commit(build, "k1", {"layer": "s0/layer", "stack": []})
    assert final == tmp_path / "k1" and not build.exists()
    assert store.load("k1")["layer"] == "s0/layer"
    store.close()
    assert LayerStore(True, tmp_path).load("k1") is not None  # another run finds it
    assert (tmp_path.stat().st_mode & 0o777) == 0o700


def test_private_store_is_removed_and_half_builds_of_dead_processes_too(tmp_path: Path) -> None:
    dead = tmp_path / "k2.tmp-999999999-0"
    dead.mkdir(parents=True)
    mine = tmp_path / f"k3.tmp-{os.getpid()}-0"
    mine.mkdir()
    store = LayerStore(False, tmp_path)
    assert not dead.exists() and mine.exists()  # only a gone process's leftovers are removed
    build = store.new_build("k4")
    store.commit(build, "k4", {"stack": []})
    assert store.load("k4") is not None and store.root.parent == tmp_path
    store.close()
    assert not store.root.exists()


def test_unreadable_or_old_records_are_not_loaded(tmp_path: Path) -> None:
    store = LayerStore(True, tmp_path)
    (tmp_path / "k5").mkdir()
    (tmp_path / "k5" / "parent.json").write_text("{not json")
    (tmp_path / "k6").mkdir()
    (tmp_path / "k6" / "parent.json").write_text('{"format": "0"}')
    assert store.load("k5") is None and store.load("k6") is None


def test_disk_guard_refuses_and_stops_below_the_reserve(tmp_path: Path) -> None:
    assert DiskGuard(tmp_path, 0).problem() == ""
    guard = DiskGuard(tmp_path, free_mb(tmp_path) + (1 << 30), poll_s=0.01)
    assert "the build filled the disk" in guard.problem() and "build_min_free_mb" in guard.problem()
    stopped = []
    with guard.watching(lambda: stopped.append(1)) as full:
        time.sleep(0.2)
    assert stopped == [1] and full and "MiB free" in full[0]


def test_uv_wheel_is_the_manylinux_one_of_the_machine() -> None:
    files = [{"filename": f"uv-0.8.14-py3-none-{tag}.whl", "url": tag} for tag in
             ("macosx_10_12_x86_64", "musllinux_1_1_x86_64", "manylinux_2_17_x86_64.manylinux2014_x86_64",
              "manylinux_2_17_aarch64.manylinux2014_aarch64")]
    assert pick_wheel(files, "uv", "0.8.14", "x86_64")["url"].startswith("manylinux_2_17_x86_64")
    assert "aarch64" in pick_wheel(files, "uv", "0.8.14", "aarch64")["url"]
    with pytest.raises(BaseUnavailable, match="no manylinux x86_64 wheel of uv 0.8.15"):
        pick_wheel(files, "uv", "0.8.15", "x86_64")
