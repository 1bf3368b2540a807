"""Import path escapes: an image archive (OCI layout or docker save) is hostile input that albatross,
running as root, unpacks. No layer may delete, create, chmod or chown anything outside the image's
root, through a symbolic link, a whiteout, a hard link or a manifest naming a file outside the archive."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from albatross.sandbox import images
from albatross.sandbox.build import EnvBuildError


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALBATROSS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ALBATROSS_IMAGES", str(tmp_path / "cache"))


def layer(*entries: tarfile.TarInfo | tuple[str, bytes]) -> bytes:
    """A layer tar of entries: a TarInfo (links, directories, devices) or (name, file content)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for entry in entries:
            if isinstance(entry, tarfile.TarInfo):
                tar.addfile(entry)
            else:
                info = tarfile.TarInfo(entry[0])
                info.size, info.mode = len(entry[1]), 0o644
                tar.addfile(info, io.BytesIO(entry[1]))
    return buf.getvalue()


def symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def hardlink(name: str, target: str, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = tarfile.LNKTYPE, target, mode
    return info


def oci_layout(root: Path, layers: list[bytes], tag: str, layer_names: list[str] | None = None) -> Path:
    """An OCI layout directory; ``layer_names`` (docker save style) replaces the blob paths of the layers
    in a manifest.json written next to index.json, the way newer dockers write both."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    config = blob(json.dumps({"config": {"Env": []}, "rootfs": {"type": "layers"}}).encode())
    described = [blob(data) for data in layers]
    manifest = blob(json.dumps({"schemaVersion": 2, "config": config, "layers": described}).encode())
    manifest["annotations"] = {"org.opencontainers.image.ref.name": tag}
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [manifest]}))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    if layer_names is not None:
        config_name = f"blobs/sha256/{str(config['digest']).split(':')[1]}"
        (root / "manifest.json").write_text(json.dumps([{"Config": config_name, "RepoTags": [tag],
                                                         "Layers": layer_names}]))
    return root


def import_quietly(layout: Path, tag: str) -> None:
    """Import; refusing the archive is a correct answer too (the probes check the host afterwards)."""
    try:
        images.import_image(layout, tag)
    except EnvBuildError:
        pass


def test_whiteout_under_a_symlink_does_not_delete_a_host_file(tmp_path: Path) -> None:
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "victim").write_text("keep me\n")
    lower = layer(symlink("link", str(outside)))
    upper = layer(("link/.wh.victim", b""))
    import_quietly(oci_layout(tmp_path / "img", [lower, upper], "wh-file:1"), "wh-file:1")
    assert (outside / "victim").read_text() == "keep me\n"


def test_whiteout_under_a_symlink_does_not_delete_a_host_directory(tmp_path: Path) -> None:
    outside = tmp_path / "host"
    (outside / "data").mkdir(parents=True)
    (outside / "data" / "precious").write_text("keep me\n")
    lower = layer(symlink("link", str(outside)))
    upper = layer(("link/.wh.data", b""))
    import_quietly(oci_layout(tmp_path / "img", [lower, upper], "wh-dir:1"), "wh-dir:1")
    assert (outside / "data" / "precious").read_text() == "keep me\n"


def test_opaque_whiteout_under_a_relative_symlink_does_not_empty_a_host_directory(tmp_path: Path) -> None:
    outside = tmp_path / "host"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "precious").write_text("keep me\n")
    depth = "../" * len((tmp_path / "cache" / "images" / "x").relative_to("/").parts)
    lower = layer(symlink("link", depth + str(outside).lstrip("/")))
    upper = layer(("link/sub/.wh..wh..opq", b""))
    import_quietly(oci_layout(tmp_path / "img", [lower, upper], "opq:1"), "opq:1")
    assert (outside / "sub" / "precious").read_text() == "keep me\n"


def test_hardlink_to_a_symlink_does_not_chmod_a_host_file(tmp_path: Path) -> None:
    target = tmp_path / "host-file"
    target.write_text("host\n")
    target.chmod(0o600)
    before = target.stat()
    evil = layer(symlink("s", str(target)), hardlink("h", "s", mode=0o4777))
    import_quietly(oci_layout(tmp_path / "img", [evil], "chmod:1"), "chmod:1")
    after = target.stat()
    assert stat.S_IMODE(after.st_mode) == 0o600 and (after.st_uid, after.st_gid) == (before.st_uid, before.st_gid)
    assert after.st_nlink == 1  # no hard link to the host file inside the image


def test_manifest_cannot_name_a_host_tar_as_a_layer(tmp_path: Path) -> None:
    host_tar = tmp_path / "host-secret.tar"
    host_tar.write_bytes(layer(("planted-from-host", b"host secret\n")))
    layout = oci_layout(tmp_path / "img", [layer(("ok", b"x"))], "host-tar:1", layer_names=[str(host_tar)])
    with pytest.raises(EnvBuildError, match="outside"):
        images.import_image(layout, "host-tar:1")
    relative = oci_layout(tmp_path / "img2", [layer(("ok", b"x"))], "host-tar:2",
                          layer_names=["../host-secret.tar"])
    with pytest.raises(EnvBuildError, match="outside"):
        images.import_image(relative, "host-tar:2")


def test_layer_link_targets_stay_inside_the_root(tmp_path: Path) -> None:
    """A hard link naming a host path, and a file written through a directory symlink, are refused."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "passwd").write_text("root:x:0:0\n")
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(EnvBuildError):
        images.apply_layer(root, io.BytesIO(layer(hardlink("h", str(host / "passwd")))))
    assert (host / "passwd").stat().st_nlink == 1
    assert not os.path.lexists(root / "h") or (root / "h").stat().st_ino != (host / "passwd").stat().st_ino
