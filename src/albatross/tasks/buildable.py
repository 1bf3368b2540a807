"""Whether a task's environment can be built here: what its Dockerfile asks for that this machine cannot
give (an unparseable file, an unsupported instruction, a FROM image without a local base), and what the
local sandbox ignores of it."""

from __future__ import annotations

from albatross.sandbox.dockerfile import DockerfileError, From, Ignored, parse_dockerfile
from albatross.sandbox.images import base_notes, base_problem
from albatross.tasks.format import Task


def dockerfile_problem(task: Task) -> str:
    """Why the Dockerfile cannot be built here (unparseable, unsupported instruction, unmappable
    FROM image), or "". A FROM naming an earlier stage of a multi-stage build is no image."""
    try:
        instructions = parse_dockerfile(task.dockerfile)
    except DockerfileError as e:
        return str(e)
    stages: set[str] = set()
    for ins in instructions:
        if not isinstance(ins, From):
            continue
        problem = None if ins.image.lower() in stages else base_problem(ins.image)
        if problem:
            return f"{task.dockerfile}:{ins.line}: {problem}"
        stages.update([ins.name] if ins.name else [])
    return ""


def dockerfile_notes(task: Task) -> list[str]:
    """The instructions the local sandbox ignores (CMD, USER, EXPOSE, ...), each with its line and why,
    and how each FROM image's base differs from the image (``images.base_notes``)."""
    try:
        instructions = parse_dockerfile(task.dockerfile)
    except DockerfileError:
        return []
    stages = {i.name.lower() for i in instructions if isinstance(i, From) and i.name}
    notes = [n for i in instructions if isinstance(i, From) and i.image.lower() not in stages
             for n in base_notes(i.image)]
    return notes + [f"line {i.line} {i.keyword} ignored ({i.note})" for i in instructions if isinstance(i, Ignored)]
