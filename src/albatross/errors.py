"""The one user-error type: bad input from the person running albatross (a config field, a task directory, a
model directory, a command-line value). The CLI prints its message as one line and exits with code 2; every
module raises it (or a subclass naming its domain) instead of inventing its own handling."""

from __future__ import annotations


class UserError(Exception):
    """A one-line message naming the file and the field (or the value) that is wrong."""
