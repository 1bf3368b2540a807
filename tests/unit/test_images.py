"""Base images: FROM references mapped to recipes, and import of OCI layouts / docker save archives
(hand-made here: layers with whiteouts, an image config with env)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from albatross.sandbox import images, rootfs
from albatross.sandbox.bootstrap import source_urls
from albatross.sandbox.build import EnvBuildError


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALBATROSS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ALBATROSS_IMAGES", str(tmp_path / "cache"))  # imported test images stay private


# ---- recipes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("ref", "release", "python"), [
    ("debian:bookworm-slim", "bookworm", False),
    ("debian:12", "bookworm", False),
    ("docker.io/library/debian:trixie", "trixie", False),
    ("python:3.11-slim-bookworm", "bookworm", True),
    ("python:3.13-slim", "trixie", True),
    ("python:3.12", "trixie", True),
    ("python:3.10-slim", "bookworm", True),
    ("ubuntu:24.04", "noble", False),
    ("ubuntu:22.04", "jammy", False),
    ("ubuntu:latest", "noble", False),
    ("node:20-bookworm", "bookworm", False),
    ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", "trixie", True),
])
def test_recipe_release(ref: str, release: str, python: bool) -> None:
    recipe, _notes = images.recipe_for(ref)
    assert (recipe.release, recipe.python) == (release, python)


def test_python_recipe_has_pip_and_names_the_version_difference() -> None:
    recipe, notes = images.recipe_for("python:3.13-slim-bookworm")  # the release named wins: bookworm's 3.11
    assert {"python3", "python3-pip", "python3-venv"} <= set(recipe.packages)
    assert (recipe.release, recipe.env["PYTHON_VERSION"]) == ("bookworm", "3.11")
    assert any("3.11" in n and "3.13" in n for n in notes)
    unnamed, unnamed_notes = images.recipe_for("python:3.13-slim")  # no release: the closest python3
    assert (unnamed.release, unnamed.env["PYTHON_VERSION"], unnamed_notes) == ("trixie", "3.13", [])
    exact, exact_notes = images.recipe_for("python:3.11-slim-bookworm")
    assert exact_notes == [] and exact.key() == recipe.key()


def test_ubuntu_and_runtimes_are_noted() -> None:
    recipe, notes = images.recipe_for("ubuntu:24.04")
    assert notes and "Ubuntu noble from the Ubuntu archive" in notes[0]
    assert recipe.distro == "ubuntu" and {"apt", "ubuntu-keyring", "python3"} <= set(recipe.packages)
    assert recipe.key() != images.Recipe("noble", recipe.packages, recipe.mirror).key()  # not a Debian recipe
    node, node_notes = images.recipe_for("node:20")
    assert "nodejs" in node.packages and node_notes


def test_recipe_key_is_content_addressed() -> None:
    a, _ = images.recipe_for("python:3.11-slim-bookworm")
    b, _ = images.recipe_for("python:3.11-bookworm")
    c, _ = images.recipe_for("debian:bookworm")
    assert a.key() == b.key() != c.key()


@pytest.mark.parametrize("ref", ["alpine:3.19", "ubuntu:18.10", "debian:hamm", "mcr.microsoft.com/foo:1"])
def test_unknown_refs_are_refused(ref: str) -> None:
    with pytest.raises(EnvBuildError, match=f"no base for {ref}"):
        images.recipe_for(ref)


def test_host_mirror_reads_deb822_and_one_line_sources(tmp_path: Path) -> None:
    urls = list(source_urls("Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n", ".sources"))
    assert urls == ["http://mirror.example/debian"]
    urls = list(source_urls("# c\ndeb [arch=amd64] http://m.example/debian bookworm main\n", ".list"))
    assert urls == ["http://m.example/debian"]


# ---- imported images -----------------------------------------------------------------------------------


def _layer(entries: list[tuple[str, bytes | None, str]]) -> bytes:
    """A layer tar: (name, data or None for a directory, kind "f"/"d"/"l:target")."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data, kind in entries:
            info = tarfile.TarInfo(name)
            if kind == "d":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif kind.startswith("l:"):
                info.type, info.linkname = tarfile.SYMTYPE, kind[2:]
                tar.addfile(info)
            else:
                info.size, info.mode = len(data or b""), 0o644
                tar.addfile(info, io.BytesIO(data or b""))
    return buf.getvalue()


