"""``EnvKeys``: an environment's key is computed once however many forks ask at once, stays while its files are
unchanged, and follows an edit once the recheck interval has passed."""

import threading
import time

from albatross.sandbox import build
from albatross.sandbox.build import EnvKeys, env_key


def test_the_key_is_the_hash_and_follows_an_edit(tmp_path, monkeypatch):
    env = tmp_path / "environment"
    (env / "app").mkdir(parents=True)
    (env / "Dockerfile").write_text("FROM python:3.11-slim-bookworm\n")
    (env / "app" / "a.txt").write_text("one\n")
    keys = EnvKeys()
    first = keys.get(env, "salt")
    assert first == env_key(env, "salt")
    (env / "app" / "a.txt").write_text("two, longer\n")
    assert keys.get(env, "salt") == first  # within the recheck interval the cached key stands
    monkeypatch.setattr(EnvKeys, "RECHECK_S", 0.0)
    assert keys.get(env, "salt") == env_key(env, "salt") != first
    assert keys.get(env, "other") != keys.get(env, "salt")


def test_forks_asking_at_once_hash_the_directory_once(tmp_path, monkeypatch):
    env = tmp_path / "environment"
    env.mkdir()
    (env / "f").write_text("x")
    calls = []

    def slow_key(env_dir, salt=""):
        calls.append(env_dir)
        time.sleep(0.05)
        return "k"

    monkeypatch.setattr(build, "env_key", slow_key)
    keys = EnvKeys()
    got = []
    threads = [threading.Thread(target=lambda: got.append(keys.get(env))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == ["k"] * 8 and len(calls) == 1
