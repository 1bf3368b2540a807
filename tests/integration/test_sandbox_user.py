"""The image's USER applies to attempts, as ``docker exec`` (no ``--user``) applies it: every command of
an attempt (agent, oracle, verifier) runs as the last stage's USER, with its uid, primary gid,
supplementary groups and HOME, in WORKDIR; files the build made as root stay root's. On the local
backend (python:3.11-slim-bookworm, the base the image tests already build) and on Podman. A stage FROM an
imported image (OCI layout, docker save archive) starts with that image's config User and WorkingDir.

Needs root and the local sandbox; the Podman tests need podman (CI sets ALBATROSS_REQUIRE_PODMAN=1)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from albatross.sandbox import EnvBuildError, LocalBackend, local_available
from albatross.sandbox.docker import DockerBackend, engine_argv, engine_missing
from albatross.sandbox.images import resolve_base
from albatross.tasks import load_task, write_task
from albatross.tasks.verify import run_oracle, verify_attempt
from sandbox_util import ok_output, task_env

needs_local = pytest.mark.skipif(not local_available(), reason="the local sandbox needs root, cgroups, namespaces")
PODMAN_MISSING = engine_missing("podman")
if PODMAN_MISSING and os.environ.get("ALBATROSS_REQUIRE_PODMAN") == "1":
    raise RuntimeError(f"ALBATROSS_REQUIRE_PODMAN=1 but {PODMAN_MISSING} (apt-get install podman runc)")
needs_podman = pytest.mark.skipif(bool(PODMAN_MISSING), reason=f"no container engine: {PODMAN_MISSING}")

BASE = "python:3.11-slim-bookworm"
PODMAN_BASE = "albatross-base:bookworm"  # imported from the cached debian:bookworm root (test_sandbox_docker)
USER_DOCKERFILE = """\
FROM {base}
RUN echo built > /opt/built.txt && groupadd -g 2345 extra && useradd -m agent && usermod -aG extra agent
USER agent
WORKDIR /home/agent/work
"""
# errno name of opening a path for writing, as the command's user
WRITE_ERRNO = ("python3 -c 'import errno, sys\ntry:\n open(sys.argv[1], \"w\")\n print(\"ok\")\n"
               "except OSError as e:\n print(errno.errorcode[e.errno])' ")
ANSWER = "forty-two"
TEST_SH = f"""#!/bin/bash
u=0; a=0
[ "$(id -un)" = agent ] && [ "$HOME" = /home/agent ] && u=1
[ "$(cat /home/agent/answer.txt 2>/dev/null)" = "{ANSWER}" ] && a=1
echo "{{\\"as_user\\": $u, \\"answer\\": $a}}" > /logs/verifier/reward.json
"""


def groups_of(attempt, user: str) -> set[int]:
    """The gids ``user`` belongs to by the image's own /etc/passwd and /etc/group (read as root)."""
    passwd = (attempt.read_file("/etc/passwd") or b"").decode().splitlines()
    group = (attempt.read_file("/etc/group") or b"").decode().splitlines()
    primary = {int(r.split(":")[3]) for r in passwd if r.split(":")[0] == user}
    return primary | {int(r.split(":")[2]) for r in group if user in r.split(":")[3].split(",")}


def user_task(root: Path, base: str) -> Path:
    """A task whose image has a USER; its workdir is the user's home (buildah makes a WORKDIR as root,
    BuildKit as the USER)."""
    dockerfile = USER_DOCKERFILE.format(base=base).replace("/home/agent/work", "/home/agent")
    toml = {"agent": {"timeout_sec": 60}, "verifier": {"timeout_sec": 60},
            "environment": {"memory_mb": 512, "storage_mb": 256}}
    return write_task(root / "as-user", instruction=f"Write {ANSWER} to answer.txt.\n", task_toml=toml,
                      env_files={}, dockerfile=dockerfile, solve_sh=f"#!/bin/bash\necho {ANSWER} > answer.txt\n",
                      test_sh=TEST_SH)


