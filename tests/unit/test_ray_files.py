"""Directories as values (orchestrator/ray_files.py): packed, written safely and atomically, cached by content, and a
task's directories localized to a node's copies."""

from __future__ import annotations

import os
import pickle
import socket
import stat
import threading
from pathlib import Path

import pytest

from albatross.orchestrator import ray_files
from albatross.orchestrator.ray_files import (
    Tree,
    localize_task,
    materialize,
    node_root,
    pack_tree,
    resolve_task,
    task_roots,
    tree_bytes,
    write_tree,
)
from albatross.tasks import Task, load_task, write_task


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ALBATROSS_CACHE", str(tmp_path / ".cache"))
    return tmp_path / ".cache"


def _files(root: Path) -> dict[str, tuple[int, bytes]]:
    """relative path -> (permission bits, content) of the regular files under ``root``, by the standard library."""
    return {p.relative_to(root).as_posix(): (stat.S_IMODE(p.lstat().st_mode), p.read_bytes())
            for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


def _listing(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def _source(root: Path) -> Path:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o700)  # any execute bit: 0o755
    (root / "secret.txt").write_text("private\n")
    (root / "secret.txt").chmod(0o600)  # no execute bit: 0o644
    (root / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 40)
    (root / "sub" / "deeper" / "empty").write_bytes(b"")
    (root / "a.txt").write_text("sorts before a/ but is listed after the directory a/\n")
    (root / "a").mkdir()
    (root / "a" / "b").write_text("b\n")
    return root


# ------------------------------------------------------------------------------------------------- pack/write


def test_round_trip_keeps_paths_modes_content_and_digest(tmp_path: Path) -> None:
    tree = pack_tree(_source(tmp_path / "src"))
    assert [path for path, _, _ in tree.files] == ["a.txt", "a/b", "run.sh", "secret.txt", "sub/deeper/empty",
                                                   "sub/weights.bin"]
    assert tree_bytes(tree) == sum(len(c) for _, c in _files(tmp_path / "src").values()) > 10240
    assert len(tree.digest) == 64 and pickle.loads(pickle.dumps(tree)) == tree

    out = write_tree(tree, tmp_path / "out" / "copy")
    assert out == tmp_path / "out" / "copy" and pack_tree(out) == tree
    written = _files(out)
    assert written["run.sh"] == (0o755, b"#!/bin/sh\necho hi\n") and written["secret.txt"][0] == 0o644
    assert written["sub/weights.bin"][1] == bytes(range(256)) * 40 and "empty-dir" not in _listing(out)
    assert os.listdir(tmp_path / "out") == ["copy"]  # no temporary sibling left

    (out / "secret.txt").chmod(0o755)  # a mode is part of the digest, as is content
    assert pack_tree(out).digest != tree.digest
    only = pack_tree(tmp_path / "src", only=lambda p: p.startswith("sub/"))
    assert [p for p, _, _ in only.files] == ["sub/deeper/empty", "sub/weights.bin"] and only.digest != tree.digest


def test_links_fifos_and_sockets_are_skipped_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "key").write_text("TOP SECRET\n")
    root = tmp_path / "root"
    root.mkdir()
    (root / "real.txt").write_text("real\n")
    (root / "link-to-file").symlink_to(outside / "key")
    (root / "link-to-dir").symlink_to(outside)
    (root / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(root / "fifo")  # reading it would block forever
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "sock"))
        tree = pack_tree(root)
    assert [(p, c) for p, _, c in tree.files] == [("real.txt", b"real\n")]

    with pytest.raises(ValueError, match="not a directory"):
        pack_tree(root / "link-to-dir")  # a symlinked root
    with pytest.raises(ValueError, match="not a directory"):
        pack_tree(root / "real.txt")


@pytest.mark.parametrize("path", ["../x", "/etc/x", "a/../../b", "a\x00b", "", ".", "a//b", "a/./b", "a/", ".."])
def test_hostile_paths_are_refused_before_anything_is_written(tmp_path: Path, path: str) -> None:
    tree = Tree((("fine.txt", 0o644, b"ok"), (path, 0o644, b"pwned")))
    with pytest.raises(ValueError, match="not a safe relative path") as info:
        write_tree(tree, tmp_path / "nest" / "dest")
    assert repr(path) in str(info.value)
    with pytest.raises(ValueError):
        materialize(tree, tmp_path / "cache")
    assert _listing(tmp_path) == []  # checked before anything is made, the destination's parent included


