"""Action parsers: model text -> a command, or a FormatError that becomes an observation."""

from __future__ import annotations

import re

SUBMIT = "submit"
_BLOCK_RE = re.compile(r"```(?:bash|sh)?\n(.*?)\n?```", re.DOTALL)


class FormatError(ValueError):
    """The model's action could not be parsed; the message is shown to the agent."""


def parse_bash_block(text: str) -> str:
    """Return the command of exactly one fenced bash block."""
    blocks = _BLOCK_RE.findall(text)
    if not blocks:
        raise FormatError("Format error: write exactly one command in a ```bash block.")
    if len(blocks) > 1:
        raise FormatError(f"Format error: found {len(blocks)} ```bash blocks; write exactly one.")
    command = blocks[0].strip()
    if not command:
        raise FormatError("Format error: the ```bash block is empty.")
    return command
