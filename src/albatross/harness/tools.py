"""Tools the agent acts through: the sandbox shell, and observation formatting."""

from __future__ import annotations

from albatross.sandbox.base import ExecResult


def truncate_middle(text: str, limit: int) -> str:
    """Keep the head and tail of ``text`` within ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    half = max(1, (limit - 40) // 2)
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters cut ...]\n{text[-half:]}"


def format_observation(result: ExecResult, limit: int) -> str:
    """What the agent sees after a command: its output, plus the exit code when it failed."""
    out = truncate_middle(result.output, limit)
    if result.timed_out:
        return out + f"\n[command timed out after {result.seconds:.0f}s and was killed]\n"
    if result.exit_code != 0:
        return out + f"[exit code {result.exit_code}]\n"
    return out
