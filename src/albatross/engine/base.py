"""Engine protocol: token-in/token-out generation with per-token log-probs and policy versions.

Siblings: ``builtin/`` (PyTorch, in-process) and ``remote.py`` (vLLM / SGLang / ``albatross serve`` over HTTP);
``pool.py`` puts replicas behind one engine and ``launch.py`` builds the engine of a run config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

from albatross.config import default

if TYPE_CHECKING:
    from albatross.config import SamplingConfig


@dataclass
class SamplingParams:
    """How one request samples; temperature, top-p and top-k default to the ``[sampling]`` section's defaults."""

    temperature: float = default("sampling", "temperature")
    top_p: float = default("sampling", "top_p")
    top_k: int = default("sampling", "top_k")  # 0 = off
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (in the generated text); need a tokenizer

    @classmethod
    def from_config(cls, sampling: SamplingConfig, max_tokens: int, stop_token_ids: list[int] | None = None,
                    seed: int | None = None) -> SamplingParams:
        """The ``[sampling]`` section's temperature, top-p and top-k, for requests of ``max_tokens``."""
        return cls(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                   max_tokens=max_tokens, stop_token_ids=list(stop_token_ids or []), seed=seed)


@dataclass
class Completion:
    token_ids: list[int]  # generated ids, including the stop token if one was hit
    logprobs: list[float]  # log-prob of each generated id under the sampling distribution
    versions: list[int]  # policy version that produced each id
    finish_reason: str  # "stop" (stop token or stop string) or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled again)
    routing: list[list[list[int]]] | None = None  # per generated token, per MoE layer: the chosen experts (routing replay)


@dataclass
class Stats:
    """Counters since start (read from any thread; written by the engine's worker only)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    forward_passes: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(frozen=True)
class EngineMetrics:
    """What an engine measures of itself (``albatross serve``'s ``/health`` and ``/metrics``); a field it does
    not measure is None. Only an engine running a model in this process (``BuiltinEngine``) fills them in."""

    closed: bool = False  # shut down: it takes no more requests
    positions: int | None = None  # the model's positions (``max_position_embeddings``)
    stats: Stats | None = None  # a snapshot of its counters
    running_requests: int | None = None  # requests in the running batch
    waiting_requests: int | None = None  # requests waiting to join it
    prefix_cache_tokens: int | None = None  # tokens the prefix cache holds


class EngineError(RuntimeError):
    """The engine could not serve a request (its process died, its server is unreachable): an
    infrastructure error for the attempt, which is retried, never a failure of the model."""


class Engine(Protocol):
    """Every member a caller of an engine uses; ``SingleEngine`` gives the defaults of a one-replica engine."""

    restarts: int  # replica processes started again after dying

    @property
    def version(self) -> int:
        """Policy version of the weights the next tokens come from."""
        ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Generate one completion per prompt (batched). Thread-safe."""
        ...

    def update_weights(self, path: str, version: int) -> None:
        """Load weights from a safetensors checkpoint directory; later tokens carry ``version``. Requests in flight
        keep running. An empty ``path`` (an ``EnginePool``, or a client of a vLLM / SGLang server): the weights
        were pushed into the servers over NCCL already, and only the version label moves."""
        ...

    def session(self) -> Engine:
        """An engine for one attempt, bound to the replica that holds its KV cache; ``close()`` releases it (and
        never closes the engine itself)."""
        ...

    @property
    def busy_seconds(self) -> float | None:
        """Seconds spent generating so far, summed over replicas (the rest of the wall time they were idle);
        None when the engine does not measure it."""
        ...

    @property
    def num_replicas(self) -> int: ...

    def metrics(self) -> EngineMetrics:
        """What the engine measures of itself now (``EngineMetrics``)."""
        ...

    def pids(self) -> dict[str, int]:
        """Processes this engine started (``run/pids.json``), by name."""
        ...

    def close(self) -> None: ...


class SingleEngine:
    """Defaults for an engine that is one replica: its sessions are itself, nothing restarts, no processes."""

    restarts = 0

    def session(self) -> Engine:
        # a subclass is an Engine: it adds version, generate, update_weights and close to these defaults
        return _Borrowed(cast(Engine, self))

    @property
    def busy_seconds(self) -> float | None:
        return None

    @property
    def num_replicas(self) -> int:
        return 1

    def metrics(self) -> EngineMetrics:
        return EngineMetrics()

    def pids(self) -> dict[str, int]:
        return {}


class _Borrowed(SingleEngine):
    """A one-replica engine lent to one attempt: everything but ``close`` goes to the engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.engine.generate(prompts, params)

    def update_weights(self, path: str, version: int) -> None:
        self.engine.update_weights(path, version)

    def close(self) -> None:
        pass
