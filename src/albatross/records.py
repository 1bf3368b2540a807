"""Data contracts: Turn, Sample, Trajectory, Group, Batch.

Plain dataclasses, JSON-serialisable with ``to_dict`` / ``from_dict``. These are what flows between
the harness, the orchestrator and the trainer, and what is written as JSONL under a run directory so
that every attempt can be inspected afterwards.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

# Attempt statuses (DESIGN.md, Contracts). Only ``infra_error`` is never scored.
STATUS_OK = "ok"
STATUS_AGENT_TIMEOUT = "agent_timeout"
STATUS_FORMAT_ERROR = "format_error"
STATUS_MAX_TURNS = "max_turns"
STATUS_MAX_TOKENS = "max_tokens"  # the generated-token budget of the attempt
STATUS_MAX_CONTEXT = "max_context"  # the context budget, after any compression
STATUS_INFRA_ERROR = "infra_error"
STATUSES = (
    STATUS_OK,
    STATUS_AGENT_TIMEOUT,
    STATUS_FORMAT_ERROR,
    STATUS_MAX_TURNS,
    STATUS_MAX_TOKENS,
    STATUS_MAX_CONTEXT,
    STATUS_INFRA_ERROR,
)


@dataclass
class Turn:
    """One model turn and what the environment answered."""

    action: str  # the model's raw completion text
    command: str | None  # the parsed command, None if the action was malformed
    observation: str  # what the agent was shown next (possibly truncated)
    completion_tokens: int
    observation_tokens: int
    exit_code: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    tool: str | None = None  # the tool called ("bash", "read_file", ...), None if the action was malformed
    context_tokens: int = 0  # length of the context the model saw when it wrote this action


@dataclass
class Sample:
    """One continuous token sequence for the trainer.

    ``loss_mask[t]`` is 1 for tokens the model generated and 0 for prompt and observation tokens.
    ``logprobs[t]`` is the rollout (behaviour-policy) log-prob of a model token, 0.0 elsewhere.
    ``versions[t]`` is the policy version that generated a model token, -1 elsewhere.
    ``routing[t]`` (routing replay, optional): the experts the engine chose per MoE layer at the position whose
    logits sampled model token t (``[]`` elsewhere); None when not recorded (and then not serialised).
    """

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    routing: list[list[list[int]]] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError(
                f"Sample fields differ in length: ids={n} mask={len(self.loss_mask)} "
                f"logprobs={len(self.logprobs)} versions={len(self.versions)}"
            )
        if self.routing is not None and len(self.routing) != n:
            raise ValueError(f"Sample.routing has {len(self.routing)} entries for {n} tokens")

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    def extend(self, ids: list[int], *, model: bool, logprobs: list[float] | None = None,
               versions: list[int] | None = None, routing: list[list[list[int]]] | None = None) -> None:
        """Append tokens: model tokens carry log-probs and versions (and their routing when recorded), others
        get 0.0 / -1 (and ``[]``)."""
        if routing is not None and self.routing is None:
            self.routing = [[] for _ in self.token_ids]
        if self.routing is not None:
            known = model and routing is not None and len(routing) == len(ids)
            self.routing.extend(routing if known and routing is not None else [[] for _ in ids])
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if model else 0] * len(ids))
        if model:
            assert logprobs is not None and versions is not None
            assert len(logprobs) == len(ids) == len(versions)
            self.logprobs.extend(logprobs)
            self.versions.extend(versions)
        else:
            self.logprobs.extend([0.0] * len(ids))
            self.versions.extend([-1] * len(ids))


@dataclass
class Reward:
    """Reward breakdown of one attempt (DESIGN.md: calibrated partial credit + efficiency)."""

    metrics: dict[str, float] = field(default_factory=dict)  # verifier's per-test results
    success: bool = False  # all tests pass
    partial_credit: float = 0.0  # p_i, weighted fraction of tests passed
    efficiency: float = 0.0  # the efficiency term subtracted from a success
    score: float = 0.0  # final s_i in [0, 1]


@dataclass
class Trajectory:
    task_id: str
    group_id: str
    attempt: int
    samples: list[Sample] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: Reward = field(default_factory=Reward)
    status: str = STATUS_OK
    error: str = ""  # infra error or verifier message
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_seconds: float = 0.0
    cost: float = 0.0
    # Tokens the engine read over all model calls (each call reads its whole context): with
    # ``completion_tokens``, what a trial costs.
    input_tokens: int = 0
    # Each context compression: {"turn", "reason", "method", "tokens_before", "tokens_after", "sample"}.
    compressions: list[dict[str, Any]] = field(default_factory=list)
    network: str = ""  # the attempt's network policy (none, registries, open; "" in records from before it)
    # Changes the attempt made to /usr, /etc, /bin, /lib ... when its task's tests run in its own toolchain.
    system_changes: list[str] = field(default_factory=list)
    # ``git diff`` of the task's working directory when the agent finished (files it added included), before
    # the verifier ran; "" when the working directory is no git repository.
    diff: str = ""

    @property
    def success(self) -> bool:
        return self.reward.success

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for s in d["samples"]:
            if s.get("routing") is None:  # routing is serialised only when recorded
                s.pop("routing", None)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        d["samples"] = [Sample(**s) for s in d.get("samples", [])]
        d["turns"] = [Turn(**t) for t in d.get("turns", [])]
        d["reward"] = Reward(**d.get("reward", {}))
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class Group:
    """G attempts at one task; advantages are filled in by the orchestrator."""

    task_id: str
    group_id: str
    trajectories: list[Trajectory]
    advantages: list[float] = field(default_factory=list)
    dropped: str = ""  # why the group was dropped ("" if kept)


@dataclass
class TrainSample:
    """A Sample with the advantage of the trajectory it came from."""

    sample: Sample
    advantage: float
    task_id: str = ""


@dataclass
class Batch:
    """What the trainer consumes in one step."""

    samples: list[TrainSample]
    groups: int
    min_version: int  # oldest policy version of any model token in the batch
    info: dict[str, float] = field(default_factory=dict)  # groups seen / dropped (by reason) since the last batch

    @property
    def num_tokens(self) -> int:
        return sum(len(s.sample.token_ids) for s in self.samples)


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash is skipped, not fatal
    return out