def _oci_layout(root: Path, layers: list[bytes], env: list[str], tag: str, **config_fields: str) -> Path:
    """An OCI image layout of ``layers``; ``config_fields`` (User, WorkingDir) go into its config."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    config = blob(json.dumps({"config": {"Env": env, **config_fields}, "rootfs": {"type": "layers"}}).encode())
    manifest = blob(json.dumps({"schemaVersion": 2, "config": config,
                                "layers": [blob(layer) for layer in layers]}).encode())
    manifest["annotations"] = {"org.opencontainers.image.ref.name": tag}
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [manifest]}))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return root


LOWER = _layer([("bin", None, "d"), ("bin/sh", b"#!fake", "f"), ("etc", None, "d"),
                ("etc/shadow", b"root:*:1::::::\n", "f"), ("etc/old.conf", b"old", "f"),
                ("opt", None, "d"), ("opt/app", None, "d"), ("opt/app/stale", b"stale", "f"),
                ("usr", None, "d"), ("usr/lib", None, "d"), ("lib", None, "l:usr/lib")])
UPPER = _layer([("etc", None, "d"), ("etc/.wh.old.conf", b"", "f"), ("opt/app", None, "d"),
                ("opt/app/.wh..wh..opq", b"", "f"), ("opt/app/fresh", b"fresh", "f"),
                ("etc/motd", b"hello", "f")])


def test_import_oci_layout_applies_layers_and_whiteouts(tmp_path: Path) -> None:
    layout = _oci_layout(tmp_path / "img", [LOWER, UPPER], ["PATH=/opt/bin:/usr/bin", "LANG=C.UTF-8"],
                         "example/env:1")
    assert images.image_tags(layout) == ["example/env:1"]
    base = images.import_image(layout, "example/env:1")
    root = base.root
    assert (root / "etc/shadow").read_text() == "root:*:1::::::\n"
    assert not (root / "etc/old.conf").exists()  # .wh.old.conf deleted it
    assert sorted(p.name for p in (root / "opt/app").iterdir()) == ["fresh"]  # opaque: stale gone
    assert (root / "etc/motd").read_text() == "hello"
    assert (root / "lib").is_symlink() and not list(root.rglob(".wh.*"))
    assert base.env["PATH"] == "/opt/bin:/usr/bin" and base.env["LANG"] == "C.UTF-8"
    assert rootfs.is_built(root)
    # a FROM naming the tag resolves to it, without building anything
    again = images.resolve_base("docker.io/example/env:1")
    assert again.root == root and again.env["LANG"] == "C.UTF-8" and "imported" in again.notes[0]


def _docker_save(archive: Path, config: dict, tag: str) -> Path:
    """A ``docker save`` archive at ``archive``: one layer (LOWER), the image ``config``, tagged ``tag``."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    manifest = [{"Config": "cfg.json", "RepoTags": [tag], "Layers": ["abc/layer.tar"]}]
    with tarfile.open(archive, "w") as tar:
        for name, data in (("abc/layer.tar", LOWER), ("cfg.json", json.dumps({"config": config}).encode()),
                           ("manifest.json", json.dumps(manifest).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def test_docker_save_archive_from_search_dir(tmp_path: Path) -> None:
    archive = _docker_save(tmp_path / "images" / "saved.tar", {"Env": ["FOO=bar"]}, "saved:latest")
    base = images.resolve_base("saved", search=archive.parent)
    assert base.env["FOO"] == "bar" and (base.root / "opt/app/stale").read_text() == "stale"


def test_import_records_the_configs_user_and_workdir(tmp_path: Path) -> None:
    plain = images.import_image(_oci_layout(tmp_path / "plain", [LOWER], [], "plain:1"), "plain:1")
    assert (plain.user, plain.workdir) == (None, None) and "User" not in plain.notes[0]
    layout = _oci_layout(tmp_path / "img", [LOWER, UPPER], [], "as-user:1", User="agent:staff",
                         WorkingDir="srv/app/")
    base = images.import_image(layout, "as-user:1")
    assert (base.user, base.workdir) == ("agent:staff", "/srv/app")
    assert (base.root / "srv/app").is_dir() and (base.root / "opt/app/fresh").is_file()  # made, as Docker does
    assert "User agent:staff" in base.notes[0] and "WorkingDir /srv/app" in base.notes[0]
    again = images.resolve_base("as-user:1")  # from the tag's entry, without reading the layout
    assert (again.user, again.workdir, again.key) == ("agent:staff", "/srv/app", base.key) != (None, None, plain.key)


def test_tag_recorded_before_user_and_workdir_reads_them_from_its_source(tmp_path: Path) -> None:
    layout = _oci_layout(tmp_path / "img", [LOWER], [], "old:1", User="1234", WorkingDir="/w")
    images.import_image(layout, "old:1")
    tag_file = images._tag_file("old:1")
    entry = json.loads(tag_file.read_text())
    legacy = {k: v for k, v in entry.items() if k not in ("user", "workdir")}  # as an older import wrote it
    tag_file.write_text(json.dumps(legacy))
    assert (images.resolve_base("old:1").user, images.resolve_base("old:1").workdir) == ("1234", "/w")
    other = _oci_layout(tmp_path / "other", [LOWER], [], "old:1", User="99")  # the source now holds another image
    tag_file.write_text(json.dumps({**legacy, "source": str(other)}))
    assert (images.resolve_base("old:1").user, images.resolve_base("old:1").workdir) == (None, None)


def test_docker_save_archives_user_applies(tmp_path: Path) -> None:
    _docker_save(tmp_path / "saved.tar", {"Env": [], "User": "1234", "WorkingDir": "/data"}, "u:1")
    base = images.resolve_base("u:1", search=tmp_path)
    assert (base.user, base.workdir) == ("1234", "/data") and (base.root / "data").is_dir()


def test_layer_cannot_write_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    with pytest.raises(EnvBuildError, match="climbs out"):
        images.apply_layer(root, io.BytesIO(_layer([("../evil", b"x", "f")])))
    evil = _layer([("link", None, f"l:{outside}"), ("link/planted", b"x", "f")])
    images.apply_layer(root, io.BytesIO(evil))  # as in Docker: the link is followed inside the root
    assert not list(outside.iterdir())
    assert (root / str(outside).lstrip("/") / "planted").read_bytes() == b"x"


def test_not_an_image_is_a_build_error(tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    with pytest.raises(EnvBuildError, match="not an OCI image layout"):
        images.import_image(tmp_path / "junk", "x:1")


# ---- named build failures --------------------------------------------------------------------------------


@pytest.mark.parametrize(("output", "command", "host"), [
    ("Cloning into 'x'...\nfatal: unable to access 'https://github.com/a/b.git/': Could not resolve host: github.com",
     "git clone https://github.com/a/b.git", "github.com"),
    ("curl: (6) Could not resolve host: huggingface.co", "curl -L https://huggingface.co/m", "huggingface.co"),
    ("--2025--  https://x.example.org/f\nResolving x.example.org (x.example.org)... failed: Name or service not known.",
     "wget https://x.example.org/f", "x.example.org"),
    ("urllib.error.URLError: <urlopen error [Errno -2] Name or service not known>",
     "python -c \"urlopen('https://cdn.example.com/a')\"", "cdn.example.com"),
    ("npm ERR! getaddrinfo ENOTFOUND registry.example.com", "npm install", "registry.example.com"),
    ("E: Unable to locate package nosuchpkg", "apt-get install -y nosuchpkg", None),
])
def test_needed_host(output: str, command: str, host: str | None) -> None:
    from albatross.sandbox.local import needed_host

    assert needed_host(output, command) == host


# ---- the command line ------------------------------------------------------------------------------------


def test_cli_import_and_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from albatross.cli import main

    layout = _oci_layout(tmp_path / "img", [LOWER], ["A=1"], "cli/env:2")
    assert main(["sandbox", "image", "import", str(layout), "--tag", "cli/env:2"]) == 0
    assert images.resolve_base("cli/env:2").env["A"] == "1"
    assert main(["sandbox", "image", "list"]) == 0
    assert str(layout) in capsys.readouterr().out
    assert main(["sandbox", "image", "import", str(tmp_path / "missing"), "--tag", "x:1"]) == 2
    assert capsys.readouterr().err.strip().endswith("missing: no such file or directory")
    assert main(["sandbox", "image", "build", "alpine:3.19"]) == 2
    assert "no base for alpine:3.19" in capsys.readouterr().err


def test_ubuntu_sources_are_the_images_and_uv_maps_to_its_wheel() -> None:
    from albatross.sandbox.ubuntu import sources

    assert sources("noble", "http://archive.ubuntu.com/ubuntu") == [
        "deb http://archive.ubuntu.com/ubuntu noble main restricted universe multiverse",
        "deb http://archive.ubuntu.com/ubuntu noble-updates main restricted universe multiverse",
        "deb http://security.ubuntu.com/ubuntu noble-security main restricted universe multiverse"]
    uv, notes = images.recipe_for("ghcr.io/astral-sh/uv:0.8.14")
    assert (uv.uv, uv.release) == ("0.8.14", "scratch") and "wheel" in notes[0]
    assert images.recipe_for("ghcr.io/astral-sh/uv:0.8.15")[0].key() != uv.key()