@pytest.mark.parametrize(("files", "words"), [
    ((("a", 0o4755, b""),), "mode 0o4755"),
    ((("a", 0o777, b""),), "mode 0o777"),
    ((("a", 0o644, b""), ("a", 0o644, b"x")), "given twice"),
    ((("a", 0o644, b""), ("a/b", 0o644, b"")), "both a file and a directory"),
    ((("a/b", 0o644, b""), ("a", 0o644, b"")), "both a file and a directory"),
])
def test_modes_and_clashing_paths_are_refused(tmp_path: Path, files: tuple[tuple[str, int, bytes], ...],
                                              words: str) -> None:
    with pytest.raises(ValueError, match=words):
        write_tree(Tree(files), tmp_path / "dest")
    assert os.listdir(tmp_path) == []


def test_replacing_swaps_in_a_complete_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "dest"
    old = Tree((("old-only.txt", 0o644, b"old"), ("shared.txt", 0o644, b"old"), ("d/x", 0o755, b"old")))
    new = Tree(tuple((f"new/{i:02}", 0o644, b"new %d" % i) for i in range(20)) + (("shared.txt", 0o644, b"new"),))
    write_tree(old, dest)
    seen: list[tuple[str, str]] = []
    swap = ray_files._rename_replacing

    def watched(tmp: Path, target: Path) -> None:  # the moment before the swap: old intact, new complete aside
        seen.append((pack_tree(target).digest, pack_tree(tmp).digest))
        assert tmp.parent == target.parent and tmp.name.startswith(".dest.tmp-")
        swap(tmp, target)

    monkeypatch.setattr(ray_files, "_rename_replacing", watched)
    assert write_tree(new, dest) == dest
    assert seen == [(old.digest, new.digest)]
    assert pack_tree(dest) == new and not (dest / "old-only.txt").exists()
    assert os.listdir(tmp_path) == ["dest"]  # the old one removed, no temporary left