def check_verifier_as_user(backend, task_dir: Path) -> None:
    """The oracle and test.sh run as the image's USER, and the reward is scored; an untouched fork
    scores 0 on the answer (the test can fail)."""
    task = load_task(task_dir)
    with backend.fork(task.env_dir, task.workdir) as attempt:
        assert run_oracle(attempt, task).exit_code == 0
        assert attempt.exec("stat -c %U /home/agent/answer.txt").output.strip() == "agent"
        assert verify_attempt(attempt, task, backend).metrics == {"as_user": 1.0, "answer": 1.0}
    with backend.fork(task.env_dir, task.workdir) as attempt:
        assert verify_attempt(attempt, task, backend).metrics == {"as_user": 1.0, "answer": 0.0}


# ---- local -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local() -> Iterator[LocalBackend]:
    backend = LocalBackend(warm=0)
    yield backend
    backend.close()


@needs_local
def test_attempt_runs_as_the_images_user(local: LocalBackend, tmp_path: Path) -> None:
    env = task_env(tmp_path, USER_DOCKERFILE.format(base=BASE))
    with local.fork(env) as attempt:
        assert ok_output(attempt, "id -un; id -u") != "root\n0"
        assert ok_output(attempt, "id -un") == "agent"
        assert {int(g) for g in ok_output(attempt, "id -G").split()} == groups_of(attempt, "agent")
        assert 2345 in groups_of(attempt, "agent")
        assert ok_output(attempt, "echo $HOME; pwd") == "/home/agent\n/home/agent/work"
        assert ok_output(attempt, "echo hi > notes.txt && stat -c %U notes.txt") == "agent"
        assert ok_output(attempt, WRITE_ERRNO + "/root/x") == "EACCES"
        assert ok_output(attempt, WRITE_ERRNO + "/etc/x") == "EACCES"
        assert ok_output(attempt, WRITE_ERRNO + "/opt/built.txt") == "EACCES"  # the build's file stays root's
        assert ok_output(attempt, "stat -c %U /opt/built.txt /etc/passwd") == "root\nroot"
        assert ok_output(attempt, "cd /tmp && export KEPT=1") == ""  # the shell state persists for the user
        assert ok_output(attempt, "pwd; echo $KEPT") == "/tmp\n1"
        clean = attempt.exec_clean("id -un; echo $HOME; pwd", "/home/agent/work", timeout_s=30)
        assert clean.output.split() == ["agent", "/home/agent", "/home/agent/work"]


@needs_local
def test_no_user_is_root(local: LocalBackend, tmp_path: Path) -> None:
    with local.fork(task_env(tmp_path, f"FROM {BASE}\nWORKDIR /app\n")) as attempt:
        assert ok_output(attempt, "id -u; echo $HOME") == "0\n/root"
        assert ok_output(attempt, WRITE_ERRNO + "/etc/x") == "ok"


@needs_local
def test_numeric_user_without_passwd_entry(local: LocalBackend, tmp_path: Path) -> None:
    # Docker's rule: a uid the image does not know gets gid 0 and HOME=/; no setpriv needed in the image
    dockerfile = f"FROM {BASE}\nRUN rm /usr/bin/setpriv\nUSER 1234\n"
    with local.fork(task_env(tmp_path, dockerfile), "/") as attempt:
        assert ok_output(attempt, "id -u; id -g; id -G; echo $HOME") == "1234\n0\n0\n/"
        assert ok_output(attempt, "command -v setpriv || echo none") == "none"


