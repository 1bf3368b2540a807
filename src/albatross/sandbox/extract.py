"""Unpacking a hostile tar stream into a root directory, as root, without ever leaving that root.

Used for image layers (``images.apply_layer``: OCI whiteouts honoured) and for everything put into a
sandbox (the holder's ``put``: COPY/ADD of a build, the tests). Every path is resolved component by
component from a file descriptor of the root: a symbolic link on the way is followed *inside* the root
(an absolute target or ``..`` stops at the root, as in the image), never outside it; the entry itself is
created, replaced or removed with ``*at`` calls relative to its parent directory's descriptor, so a link
planted by an earlier entry is replaced, not written through. Owners and modes are set on the descriptor
of what was just created (never through a link); a hard link may only name a regular file inside the
root; device nodes are never created (counted in ``Unpacked.devices``); the stream is read once,
member by member, and its total size and number of entries are bounded (``EnvBuildError`` past either).
Standard library only: the sandbox's holder imports it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
import tarfile
from dataclasses import dataclass
from typing import IO

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_HOPS = 40  # symbolic links followed while resolving one path (Linux's own limit)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeArchive(ValueError):
    """The archive breaks a rule (a link out of the root, too large, ...): the message says which."""


@dataclass
class Unpacked:
    """What an unpacking did: files and bytes written, device nodes left out."""

    entries: int = 0
    bytes: int = 0
    devices: int = 0


@dataclass(frozen=True)
class Bounds:
    """Limits of one archive: total bytes of its files and number of entries."""

    max_bytes: int = 64 << 30
    max_entries: int = 2_000_000


def open_tar_stream(stream: IO[bytes]) -> tarfile.TarFile:
    """A tar read as a stream, member by member (plain, gzip, bzip2 or xz; zstd refused, saying so)."""
    peek = getattr(stream, "peek", None)  # buffered streams have it, raw pipes and sockets not
    head = peek(4)[:4] if callable(peek) else b""
    if head == b"\x28\xb5\x2f\xfd":
        raise UnsafeArchive("zstd-compressed layers are not supported (re-export the image with gzip)")
    return tarfile.open(fileobj=stream, mode="r|*")


def unpack(stream: IO[bytes], root: str, *, whiteouts: bool = False, bounds: Bounds = Bounds(),
           owners: bool = True) -> Unpacked:
    """Unpack the tar ``stream`` into the directory ``root``. ``whiteouts``: treat ``.wh.NAME`` as "delete
    NAME" and ``.wh..wh..opq`` as "empty this directory of what lower layers put there" (image layers).
    ``owners``: set each entry's numeric owner (root only)."""
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        with open_tar_stream(stream) as tar:
            return _Unpacker(root_fd, whiteouts, bounds, owners).run(tar)
    except tarfile.TarError as err:
        raise UnsafeArchive(f"not a readable tar archive ({err})") from None
    finally:
        os.close(root_fd)


