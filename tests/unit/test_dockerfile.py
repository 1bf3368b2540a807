"""The Dockerfile parser and COPY/ADD semantics: each case states what Docker (BuildKit) does."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from albatross.sandbox.build import (
    EnvBuildError,
    Parent,
    apply_dockerfile,
    copy_tar,
    resolve_chown,
    resolve_user,
)
from albatross.sandbox.dockerfile import (
    DEFAULT_PATH,
    Arg,
    Command,
    Copy,
    DockerfileError,
    Env,
    From,
    Ignored,
    Run,
    User,
    Workdir,
    parse_dockerfile,
    platform_args,
    required_stages,
    split_stages,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    return path


def test_basic_instructions(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "# a comment\n"
        "FROM python:3.11-slim\n"
        "\n"
        "WORKDIR /app\n"
        "COPY data/ /app/\n"
        "ENV FOO=bar\n"
        "RUN echo built > /app/built.txt\n",
    )
    assert parse_dockerfile(path) == [
        From(2, "python:3.11-slim"),
        Workdir(4, "/app"),
        Copy(5, ("data/",), "/app/"),
        Env(6, (("FOO", "bar"),)),
        Run(7, "echo built > /app/built.txt"),
    ]


def test_continuations_keep_the_first_line_number_and_skip_comments(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "FROM ubuntu\nRUN apt-get update && \\\n    # a comment inside\n    apt-get install -y git\nWORKDIR /w\n",
    )
    instructions = parse_dockerfile(path)
    assert instructions[1] == Run(2, "apt-get update &&     apt-get install -y git")
    assert instructions[2] == Workdir(5, "/w")


def test_exec_form_run_and_json_copy(tmp_path: Path) -> None:
    path = write(tmp_path, 'FROM x\nRUN ["python3", "-c", "print(1)"]\nCOPY ["a b.txt", "/dst/"]\n')
    _, run, copy = parse_dockerfile(path)
    assert run == Run(2, ("python3", "-c", "print(1)"))
    assert copy == Copy(3, ("a b.txt",), "/dst/")


def test_env_forms_and_quotes(tmp_path: Path) -> None:
    path = write(tmp_path, 'FROM x\nENV A=1 B="two words" C=\nENV D hello world\n')
    _, env1, env2 = parse_dockerfile(path)
    assert env1.pairs == (("A", "1"), ("B", "two words"), ("C", ""))
    assert env2.pairs == (("D", "hello world"),)


def test_arg_defaults_and_substitution(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "ARG BASE=debian\nFROM ${BASE}:12\nARG DIR=/opt/app\nARG EMPTY\n"
        "ENV HOME_DIR=$DIR/home X=${EMPTY:-fallback}\nWORKDIR ${DIR}\nCOPY --chown=1:1 f $DIR/\n",
    )
    got = parse_dockerfile(path)
    assert got[0] == Arg(1, "BASE", "debian")
    assert got[1] == From(2, "debian:12")
    assert got[3] == Arg(4, "EMPTY", None)
    assert got[4] == Env(5, (("HOME_DIR", "/opt/app/home"), ("X", "fallback")))
    assert got[5] == Workdir(6, "/opt/app")
    assert got[6] == Copy(7, ("f",), "/opt/app/", chown="1:1")


def test_ignored_instructions_carry_a_note(tmp_path: Path) -> None:
    path = write(tmp_path, "FROM x\nEXPOSE 80\nLABEL a=b\nVOLUME /data\nHEALTHCHECK CMD true\nSTOPSIGNAL SIGINT\n"
                 "ONBUILD RUN make\nMAINTAINER me\n")
    ignored = parse_dockerfile(path)[1:]
    assert [i.keyword for i in ignored] == ["EXPOSE", "LABEL", "VOLUME", "HEALTHCHECK", "STOPSIGNAL", "ONBUILD",
                                            "MAINTAINER"]
    assert all(isinstance(i, Ignored) and i.note for i in ignored)


def test_add_is_copy(tmp_path: Path) -> None:
    path = write(tmp_path, "FROM x\nADD a.txt b.txt /dst/\n")
    assert parse_dockerfile(path)[1] == Copy(2, ("a.txt", "b.txt"), "/dst/", "ADD")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("FROM x\nRUN true\nFROBNICATE /data\n", "Dockerfile:3: unsupported instruction FROBNICATE"),
        ("FROM x\nARG\n", "Dockerfile:2: ARG needs a name"),
        ("WORKDIR /app\nFROM x\n", "Dockerfile:1: WORKDIR before FROM"),
        ("# only a comment\nARG V=1\n", "Dockerfile:1: no FROM instruction"),
        ("", "Dockerfile:1: no FROM instruction"),
        ("FROM x\nSHELL /bin/sh -c\n", "Dockerfile:2: SHELL takes the JSON form"),
        ("FROM x AS a\nFROM y AS A\n", "Dockerfile:2: stage name a is used twice"),
        ("FROM x AS 1a\n", "Dockerfile:1: FROM ... AS 1a: a stage name starts with a letter"),
        ("FROM x\n\nCOPY https://e.com/f /f\n", "Dockerfile:3: COPY cannot copy a URL"),
        ("FROM x\nRUN <<EOF\necho\n", "Dockerfile:2: heredoc EOF is not terminated"),
        ("FROM x\nCOPY --parents a /b/\n", "Dockerfile:2: unsupported COPY flag --parents"),
        ("FROM x\nCOPY --chmod=u+x a /b\n", "Dockerfile:2: COPY --chmod=u+x: only octal modes"),
        ("FROM x\nRUN --mount=type=secret,id=k cat /run/secrets/k\n", "Dockerfile:2: unsupported RUN flag --mount"),
        ("FROM x\nENV A=${UNSET:?must be set}\n", "Dockerfile:2: cannot expand"),
        ("FROM x\nARG 9x=1\n", "Dockerfile:2: ARG '9x': not a variable name"),
        ("FROM x\nCOPY onlyone\n", "Dockerfile:2: COPY needs at least one source and a destination"),
        ('FROM x\nENV A="unclosed\n', "Dockerfile:2: cannot split arguments"),
        ("FROM x\nENV LONELY\n", "Dockerfile:2: ENV LONELY needs a value"),
    ],
)
def test_errors_name_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(DockerfileError) as info:
        parse_dockerfile(path)
    assert message in str(info.value)
    assert str(info.value).startswith(str(path))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DockerfileError, match="cannot read"):
        parse_dockerfile(tmp_path / "Dockerfile")


def test_binary_dockerfile_is_a_named_error(tmp_path: Path) -> None:
    path = tmp_path / "Dockerfile"
    path.write_bytes(b"FROM x\n\xff\xfe\x00")
    with pytest.raises(DockerfileError, match=f"^{path}: cannot read"):
        parse_dockerfile(path)


def test_arg_before_from_is_allowed(tmp_path: Path) -> None:
    path = write(tmp_path, "ARG BASE=debian\nFROM ${BASE}:12\n")
    assert parse_dockerfile(path)[1] == From(2, "debian:12")


# --------------------------------------------------------------------------------- variables and scope


def test_env_on_one_line_sees_the_values_before_that_line(tmp_path: Path) -> None:
    # Docker's reference: `ENV abc=bye def=$abc` gives def the previous abc ("hello"); the next line sees "bye"
    path = write(tmp_path, "FROM x\nENV abc=hello\nENV abc=bye def=$abc\nENV ghi=$abc\n")
    _, _, env2, env3 = parse_dockerfile(path)
    assert env2.pairs == (("abc", "bye"), ("def", "hello"))
    assert env3.pairs == (("ghi", "bye"),)


def test_quotes_and_escapes_as_docker_processes_words(tmp_path: Path) -> None:
    # single quotes: literal; double quotes: expanded; backslash escapes $; the legacy form drops quotes
    path = write(tmp_path, "FROM x\nENV V=1\nENV A='$V' B=\"$V x\" C=\\$V D=${V}2\nENV E \"two words\"\n")
    _, _, env, legacy = parse_dockerfile(path)
    assert env.pairs == (("A", "$V"), ("B", "1 x"), ("C", "$V"), ("D", "12"))
    assert legacy.pairs == (("E", "two words"),)


def test_substitution_modifiers_tell_unset_from_empty(tmp_path: Path) -> None:
    # ${V:-w} replaces unset or empty, ${V-w} only unset; ${V:+w} is w when set and non-empty
    path = write(tmp_path, "FROM x\nARG EMPTY=\"\"\nENV A=${EMPTY:-w} B=${EMPTY-w} C=${NONE-w} D=${EMPTY:+w} "
                 "E=${EMPTY+w} F=${NONE:+w}\n")
    env = parse_dockerfile(path)[2]
    assert dict(env.pairs) == {"A": "w", "B": "", "C": "w", "D": "", "E": "w", "F": ""}


def test_global_args_reach_from_lines_and_stages_that_declare_them(tmp_path: Path) -> None:
    # an ARG before FROM is outside every stage: `ARG V` inside a stage brings its value in
    path = write(tmp_path, "ARG V=3.11\nFROM python:$V\nENV BEFORE=x$V\nARG V\nENV AFTER=x$V\n")
    got = parse_dockerfile(path)
    assert got[1] == From(2, "python:3.11")
    assert got[2] == Env(3, (("BEFORE", "x"),))
    assert got[3] == Arg(4, "V", "3.11")
    assert got[4] == Env(5, (("AFTER", "x3.11"),))


def test_platform_args_are_predefined(tmp_path: Path) -> None:
    path = write(tmp_path, "FROM img-$TARGETOS\nARG TARGETARCH\nWORKDIR /opt/$TARGETARCH\n")
    got = parse_dockerfile(path)
    assert got[0].image == "img-linux"
    assert got[2] == Workdir(3, f"/opt/{platform_args()['TARGETARCH']}")
    assert platform_args()["TARGETPLATFORM"] == f"linux/{platform_args()['TARGETARCH']}"


def test_unset_variables_come_from_the_image_environment(tmp_path: Path) -> None:
    # `ENV PATH=/opt/bin:$PATH` extends the base image's PATH, not an empty one
    path = write(tmp_path, "FROM python:3.11\nENV PATH=/opt/bin:$PATH\nENV L=$LANG\n")
    got = parse_dockerfile(path)
    assert got[1] == Env(2, (("PATH", f"/opt/bin:{DEFAULT_PATH}"),))
    own = parse_dockerfile(path, image_env=lambda image: {"PATH": "/usr/local/bin:/bin", "LANG": "C.UTF-8"})
    assert own[1] == Env(2, (("PATH", "/opt/bin:/usr/local/bin:/bin"),))
    assert own[2] == Env(3, (("L", "C.UTF-8"),))


def test_escape_directive_changes_the_continuation_character(tmp_path: Path) -> None:
    path = write(tmp_path, "# escape=`\nFROM x\nRUN echo a `\n    b\n")
    assert parse_dockerfile(path)[1] == Run(3, "echo a     b")


# ------------------------------------------------------------------------------------- stages


def test_multi_stage_names_split_and_needs(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "ARG V=1\nFROM debian:12 AS Build\nENV B=1\nRUN make\n"
        "FROM debian:12 AS unused\nRUN true\n"
        "FROM build AS test\nENV C=$B\n"
        "FROM python:3.11\nCOPY --from=test /out /app/\nCOPY --from=0 /x /y\nCOPY --from=ghcr.io/a/uv:1 /uv /bin/\n",
    )
    instructions = parse_dockerfile(path)
    stages = split_stages(instructions)
    assert [(s.index, s.name, s.base, s.base_stage) for s in stages] == [
        (0, "build", "debian:12", None), (1, "unused", "debian:12", None), (2, "test", "build", 0),
        (3, None, "python:3.11", None)]
    assert stages[2].instructions[1] == Env(8, (("C", "1"),))  # a stage FROM an earlier one inherits its ENV
    assert stages[3].copies_from == ("test", "0", "ghcr.io/a/uv:1")
    assert stages[0].instructions[0] == From(2, "debian:12", "build")
    assert required_stages(stages) == [0, 2, 3]  # stage 1 is not needed; an image reference needs no stage
    assert stages[2].ref_keys() == ("2", "test")


def test_shell_changes_run_and_shell_form_cmd(tmp_path: Path) -> None:
    # RUN's shell form runs through SHELL (default /bin/sh -c); CMD's shell form is stored as [*SHELL, text]
    path = write(tmp_path, 'FROM x\nRUN a\nSHELL ["/bin/bash", "-o", "pipefail", "-c"]\nRUN b | c\n'
                 'CMD python3 app.py\nENTRYPOINT ["/entry.sh"]\nUSER ${NAME:-app}:grp\n')
    got = parse_dockerfile(path)
    assert got[1] == Run(2, "a", ("/bin/sh", "-c"))
    assert got[2] == Run(4, "b | c", ("/bin/bash", "-o", "pipefail", "-c"))
    assert got[3] == Command(5, "CMD", ("/bin/bash", "-o", "pipefail", "-c", "python3 app.py"))
    assert got[4] == Command(6, "ENTRYPOINT", ("/entry.sh",))
    assert got[5] == User(7, "app:grp")


def test_copy_flags_and_json_form(tmp_path: Path) -> None:
    path = write(tmp_path, 'FROM x\nARG U=app\nCOPY --from=build --chown=$U:staff --chmod=0640 --link ["/a b", "/c"]\n'
                 "ADD --checksum=sha256:00 https://e.com/f.tgz /opt/\n")
    got = parse_dockerfile(path)
    assert got[2] == Copy(3, ("/a b",), "/c", "COPY", "build", "app:staff", 0o640)
    assert got[3] == Copy(4, ("https://e.com/f.tgz",), "/opt/", "ADD")


def test_run_cache_mounts_and_network_flags_are_accepted(tmp_path: Path) -> None:
    path = write(tmp_path, "FROM x\nRUN --mount=type=cache,target=/root/.cache/pip --network=default pip install a\n")
    assert parse_dockerfile(path)[1] == Run(2, "pip install a")


# ------------------------------------------------------------------------------------- heredocs


def test_run_heredoc_runs_its_body_through_the_shell(tmp_path: Path) -> None:
    path = write(tmp_path, "FROM x\nRUN <<EOF\nset -e\necho one\nEOF\nWORKDIR /w\n")
    got = parse_dockerfile(path)
    assert got[1] == Run(2, "set -e\necho one\n")
    assert got[2] == Workdir(6, "/w")  # the body is not read as instructions


def test_run_heredoc_as_stdin_is_handed_to_the_shell_whole(tmp_path: Path) -> None:
    # `RUN cat <<-EOT > f`: the shell gets the line, the body and the terminator (and strips the tabs)
    path = write(tmp_path, "FROM x\nRUN cat <<-EOT > /f\n\thello $V\n\tEOT\n")
    assert parse_dockerfile(path)[1] == Run(2, "cat <<-EOT > /f\n\thello $V\n\tEOT")


def test_run_heredoc_with_a_shebang_is_executed_as_a_file(tmp_path: Path) -> None:
    path = write(tmp_path, "FROM x\nRUN <<EOF\n#!/usr/bin/env python3\nprint(1)\nEOF\n")
    command = parse_dockerfile(path)[1].command
    assert "#!/usr/bin/env python3\nprint(1)\n" in command and 'chmod +x "$f"' in command


def test_copy_heredoc_expands_unless_the_delimiter_is_quoted(tmp_path: Path) -> None:
    path = write(tmp_path, "FROM x\nARG V=7\nCOPY <<EOF /a.txt\nv=$V\nEOF\nCOPY <<'EOF' <<two /d/\nv=$V\nEOF\nx\ntwo\n")
    got = parse_dockerfile(path)
    assert got[2] == Copy(3, (), "/a.txt", inline=(("EOF", "v=7\n"),))
    assert got[3] == Copy(6, (), "/d/", inline=(("EOF", "v=$V\n"), ("two", "x\n")))


# ------------------------------------------------------------------------------------- COPY / ADD


def tar_members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: m for m in tar.getmembers()}


def context(tmp_path: Path) -> Path:
    env = tmp_path / "env"
    (env / "data" / "sub").mkdir(parents=True)
    (env / "data" / "a.txt").write_text("a\n")
    (env / "data" / "sub" / "b.txt").write_text("b\n")
    (env / "f.py").write_text("print(1)\n")
    (env / "g.py").write_text("print(2)\n")
    return env


def test_copy_directory_copies_its_contents(tmp_path: Path) -> None:
    env = context(tmp_path)
    names = set(tar_members(copy_tar(Copy(1, ("data",), "/app"), env, "/", dest_kind="dir")))
    assert names == {"app/a.txt", "app/sub", "app/sub/b.txt"}  # not app/data/...; /app itself kept as it is
    new = set(tar_members(copy_tar(Copy(1, ("data",), "/new"), env, "/", dest_kind="missing")))
    assert new == {"new", "new/a.txt", "new/sub", "new/sub/b.txt"}  # a missing destination is created


def test_copy_file_into_an_existing_directory(tmp_path: Path) -> None:
    # `WORKDIR /app` then `COPY f.py /app`: Docker puts the file at /app/f.py, since /app is a directory
    env = context(tmp_path)
    assert list(tar_members(copy_tar(Copy(1, ("f.py",), "/app"), env, "/", dest_kind="dir"))) == ["app/f.py"]
    assert list(tar_members(copy_tar(Copy(1, ("f.py",), "/app"), env, "/", dest_kind="missing"))) == ["app"]
    assert list(tar_members(copy_tar(Copy(1, ("f.py",), "out/"), env, "/w", dest_kind="missing"))) == ["w/out/f.py"]
    assert list(tar_members(copy_tar(Copy(1, ("f.py",), "."), env, "/w", dest_kind="dir"))) == ["w/f.py"]


def test_copy_globs_and_several_sources_go_into_the_destination(tmp_path: Path) -> None:
    env = context(tmp_path)
    assert sorted(tar_members(copy_tar(Copy(1, ("*.py",), "/app/"), env, "/"))) == ["app/f.py", "app/g.py"]
    several = copy_tar(Copy(1, ("f.py", "data/a.txt"), "/x/"), env, "/", dest_kind="missing")
    assert sorted(tar_members(several)) == ["x/a.txt", "x/f.py"]
    with pytest.raises(EnvBuildError, match=r"Dockerfile:1: COPY \*\.rs: no source files"):
        copy_tar(Copy(1, ("*.rs",), "/app/"), env, "/")
    with pytest.raises(EnvBuildError, match="COPY source nope.txt not found"):
        copy_tar(Copy(1, ("nope.txt",), "/app/"), env, "/")


def test_copy_owner_is_root_unless_chown_and_chmod_sets_the_mode(tmp_path: Path) -> None:
    env = context(tmp_path)
    os.chmod(env / "f.py", 0o600)
    plain = tar_members(copy_tar(Copy(1, ("f.py",), "/f.py"), env, "/"))["f.py"]
    assert (plain.uid, plain.gid, plain.mode) == (0, 0, 0o600)
    owned = tar_members(copy_tar(Copy(1, ("data",), "/d", chmod=0o750), env, "/", owner=(1000, 50)))
    assert {(m.uid, m.gid, m.mode) for m in owned.values()} == {(1000, 50, 0o750)}


def test_add_extracts_local_archives_and_copy_does_not(tmp_path: Path) -> None:
    env = context(tmp_path)
    for mode, name in (("w:gz", "a.tar.gz"), ("w:bz2", "a.tbz"), ("w:xz", "a.txz"), ("w", "plain.bin")):
        with tarfile.open(env / name, mode) as tar:
            tar.add(env / "data", arcname="pkg")
        got = tar_members(copy_tar(Copy(1, (name,), "/opt/", "ADD"), env, "/", dest_kind="missing"))
        assert set(got) == {"opt/pkg", "opt/pkg/a.txt", "opt/pkg/sub", "opt/pkg/sub/b.txt"}, name
    copied = tar_members(copy_tar(Copy(1, ("a.tar.gz",), "/opt/"), env, "/", dest_kind="missing"))
    assert list(copied) == ["opt/a.tar.gz"]


def test_copy_heredoc_file(tmp_path: Path) -> None:
    data = copy_tar(Copy(1, (), "/etc/app.conf", inline=(("EOF", "k=v\n"),)), tmp_path, "/", dest_kind="missing")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.extractfile("etc/app.conf").read() == b"k=v\n"


def test_copy_from_a_stage_root_resolves_links_inside_it(tmp_path: Path) -> None:
    # COPY --from paths are absolute in the stage; an absolute link points into the stage, not the host
    stage = tmp_path / "stage"
    (stage / "opt" / "tool").mkdir(parents=True)
    (stage / "opt" / "tool" / "bin").write_text("tool\n")
    (stage / "usr" / "bin").mkdir(parents=True)
    os.symlink("/opt/tool/bin", stage / "usr" / "bin" / "tool")
    os.symlink("/etc/hostname", stage / "usr" / "bin" / "host")
    got = copy_tar(Copy(1, ("/usr/bin/tool",), "/bin/tool", from_="build"), tmp_path, "/", source_root=stage)
    with tarfile.open(fileobj=io.BytesIO(got)) as tar:
        assert tar.extractfile("bin/tool").read() == b"tool\n"
    with pytest.raises(EnvBuildError, match="not found"):  # /etc/hostname of the stage, which has none
        copy_tar(Copy(1, ("/usr/bin/host",), "/h", from_="build"), tmp_path, "/", source_root=stage)
    with pytest.raises(EnvBuildError, match="--from=build: the stage or image is not built here"):
        copy_tar(Copy(1, ("/x",), "/y", from_="build"), tmp_path, "/")


def test_add_of_a_url_names_the_host(tmp_path: Path) -> None:
    with pytest.raises(EnvBuildError, match="ADD https://example.com/f.tgz: needs example.com"):
        copy_tar(Copy(1, ("https://example.com/f.tgz",), "/opt/", "ADD"), tmp_path, "/")


# ------------------------------------------------------------------------------------- users


PASSWD = "root:x:0:0:root:/root:/bin/bash\napp:x:1000:1001::/home/app:/bin/sh\nnobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nstaff:x:50:app\napp:x:1001:\nnogroup:x:65534:\n"


def test_user_is_resolved_in_the_images_passwd() -> None:
    assert resolve_user("app", PASSWD, GROUP) == resolve_user("1000", PASSWD, GROUP)
    app = resolve_user("app", PASSWD, GROUP)
    assert (app.uid, app.gid, app.groups, app.home) == (1000, 1001, (50,), "/home/app")
    assert resolve_user("app:staff", PASSWD, GROUP).gid == 50
    stranger = resolve_user("4242", PASSWD, GROUP)  # a uid with no passwd entry: gid 0, home /
    assert (stranger.uid, stranger.gid, stranger.home) == (4242, 0, "/")
    with pytest.raises(EnvBuildError, match="no user 'ghost'"):
        resolve_user("ghost", PASSWD, GROUP)


def test_attempts_get_the_users_home_unless_env_sets_one() -> None:
    # docker exec: HOME from the USER's passwd entry (/ for a uid with none), unless ENV sets HOME
    parent = Parent("k", "/l", env={"A": "1"}, user="app", ids=resolve_user("app", PASSWD, GROUP))
    assert parent.attempt_env()["HOME"] == "/home/app" and parent.attempt_env()["A"] == "1"
    assert Parent("k", "/l", ids=resolve_user("4242", PASSWD, GROUP)).attempt_env()["HOME"] == "/"
    assert Parent("k", "/l", env={"HOME": "/h"}, ids=resolve_user("app", PASSWD, GROUP)).attempt_env()["HOME"] == "/h"
    assert Parent("k", "/l").attempt_env()["HOME"] == "/root"
    assert resolve_user("root", PASSWD, GROUP).root and not resolve_user("app", PASSWD, GROUP).root


def test_chown_without_a_group_uses_the_uid_as_gid() -> None:
    assert resolve_chown("app", PASSWD, GROUP) == (1000, 1000)  # Docker's rule, not app's primary group
    assert resolve_chown("app:staff", PASSWD, GROUP) == (1000, 50)
    assert resolve_chown("7:8", PASSWD, GROUP) == (7, 8)
    with pytest.raises(EnvBuildError, match="no group 'wheel'"):
        resolve_chown("app:wheel", PASSWD, GROUP)


def test_parent_records_user_entrypoint_cmd_and_env(tmp_path: Path) -> None:
    # no builder needed for these; Docker drops a CMD set before ENTRYPOINT only if it came from the base
    path = write(tmp_path, 'FROM x\nARG A=1\nENV E=$A\nUSER app\nCMD ["serve"]\nENTRYPOINT ["/e"]\n')
    parent = Parent("k", "/layer")
    apply_dockerfile(parse_dockerfile(path), parent, None, tmp_path, 10)
    assert (parent.image, parent.env, parent.user) == ("x", {"E": "1"}, "app")
    assert (parent.entrypoint, parent.cmd) == (["/e"], ["serve"])
    parent2 = Parent("k", "/layer", cmd=["from-base"])
    apply_dockerfile(parse_dockerfile(write(tmp_path, 'FROM x\nENTRYPOINT ["/e"]\n')), parent2, None, tmp_path, 10)
    assert parent2.cmd is None


def test_a_whole_multi_stage_list_is_refused_by_apply(tmp_path: Path) -> None:
    path = write(tmp_path, "FROM a AS one\nENV X=1\nFROM b\nENV Y=2\n")
    with pytest.raises(EnvBuildError, match="Dockerfile:3: a multi-stage build"):
        apply_dockerfile(parse_dockerfile(path), Parent("k", "/l"), None, tmp_path, 10)
    last = split_stages(parse_dockerfile(path))[-1]
    parent = Parent("k", "/l")
    apply_dockerfile(last.instructions, parent, None, tmp_path, 10)
    assert parent.env == {"Y": "2"} and parent.image == "b"


def test_dockerignore_leaves_files_out_of_the_context(tmp_path: Path) -> None:
    # Docker: excluded files are not in the build context, so COPY neither sees nor copies them
    env = context(tmp_path)
    (env / "tests").mkdir()
    (env / "tests" / "test_outputs.py").write_text("assert True\n")
    (env / "data" / "sub" / "__pycache__").mkdir()
    (env / "data" / "sub" / "__pycache__" / "m.pyc").write_text("x")
    (env / "run.log").write_text("log\n")
    (env / "keep.log").write_text("log\n")
    (env / ".dockerignore").write_text("# comment\n/tests\n*.log\n!keep.log\n**/__pycache__\n")
    names = set(tar_members(copy_tar(Copy(1, (".",), "/app/"), env, "/", dest_kind="dir")))
    assert "app/keep.log" in names and "app/data/sub/b.txt" in names and "app/.dockerignore" in names
    assert not {n for n in names if n.startswith("app/tests") or "__pycache__" in n or n == "app/run.log"}
    with pytest.raises(EnvBuildError, match="COPY source tests/test_outputs.py not found"):
        copy_tar(Copy(1, ("tests/test_outputs.py",), "/t/"), env, "/")
    assert sorted(tar_members(copy_tar(Copy(1, ("*.log",), "/l/"), env, "/"))) == ["l/keep.log"]


def test_shift_and_quoted_angles_are_no_heredoc(tmp_path: Path) -> None:
    path = write(tmp_path, "FROM x\nRUN echo \"a <<b\" $((1<<2))\nWORKDIR /w\n")
    assert parse_dockerfile(path)[1:] == [Run(2, 'echo "a <<b" $((1<<2))'), Workdir(3, "/w")]