@needs_local
def test_env_home_wins_and_unknown_user_is_a_build_error(local: LocalBackend, tmp_path: Path) -> None:
    dockerfile = f"FROM {BASE}\nRUN useradd -m agent\nENV HOME=/srv/h\nUSER agent\n"
    with local.fork(task_env(tmp_path / "a", dockerfile), "/") as attempt:
        assert ok_output(attempt, "id -un; echo $HOME") == "agent\n/srv/h"
    with pytest.raises(EnvBuildError, match=r"Dockerfile: USER ghost: no user 'ghost'"):
        local.prepare(task_env(tmp_path / "b", f"FROM {BASE}\nUSER ghost\n"))


@needs_local
def test_verifier_runs_as_the_user_and_scores(local: LocalBackend, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a task named by a relative path (`tasks validate ../tasks`): the verifier's
    check_verifier_as_user(local, user_task(Path("."), BASE))  # files still reach the attempt


# ---- podman ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def podman() -> Iterator[DockerBackend]:
    backend = DockerBackend("podman")
    exists = subprocess.run([*engine_argv("podman"), "image", "exists", PODMAN_BASE], capture_output=True)
    if exists.returncode != 0:
        base = resolve_base("debian:bookworm")
        backend.import_root(base.root, PODMAN_BASE, base.env)
    yield backend
    backend.close()


@needs_local
@needs_podman
def test_podman_attempt_runs_as_the_images_user(podman: DockerBackend, tmp_path: Path) -> None:
    env = task_env(tmp_path, USER_DOCKERFILE.format(base=PODMAN_BASE).replace("/opt/built.txt", "/built.txt"))
    parent = podman.prepare(env)
    config = subprocess.run([*engine_argv("podman"), "image", "inspect", "--format", "{{json .Config}}",
                             parent.image], capture_output=True, text=True, check=True)
    assert json.loads(config.stdout)["User"] == "agent"
    with podman.fork(env) as attempt:
        assert ok_output(attempt, "id -un; echo $HOME; pwd") == "agent\n/home/agent\n/home/agent/work"
        assert {int(g) for g in ok_output(attempt, "id -G").split()} == groups_of(attempt, "agent") != set()
        # buildah makes a WORKDIR as root (BuildKit as the USER): write in the user's home
        assert ok_output(attempt, "echo hi > ~/notes.txt && stat -c %U ~/notes.txt /built.txt") == "agent\nroot"
        assert ok_output(attempt, "touch /etc/x 2>&1 || true").endswith("Permission denied")
        assert ok_output(attempt, "cd /tmp && export KEPT=1; pwd; echo $KEPT") == "/tmp\n1"
        assert ok_output(attempt, "pwd; echo $KEPT") == "/tmp\n1"
        clean = attempt.exec_clean("id -un; echo $HOME", "/", timeout_s=30)
        assert clean.output.split() == ["agent", "/home/agent"]


@needs_local
@needs_podman
def test_podman_verifier_runs_as_the_user_and_scores(podman: DockerBackend, tmp_path: Path) -> None:
    check_verifier_as_user(podman, user_task(tmp_path, PODMAN_BASE))


@needs_local
def test_terminal_runs_as_the_user(local: LocalBackend, tmp_path: Path) -> None:
    seen = bytearray()

    def relay(master: int) -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the command closed the terminal
                return
            if not data:
                return
            seen.extend(data)

    env = task_env(tmp_path, USER_DOCKERFILE.format(base=BASE))
    with local.fork(env) as attempt:
        code = attempt.terminal(["/bin/sh", "-c", "id -un; echo $HOME; tty"], relay)
    assert code == 0
    assert seen.decode().split()[:2] == ["agent", "/home/agent"]
    assert seen.decode().split()[2].startswith("/dev/pts/")  # the terminal is its controlling tty


# ---- an imported image's configured User and WorkingDir --------------------------------------------------
# Docker starts a stage FROM an image with that image's config User and WorkingDir: a Dockerfile without
# USER builds (RUN) and runs (docker exec) as the image's user. The images are made here from the cached
# debian:bookworm root (no new base is built): an OCI layout whose config has a uid the image does not
# know, and a docker save archive whose config names a user its second layer adds to /etc/passwd.

NUMERIC_REF = "albatross-test/numeric-user:1"
NAMED_REF = "albatross-test/named-user:1"
AGENT_UID = 1500


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes | None, uid: int = 0, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.uid = info.gid = uid
    if data is None:
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
    else:
        info.size, info.mode = len(data), mode
        tar.addfile(info, io.BytesIO(data))


def _user_layer(root: Path, path: Path) -> None:
    """A layer adding user ``agent`` (uid/gid 1500, home /opt/agent with a project directory it owns),
    as a ``useradd`` step of the image's own build would (not under /home: the local backend empties
    /home, /root, /srv, /tmp, ... of every parent layer, "Hidden paths" in docs/sandbox.md)."""
    passwd = (root / "etc/passwd").read_text() + f"agent:x:{AGENT_UID}:{AGENT_UID}::/opt/agent:/bin/sh\n"
    group = (root / "etc/group").read_text() + f"agent:x:{AGENT_UID}:\n"
    with tarfile.open(path, "w") as tar:
        _tar_member(tar, "etc/passwd", passwd.encode())
        _tar_member(tar, "etc/group", group.encode())
        _tar_member(tar, "opt/agent", None, AGENT_UID)
        _tar_member(tar, "opt/agent/proj", None, AGENT_UID)


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def _oci_layout(dest: Path, layers: list[Path], config: dict[str, object], tag: str) -> None:
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict[str, object]:
        (blobs / hashlib.sha256(data).hexdigest()).write_bytes(data)
        return {"digest": f"sha256:{hashlib.sha256(data).hexdigest()}", "size": len(data)}

    described = []
    for layer in layers:
        digest = _digest(layer)
        os.link(layer, blobs / digest)
        described.append({"digest": f"sha256:{digest}", "size": layer.stat().st_size})
    manifest = blob(json.dumps({"schemaVersion": 2, "config": blob(json.dumps(config).encode()),
                                "layers": described}).encode())
    manifest["annotations"] = {"org.opencontainers.image.ref.name": tag}
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [manifest]}))
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')


