"""The Dockerfile subset parser: supported forms, substitution, and errors that name the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from albatross.sandbox.dockerfile import (
    Arg,
    Copy,
    DockerfileError,
    Env,
    From,
    Ignored,
    Run,
    Workdir,
    parse_dockerfile,
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
    assert got[6] == Copy(7, ("f",), "/opt/app/")


def test_ignored_instructions_carry_a_note(tmp_path: Path) -> None:
    path = write(tmp_path, 'FROM x\nCMD ["bash"]\nEXPOSE 80\nUSER nobody\nLABEL a=b\nENTRYPOINT ["sh"]\n')
    ignored = parse_dockerfile(path)[1:]
    assert [i.keyword for i in ignored] == ["CMD", "EXPOSE", "USER", "LABEL", "ENTRYPOINT"]
    assert all(isinstance(i, Ignored) and i.note for i in ignored)


def test_add_is_copy(tmp_path: Path) -> None:
    path = write(tmp_path, "FROM x\nADD a.txt b.txt /dst/\n")
    assert parse_dockerfile(path)[1] == Copy(2, ("a.txt", "b.txt"), "/dst/", "ADD")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("FROM x\nRUN true\nVOLUME /data\n", "Dockerfile:3: unsupported instruction VOLUME"),
        ("FROM x\nHEALTHCHECK CMD true\n", "Dockerfile:2: unsupported instruction HEALTHCHECK"),
        ("FROM x\nONBUILD RUN make\n", "Dockerfile:2: unsupported instruction ONBUILD"),
        ("FROM x\nARG\n", "Dockerfile:2: ARG needs a name"),
        ("WORKDIR /app\nFROM x\n", "Dockerfile:1: WORKDIR before FROM"),
        ("# only a comment\nARG V=1\n", "Dockerfile:1: no FROM instruction"),
        ("", "Dockerfile:1: no FROM instruction"),
        ('FROM x\nSHELL ["/bin/sh"]\n', "Dockerfile:2: unsupported instruction SHELL"),
        ("FROM x AS a\nFROM y\n", "Dockerfile:2: unsupported instruction FROM (multi-stage builds)"),
        ("FROM x\n\nCOPY --from=a /x /y\n", "Dockerfile:3: unsupported instruction COPY --from"),
        ("FROM x\nADD https://e.com/f /f\n", "Dockerfile:2: unsupported instruction ADD from a URL"),
        ("FROM x\nRUN <<EOF\necho\nEOF\n", "Dockerfile:2: unsupported instruction RUN with a heredoc"),
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
