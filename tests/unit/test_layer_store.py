"""The layer store (``sandbox/layers.py``), the disk guard of builds and the wheel pick of uv images."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from albatross.sandbox.layers import DiskGuard, LayerStore, free_mb, wait_pruned
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


def _parent(store: LayerStore, key: str, mib: int, used: float) -> None:
    """A committed parent of ``mib`` MiB whose record was last loaded at ``used``."""
    build = store.new_build(key)
    (build / "s0" / "layer").mkdir(parents=True)
    (build / "s0" / "layer" / "blob").write_bytes(os.urandom(mib << 20))
    store.commit(build, key, {"layer": "s0/layer", "stack": []})
    wait_pruned(store.root, 30)  # a capped store's background prune, if the build started one
    os.utime(tmp := store.path(key) / "parent.json", (used, used))
    assert tmp.stat().st_mtime == used


def test_prune_removes_the_least_recently_used_parents_no_process_holds(tmp_path: Path) -> None:
    from albatross.sandbox.layers import parents, prune

    store = LayerStore(True, tmp_path)
    now = time.time()
    for i, key in enumerate(["old", "older", "oldest", "new"]):
        _parent(store, key, 1, now - {"new": 10, "old": 3000, "older": 4000, "oldest": 5000}[key] - i)
    other = LayerStore(True, tmp_path)  # another run using "oldest"
    other.hold("oldest")
    assert [p["key"] for p in parents(tmp_path)] == ["oldest", "older", "old", "new"]
    assert all(p["bytes"] >= 1 << 20 for p in parents(tmp_path))

    assert prune(tmp_path, everything=True, dry_run=True)["removed"] == ["older", "old", "new"]
    assert len(parents(tmp_path)) == 4  # a dry run removes nothing
    result = prune(tmp_path, max_bytes=int(2.5 * (1 << 20)))  # two of the four fit: the two oldest not held go
    assert result["removed"] == ["older", "old"] and result["in_use"] == 1 and result["kept"] == 2
    assert [p["key"] for p in parents(tmp_path)] == ["oldest", "new"]
    assert not (tmp_path / "old").exists() and not (tmp_path / "old.use").exists()
    assert store.load("old") is None  # gone: a later run builds it again

    assert prune(tmp_path, unused_s=60)["removed"] == []  # "oldest" is held, "new" was used 10 s ago
    other.close()
    assert prune(tmp_path, unused_s=60)["removed"] == ["oldest"]
    store.load("new")  # loading marks it used now
    assert time.time() - parents(tmp_path)[0]["used"] < 60
    store.close()


def test_a_capped_store_prunes_itself_after_each_build_keeping_what_it_built(tmp_path: Path) -> None:
    cap = int(2.5 * (1 << 20))
    now = time.time()
    for key, used in (("a", now - 100), ("b", now - 50)):  # two earlier runs, gone
        earlier = LayerStore(True, tmp_path, max_bytes=cap)
        _parent(earlier, key, 1, used)
        earlier.close()
    store = LayerStore(True, tmp_path, max_bytes=cap)
    store.hold("a")  # this run uses "a", and builds "c": over the cap, "b" goes ("a" is older, but held)
    _parent(store, "c", 1, now)  # (pruned in the background: _parent waits for it)
    assert store.load("b") is None and store.load("a") is not None and store.load("c") is not None
    store.close()


def test_image_prune_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    monkeypatch.setenv("ALBATROSS_IMAGES", str(tmp_path))
    store = LayerStore(True, tmp_path / "layers")
    _parent(store, "k", 1, time.time() - 3 * 86400)
    store.close()
    run = lambda *a: subprocess.run([sys.executable, "-m", "albatross.cli", "sandbox", "image", "prune", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    r = run("--unused-days", "1", "--dry-run")
    assert r.returncode == 0 and "would remove 1 built environments" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "layers" / "k").is_dir()
    r = run("--max-gb", "-1")
    assert r.returncode == 2 and "--max-gb" in r.stderr and "Traceback" not in r.stderr
    r = run("--unused-days", "4")
    assert r.returncode == 0 and "removed 0 built environments" in r.stdout
    r = run("--unused-days", "1")
    assert r.returncode == 0 and "removed 1 built environments" in r.stdout and not (tmp_path / "layers" / "k").exists()