def _docker_save(dest: Path, layers: list[Path], config: dict[str, object], tag: str) -> None:
    with tarfile.open(dest, "w") as tar:
        for index, layer in enumerate(layers):
            tar.add(layer, f"{index}/layer.tar")
        data = json.dumps(config).encode()
        name = f"{hashlib.sha256(data).hexdigest()}.json"  # docker save names the config by its digest
        _tar_member(tar, name, data)
        manifest = [{"Config": name, "RepoTags": [tag], "Layers": [f"{i}/layer.tar" for i in range(len(layers))]}]
        _tar_member(tar, "manifest.json", json.dumps(manifest).encode())


@dataclass
class Imported:
    backend: LocalBackend  # its bases for both references already resolved
    search: Path  # the OCI layout and the docker save archive ([sandbox] images)
    cache: Path  # the private image cache they are imported into ($ALBATROSS_IMAGES)


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Imported]:
    """A local backend over both images, imported on first use into a private image cache (removed
    afterwards); ``$ALBATROSS_IMAGES`` points there only while they are resolved."""
    work = tmp_path_factory.mktemp("imported")
    debian = resolve_base("debian:bookworm").root  # the cached root (the Podman tests use it too)
    layers = [work / "debian.tar", work / "user.tar"]
    subprocess.run(["tar", "-C", str(debian), "--numeric-owner", "--exclude", "./.albatross-base.json",
                    "-cf", str(layers[0]), "."], check=True)
    _user_layer(debian, layers[1])
    search = work / "images"
    search.mkdir()
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "IMAGE_SAYS=hi"]
    _oci_layout(search / "numeric", layers[:1], {"config": {"Env": env, "User": "1234", "WorkingDir": "/data/work"}},
                NUMERIC_REF)
    _docker_save(search / "named.tar", layers,
                 {"config": {"Env": env, "User": "agent", "WorkingDir": "/opt/agent/proj"}}, NAMED_REF)
    for layer in layers:
        layer.unlink()
    backend = LocalBackend(warm=0, allow_internet=False, images_dir=search)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("ALBATROSS_IMAGES", str(work / "cache"))
            for ref in (NUMERIC_REF, NAMED_REF):
                backend.base_for(ref)
        yield Imported(backend, search, work / "cache")
    finally:
        backend.close()
        shutil.rmtree(work, ignore_errors=True)  # two unpacked roots and the archives


