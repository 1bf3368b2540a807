"""The error a malformed task directory raises."""

from __future__ import annotations

from albatross.errors import UserError


class TaskFormatError(UserError, ValueError):
    """A task directory is malformed. The message is one line: ``<file>: <field> <problem>``."""