def test_replacing_a_symlink_never_touches_its_target(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("keep\n")
    for dest, what in ((tmp_path / "link", target), (tmp_path / "file", None)):
        if what is None:
            dest.write_text("a file in the way\n")
        else:
            dest.symlink_to(what)
        write_tree(Tree((("f", 0o644, b"f"),)), dest)
        assert not dest.is_symlink() and _files(dest) == {"f": (0o644, b"f")}
    assert _files(target) == {"keep": (0o644, b"keep\n")}


# -------------------------------------------------------------------------------------------------- materialize


def test_materialize_writes_once_per_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = pack_tree(_source(tmp_path / "src"))
    first = materialize(tree, tmp_path / "cache")
    assert first == tmp_path / "cache" / tree.digest and pack_tree(first) == tree
    stamps = {p: p.stat().st_mtime_ns for p in [first, *first.rglob("*")]}

    def no_writing(tree: Tree, dest: Path) -> Path:
        raise AssertionError("wrote again")

    monkeypatch.setattr(ray_files, "_write_temporary", no_writing)
    assert materialize(tree, tmp_path / "cache") == first
    assert {p: p.stat().st_mtime_ns for p in [first, *first.rglob("*")]} == stamps
    other = Tree((("x", 0o644, b"other"),))
    with pytest.raises(AssertionError, match="wrote again"):
        materialize(other, tmp_path / "cache")  # other content: another directory
    forged = Tree(())
    object.__setattr__(forged, "digest", "../escape")  # the cache directory's name is the digest
    with pytest.raises(ValueError, match="not a tree digest"):
        materialize(forged, tmp_path / "cache")


def test_concurrent_materialize_ends_with_one_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = Tree(tuple((f"d{i % 3}/f{i}", 0o644, os.urandom(2048)) for i in range(30)))
    all_written = threading.Barrier(4, timeout=30)
    write = ray_files._write_temporary

    def in_step(tree: Tree, dest: Path) -> Path:  # every writer past the cache check before any renames
        tmp = write(tree, dest)
        all_written.wait()
        return tmp

    monkeypatch.setattr(ray_files, "_write_temporary", in_step)
    results: list[Path | Exception] = []

    def run() -> None:
        try:
            results.append(materialize(tree, tmp_path / "cache"))
        except Exception as e:  # reported by the assertion below
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [tmp_path / "cache" / tree.digest] * 4
    assert os.listdir(tmp_path / "cache") == [tree.digest] and pack_tree(tmp_path / "cache" / tree.digest) == tree


def test_node_root_is_the_environment_s_else_under_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.delenv("ALBATROSS_NODE_DIR", raising=False)
    assert node_root() == cache / "ray-node"
    monkeypatch.setenv("ALBATROSS_NODE_DIR", str(tmp_path / "node-2"))
    assert node_root() == tmp_path / "node-2"


# -------------------------------------------------------------------------------------------------------- tasks


def _task_dir(root: Path, dockerfile: str) -> Path:
    return write_task(root, instruction="Do it.\n", task_toml={}, env_files={"data.txt": "data\n"},
                      dockerfile=dockerfile, solve_sh="#!/bin/bash\ntrue\n",
                      test_sh="#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n", demo_steps=["true", "submit"])


def _ship(task: Task, node: Path) -> Task:
    """What the Ray backend does: pack the roots where the task was loaded, materialize them on a node, localize."""
    trees = {str(root): pack_tree(root) for root in task_roots(task)}
    return localize_task(task, {root: materialize(tree, node) for root, tree in trees.items()})


def test_a_task_in_one_directory_is_localized(tmp_path: Path) -> None:
    task = load_task(_task_dir(tmp_path / "tasks" / "t", "FROM debian:bookworm-slim\nCOPY data.txt /app/\n"))
    assert task_roots(task) == [(tmp_path / "tasks" / "t").resolve()]
    local = _ship(task, tmp_path / "node")
    root = local.path
    assert root.parent == tmp_path / "node" and local.source_path == root
    assert (local.env_dir, local.tests_dir, local.solution_dir, local.source_env_dir) == (
        root / "environment", root / "tests", root / "solution", root / "environment")
    assert (local.tests_dir / "test.sh").stat().st_mode & 0o111 and (local.env_dir / "data.txt").read_text() == "data\n"
    assert load_task(root).instruction == task.instruction == local.instruction and local.id == task.id == "t"
    assert task.path == tmp_path / "tasks" / "t"  # the original is left as it was


def test_an_adapted_environment_outside_the_task_is_a_second_root(tmp_path: Path, cache: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _task_dir(tmp_path / "t", "FROM ubuntu:24.04\nRUN apt-get install -y git\n")
    monkeypatch.chdir(tmp_path)
    task = load_task(Path("t"))  # relative, as a command line gives it
    assert task.offline is not None and not task.env_dir.is_relative_to(tmp_path / "t")
    assert task_roots(task) == [(tmp_path / "t").resolve(), task.env_dir.resolve()]

    shipped = resolve_task(task)  # absolute and resolved where it was loaded
    assert shipped.path == (tmp_path / "t").resolve() and shipped.tests_dir == shipped.path / "tests"
    trees = {str(root): pack_tree(root) for root in task_roots(task)}
    roots = list(trees)
    os.rename(tmp_path / "t", tmp_path / "gone")  # the receiving node has none of the sender's files
    os.rename(cache / "offline-env", cache / "gone")
    with pytest.raises(ValueError, match="task t: path t is under none of"):
        localize_task(task, {})
    local = localize_task(shipped, {root: materialize(tree, tmp_path / "node") for root, tree in trees.items()})
    task_copy, env_copy = (tmp_path / "node" / trees[r].digest for r in roots)
    assert (local.path, local.source_path, local.source_env_dir) == (task_copy, task_copy, task_copy / "environment")
    assert local.env_dir == env_copy and local.offline is not None
    assert (local.offline.env_dir, local.offline.source_dir) == (env_copy, task_copy / "environment")
    assert (local.offline.after_line, local.offline.inserted) == (task.offline.after_line, task.offline.inserted)
    assert "apt-get install" in (local.env_dir / "Dockerfile").read_text()
    assert (local.env_dir / ".albatross-offline.tar").stat().st_size > 0 and local.dockerfile.is_file()