@needs_local
def test_imported_images_numeric_user_and_workdir_apply(imported: Imported, tmp_path: Path) -> None:
    backend = imported.backend
    with backend.fork(task_env(tmp_path, f"FROM {NUMERIC_REF}\nENV MORE=1\n")) as attempt:  # no USER, no WORKDIR
        assert ok_output(attempt, "id -u; id -g; echo $HOME; pwd") == "1234\n0\n/\n/data/work"
        assert ok_output(attempt, "echo $IMAGE_SAYS$MORE; stat -c %U /data/work") == "hi1\nroot"  # made at import, root's
        assert ok_output(attempt, "touch /etc/x 2>&1 || true").endswith("Permission denied")  # no python3 here


@needs_local
def test_imported_images_named_user_builds_and_runs(imported: Imported, tmp_path: Path) -> None:
    backend = imported.backend
    dockerfile = f"FROM {NAMED_REF}\nRUN id -un > built-by.txt\n"  # RUN runs as the image's user, in its WorkingDir
    with backend.fork(task_env(tmp_path, dockerfile)) as attempt:
        assert ok_output(attempt, "id -un; id -u; echo $HOME; pwd") == f"agent\n{AGENT_UID}\n/opt/agent\n/opt/agent/proj"
        assert ok_output(attempt, "cat built-by.txt; stat -c %U built-by.txt") == "agent\nagent"
        assert ok_output(attempt, "touch /root/x 2>&1 || true").endswith("Permission denied")  # no python3 here


@needs_local
def test_dockerfile_user_and_workdir_override_the_images(imported: Imported, tmp_path: Path) -> None:
    backend = imported.backend
    dockerfile = f"FROM {NAMED_REF}\nUSER root\nWORKDIR sub\nRUN id -un > by.txt\n"  # WORKDIR relative to the image's
    with backend.fork(task_env(tmp_path / "a", dockerfile)) as attempt:
        assert ok_output(attempt, "id -u; pwd; cat by.txt") == "0\n/opt/agent/proj/sub\nroot"
    staged = f"FROM {NUMERIC_REF} AS first\nFROM first\nUSER 4321\n"  # a stage FROM a stage keeps the chain
    with backend.fork(task_env(tmp_path / "b", staged)) as attempt:
        assert ok_output(attempt, "id -u; pwd") == "4321\n/data/work"


@needs_local
@needs_podman
def test_podman_imported_images_user_and_workdir_apply(imported: Imported, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the engine has no such image: the backend imports the unpacked root with the config's USER and WORKDIR
    monkeypatch.setenv("ALBATROSS_IMAGES", str(imported.cache))
    podman = DockerBackend("podman", images_dir=imported.search)
    made = [NAMED_REF]
    try:
        subprocess.run([*engine_argv("podman"), "rmi", "-f", NAMED_REF], capture_output=True)
        env = task_env(tmp_path, f"FROM {NAMED_REF}\nRUN id -un > built-by.txt\n")
        made.append(podman.prepare(env).image)
        with podman.fork(env) as attempt:
            assert ok_output(attempt, "id -un; echo $HOME; pwd") == "agent\n/opt/agent\n/opt/agent/proj"
            assert ok_output(attempt, "cat built-by.txt") == "agent"
    finally:
        podman.close()
        subprocess.run([*engine_argv("podman"), "rmi", "-f", *made], capture_output=True)
