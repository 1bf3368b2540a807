"""The token context of an attempt, and its compression when it nears the context budget.

``Context`` holds the current ``Sample`` (token-in/token-out: the engine's exact completion ids, then each
observation's delta ids, appended) and, per turn, the ids needed to rebuild a shorter context:

1. **mask**: the first prompt, then every turn's action ids with the observations of all but the last
   ``keep`` turns replaced by a one-line note.
2. **summary** (if masking is not enough): the model is asked, with ``SUMMARY_REQUEST`` appended to the
   masked context, to summarise its progress; the attempt continues from the first prompt with the
   summary added to the instruction, then the last ``keep`` turns in full.

A rebuilt context is not a prefix of the old one, so it starts a new ``Sample`` (DESIGN.md, Contracts);
the old sample keeps its tokens (and the summary's tokens, which the model generated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from albatross.harness.chat import ChatFormat
from albatross.records import Sample

SUMMARY_REQUEST = (
    "Your context is almost full. Summarise your progress for yourself: what the task is, what you did, "
    "what you found (file names, commands, results) and what remains to be done. Write the summary only; "
    "you will continue from it."
)
SUMMARY_HEADER = "\n\nSummary of your progress so far (earlier turns were removed to save context):\n"


def masked_note(n_tokens: int) -> str:
    return f"[output omitted to save context ({n_tokens} tokens)]\n"


@dataclass
class TurnIds:
    """One turn's exact ids: the model's action and the observation delta that followed it."""

    action: list[int]
    observation: list[int]
    closed: bool  # the action ended with a stop token
    masked: list[int] | None = None  # the delta of the masked note, computed once


@dataclass
class Context:
    """The current sample, plus what compression needs to rebuild a shorter one."""

    fmt: ChatFormat
    instruction: str
    tools: list[dict[str, Any]] | None = None
    prompt: list[int] = field(default_factory=list)  # the first prompt (with the summary, once summarised)
    turns: list[TurnIds] = field(default_factory=list)
    base: int = 0  # turns before this one are covered by the summary
    sample: Sample = field(default_factory=lambda: Sample([], [], [], []))
    pending: TurnIds | None = None  # the action of the turn in progress
    summary_text: str = ""  # the model's latest summary of its progress

    def __post_init__(self) -> None:
        self.prompt = self.fmt.initial_prompt(self.instruction, self.tools)
        self.sample.extend(self.prompt, model=False)

    def __len__(self) -> int:
        return len(self.sample.token_ids)

    def add_action(self, ids: list[int], logprobs: list[float], versions: list[int],
                   routing: list[list[list[int]]] | None = None) -> None:
        self.sample.extend(ids, model=True, logprobs=logprobs, versions=versions, routing=routing)
        self.pending = TurnIds(list(ids), [], bool(ids) and ids[-1] in self.fmt.stop_ids)

    def add_observation(self, text: str) -> list[int]:
        """Append an observation after the pending action; returns its delta ids."""
        assert self.pending is not None, "an observation follows an action"
        ids = self.fmt.observation(text, closed=self.pending.closed)
        self.sample.extend(ids, model=False)
        self.pending.observation = ids
        self.turns.append(self.pending)
        self.pending = None
        return ids

    # rebuilding -----------------------------------------------------------------------------------
    def masked_ids(self, keep: int) -> list[int]:
        """First prompt + every turn since ``base``, observations of all but the last ``keep`` masked."""
        ids = list(self.prompt)
        recent = self.turns[self.base:]
        for i, turn in enumerate(recent):
            ids += turn.action
            if i >= len(recent) - keep:
                ids += turn.observation
                continue
            if turn.masked is None:
                turn.masked = self.fmt.observation(masked_note(len(turn.observation)), closed=turn.closed)
            ids += turn.masked if len(turn.masked) < len(turn.observation) else turn.observation
        return ids

    def summarised(self, summary: str, keep: int) -> list[int]:
        """Continue from the first prompt with ``summary`` in the instruction, then the last ``keep`` turns."""
        text = self.instruction.strip() + SUMMARY_HEADER + summary.strip()
        self.prompt = self.fmt.initial_prompt(text, self.tools)
        self.base = max(self.base, len(self.turns) - keep)
        return self.masked_ids(keep)

    def restart(self, ids: list[int]) -> Sample:
        """Start a new sample from rebuilt ``ids`` (all context, no model tokens); returns it."""
        self.sample = Sample([], [], [], [])
        self.sample.extend(ids, model=False)
        return self.sample