class _Unpacker:
    def __init__(self, root_fd: int, whiteouts: bool, bounds: Bounds, owners: bool) -> None:
        self.root_fd, self.whiteouts, self.bounds, self.owners = root_fd, whiteouts, bounds, owners
        self.done = Unpacked()
        self.made: set[tuple[str, ...]] = set()  # entries of this archive (an opaque marker keeps them)

    def run(self, tar: tarfile.TarFile) -> Unpacked:
        for member in tar:
            self.done.entries += 1
            if self.done.entries > self.bounds.max_entries:
                raise UnsafeArchive(f"more than {self.bounds.max_entries} entries")
            if member.isreg():
                self.done.bytes += member.size
                if self.done.bytes > self.bounds.max_bytes:
                    raise UnsafeArchive(f"expands past {self.bounds.max_bytes >> 20} MiB")
            self.entry(member, tar)
        return self.done

    def entry(self, member: tarfile.TarInfo, tar: tarfile.TarFile) -> None:
        parts = split(member.name)
        if not parts:
            if member.isdir():
                self.attributes(self.root_fd, member)
            return
        name = parts[-1]
        if self.whiteouts and name.startswith(WHITEOUT):
            self.whiteout(parts[:-1], name)
            return
        if member.ischr() or member.isblk():
            self.done.devices += 1
            return
        parent = self.walk(parts[:-1], create=True)
        try:
            self.place(parent, name, member, tar)
            self.made.add(tuple(parts))
        finally:
            os.close(parent)

    # ---- resolving paths inside the root ----------------------------------------------------------
    def walk(self, parts: list[str], create: bool) -> int:
        """A descriptor of the directory ``parts`` names inside the root (links followed inside it;
        missing directories made when ``create``). ``UnsafeArchive`` if it is not a directory."""
        fd, here = os.dup(self.root_fd), list[str]()  # ``here``: the real directories walked so far, from the root
        todo, hops = list(parts), 0
        try:
            while todo:
                part = todo.pop(0)
                if part == "..":  # only from a link's target: climb, stopping at the root
                    here = here[:-1]
                    os.close(fd)
                    fd = self._open_real(here)
                    continue
                try:
                    st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    hops += 1
                    if hops > MAX_HOPS:
                        raise UnsafeArchive(f"too many levels of symbolic links under {'/'.join(parts)}")
                    target = os.readlink(part, dir_fd=fd)
                    todo = [p for p in target.split("/") if p not in ("", ".")] + todo
                    if target.startswith("/"):
                        here = []
                        os.close(fd)
                        fd = os.dup(self.root_fd)
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    raise UnsafeArchive(f"{'/'.join(parts)}: a path component is not a directory")
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
                here.append(part)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_real(self, parts: list[str]) -> int:
        """A descriptor of the real directory ``parts`` (no link on the way: walked already)."""
        fd = os.dup(self.root_fd)
        for part in parts:
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            finally:
                os.close(fd)
            fd = child
        return fd

    # ---- whiteouts ------------------------------------------------------------------------------------
    def whiteout(self, where: list[str], name: str) -> None:
        try:
            parent = self.walk(where, create=False)
        except (FileNotFoundError, UnsafeArchive):
            return  # nothing below to hide
        try:
            if name == OPAQUE:
                for child in os.listdir(parent):
                    if tuple([*where, child]) not in self.made:
                        remove(parent, child)
            else:
                remove(parent, name[len(WHITEOUT):])
        finally:
            os.close(parent)

    # ---- entries ----------------------------------------------------------------------------------------
    def place(self, parent: int, name: str, member: tarfile.TarInfo, tar: tarfile.TarFile) -> None:
        if member.isdir():
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                keep = stat.S_ISDIR(st.st_mode)
            except FileNotFoundError:
                keep = False
            if not keep:
                remove(parent, name)
                os.mkdir(name, 0o700, dir_fd=parent)
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            try:
                self.attributes(fd, member)
            finally:
                os.close(fd)
            return
        remove(parent, name)
        if member.isreg():
            self.file(parent, name, member, tar)
        elif member.issym():
            os.symlink(member.linkname, name, dir_fd=parent)
            if self.owners:
                os.chown(name, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)
        elif member.islnk():
            self.hardlink(parent, name, member)
        elif member.isfifo():
            os.mkfifo(name, 0o600, dir_fd=parent)
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            try:
                self.attributes(fd, member)
            finally:
                os.close(fd)

    def file(self, parent: int, name: str, member: tarfile.TarInfo, tar: tarfile.TarFile) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
        try:
            source = tar.extractfile(member)
            if source is not None:
                with os.fdopen(os.dup(fd), "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
            self.attributes(fd, member)
        finally:
            os.close(fd)

    def hardlink(self, parent: int, name: str, member: tarfile.TarInfo) -> None:
        parts = split(member.linkname)
        if not parts:
            raise UnsafeArchive(f"{member.name}: a hard link to the root")
        try:
            source_dir = self.walk(parts[:-1], create=False)
        except FileNotFoundError:
            raise UnsafeArchive(f"{member.name}: hard link to {member.linkname}, which is not in the image") from None
        try:
            try:
                st = os.stat(parts[-1], dir_fd=source_dir, follow_symlinks=False)
            except FileNotFoundError:
                raise UnsafeArchive(f"{member.name}: hard link to {member.linkname}, which is not in the image") \
                    from None
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeArchive(f"{member.name}: hard link to {member.linkname}, which is not a regular file")
            os.link(parts[-1], name, src_dir_fd=source_dir, dst_dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(source_dir)

    def attributes(self, fd: int, member: tarfile.TarInfo) -> None:
        """Owner and mode, on the descriptor (never through a link); the owner first (chown clears
        set-id bits)."""
        if self.owners:
            os.fchown(fd, member.uid, member.gid)
        os.fchmod(fd, stat.S_IMODE(member.mode))


def make_dirs(root: str | os.PathLike[str], path: str) -> None:
    """Make the directory ``path`` (absolute, as the image sees it) under ``root``, root's, mode 755;
    links on the way are followed inside the root."""
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        os.close(_Unpacker(root_fd, False, Bounds(), True).walk(split(path), create=True))
    finally:
        os.close(root_fd)


def split(name: str) -> list[str]:
    """The components of an archive path, relative to the root; ``UnsafeArchive`` if one is ``..``."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(f"entry {name!r} climbs out of the image")
    return parts


def remove(parent: int, name: str) -> None:
    """Remove ``name`` from the directory ``parent`` (a whole tree if it is a directory), never following a link."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        if sys.version_info >= (3, 11):
            shutil.rmtree(name, dir_fd=parent)
        else:  # no dir_fd before 3.11: the same directory, named through the descriptor
            shutil.rmtree(f"/proc/self/fd/{parent}/{name}")
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)


def is_enospc(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
