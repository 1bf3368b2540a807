"""Built-in PyTorch engine: one model in this process, continuous batching on a worker thread.

``BuiltinEngine`` implements ``albatross.engine.base.Engine``: the runner (``runner.py``) runs the batch with a
KV grid and a prefix cache kept across turns (``kvcache.py``), n-gram speculative decoding
(``speculative.py``) and sampling (``sampling.py``); hybrid-cache models run on ``hybrid.py``, with MTP
speculative decoding on ``mtp_runner.py``; the scheduler (``scheduler.py``) admits requests from many threads
at every step and applies weight swaps between forward passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import torch

from albatross.config import default
from albatross.engine.base import Completion, EngineError, EngineMetrics, SamplingParams, SingleEngine, Stats
from albatross.engine.builtin.hybrid import HybridRunner, needs_hybrid
from albatross.engine.builtin.runner import (
    PREFIX_CACHE_TOKENS,
    Decode,
    ModelRunner,
    SpecConfig,
    check_state_dict,
    read_safetensors_dir,
)
from albatross.engine.builtin.scheduler import EngineClosed, Scheduler

__all__ = ["BuiltinEngine", "EngineClosed", "SpecConfig", "Stats"]


def _load_model(path: str, dtype: torch.dtype | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if not Path(path).is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if _is_vlm_checkpoint(path):  # glm5_next ships only as a vision-language model; its language model generates
        from albatross.models.tiny import load_any

        vlm: torch.nn.Module = load_any(path, dtype)
        return vlm
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model


def _is_vlm_checkpoint(path: str) -> bool:
    import json

    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "glm5_next"


def _default_decode(path: str) -> Decode | None:
    from albatross.engine.tokenizer import load_text_tokenizer

    try:
        return load_text_tokenizer(path).decode
    except FileNotFoundError:
        return None


def _mtp_runner(module: torch.nn.Module, source: torch.nn.Module | str, device: str, version: int,
                prefix_cache_tokens: int, spec: SpecConfig, decode: Decode | None, record_routing: bool) -> ModelRunner:
    """The runner of MTP speculative decoding; a model directory's MTP weights are loaded first."""
    from albatross.engine.builtin.mtp_runner import MtpRunner
    from albatross.models.mtp import get_mtp, load_mtp

    if record_routing:
        raise ValueError("routing replay (record_routing) with MTP speculative decoding is not supported yet")
    if isinstance(source, str) and get_mtp(module) is None:
        load_mtp(module, source)
    return MtpRunner(module, device, version, prefix_cache_tokens, spec.draft_tokens, decode)


def _match_mtp(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A trainer's weights for this engine's model: its MTP head's tensors (``mtp.*``) are dropped when the
    engine has no head, and the head keeps its own weights when the trainer sends none (``trainer.mtp = off``)."""
    from albatross.models.mtp import get_mtp

    head = get_mtp(model)
    if head is None:
        return {k: v for k, v in state_dict.items() if not k.startswith("mtp.")}
    if any(k.startswith("mtp.") for k in state_dict):
        return state_dict
    return {**state_dict, **{f"mtp.{k}": v for k, v in head.state_dict().items()}}


class BuiltinEngine(SingleEngine):
    """In-process engine. ``model`` is a transformers causal LM or the path of a directory holding one.

    ``speculative``: draft tokens per row and step of n-gram speculative decoding (0 = off), or a ``SpecConfig``
    (``method="mtp"``: drafts from the model's MTP head, ``mtp_runner.MtpRunner``; a model directory's MTP
    weights are loaded for it).
    ``prefix_cache_tokens``: token budget of the KV kept from finished requests for the next turn (0 = off).
    ``decode``: ids -> text, needed for stop strings (loaded from a model directory's tokenizer when there is one).
    ``fast_forward``: use ``fastpath.py``'s lean forward for Qwen2 / Llama models (else ``transformers``').
    ``record_routing``: record each generated token's experts per MoE layer in ``Completion.routing``.
    Models with hybrid caches (linear attention, indexers: ``qwen3_next``, ``qwen4_exp``, ``glm_moe_dsa``,
    ``glm5_next``) and models recording routing run on ``hybrid.HybridRunner``, one request per forward pass.
    """

    def __init__(
        self,
        model: torch.nn.Module | str,
        device: str = "cpu",
        max_batch_size: int = default("engine", "max_batch_size"),
        version: int = 0,
        dtype: torch.dtype | None = None,
        speculative: int | SpecConfig = 0,
        prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
        decode: Decode | None = None,
        max_prefill_tokens: int = 8192,
        fast_forward: bool = True,
        record_routing: bool = False,
    ) -> None:
        module = _load_model(model, dtype) if isinstance(model, str) else model
        if dtype is not None:
            module = module.to(dtype)
        if decode is None and isinstance(model, str):
            decode = _default_decode(model)
        spec = speculative if isinstance(speculative, SpecConfig) else SpecConfig(draft_tokens=speculative)
        if spec.method not in ("ngram", "mtp"):
            raise ValueError(f"speculative method must be 'ngram' or 'mtp', got {spec.method!r}")
        self.runner: ModelRunner
        if spec.method == "mtp" and spec.draft_tokens > 0:
            self.runner = _mtp_runner(module, model, device, version, prefix_cache_tokens, spec, decode,
                                      record_routing)
        elif record_routing or needs_hybrid(module):
            self.runner = HybridRunner(module, device, version, prefix_cache_tokens, spec, decode, record_routing)
        else:
            self.runner = ModelRunner(module, device, version, prefix_cache_tokens, spec, decode, fast_forward)
        self.scheduler = Scheduler(self.runner, max_batch_size, max_prefill_tokens)
        self._adapter_base: dict[str, torch.Tensor] = {}  # the base of the weights adapters touch (serve = adapter)

    @property
    def stats(self) -> Stats:
        return self.runner.stats

    @property
    def version(self) -> int:
        """Version of the weights the next forward pass will use."""
        return self.runner.version

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    def metrics(self) -> EngineMetrics:
        positions = self.scheduler.positions
        return EngineMetrics(closed=self.scheduler.closed, positions=positions if isinstance(positions, int) else None,
                             stats=replace(self.runner.stats), running_requests=self.runner.n_running,
                             waiting_requests=self.scheduler.n_waiting,
                             prefix_cache_tokens=self.runner.cached_tokens)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Completion]:
        return self.scheduler.submit(prompt_ids, params)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt; blocks until all are done. Thread-safe.

        A failure of the engine itself (closed, or a forward pass that raised) is an ``EngineError``: the
        harness counts it as an infrastructure error and re-runs the attempt, never scores it."""
        try:
            return [f.result() for f in self.scheduler.submit_many(prompts, params)]
        except (EngineError, ValueError):  # ValueError: a request the engine refuses (the caller's error)
            raise
        except Exception as e:  # a failed forward pass: IndexError, RuntimeError, out of memory ...
            raise EngineError(f"built-in engine: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from e

    @property
    def busy_seconds(self) -> float:
        """Seconds spent in forward passes so far (the rest of the wall time the engine was idle)."""
        return self.scheduler.busy_s

    def update_weights(self, path: str, version: int) -> None:
        """Load the safetensors checkpoint in directory ``path``; tokens after the swap carry ``version``. A PEFT
        adapter directory (``[trainer.lora] serve = "adapter"``) is merged into the base this engine holds: the
        weights it loaded last from a full checkpoint (its model at first)."""
        from albatross.engine.adapter import is_adapter_dir, merged_weights, read_adapter

        if not is_adapter_dir(path):
            self.update_weights_from_state_dict(read_safetensors_dir(path), version)
            self._adapter_base = {}
            return
        pairs, scale = read_adapter(path)
        current = self.runner.model.state_dict()
        for name in pairs:  # a weight no adapter touched yet is still the base
            if name not in self._adapter_base and name in current:
                self._adapter_base[name] = current[name].detach().clone()
        merged = merged_weights(self._adapter_base, pairs, scale, path)
        self.update_weights_from_state_dict({**current, **merged}, version)

    def update_weights_from_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Check ``state_dict`` (names, shapes), then swap it in between two decode steps; blocks until done.

        Raises ``ValueError`` and keeps the old weights when the checkpoint does not match the model.
        Must not be called from the engine's own worker thread (e.g. from ``scheduler.step_hook``)."""
        state_dict = _match_mtp(self.runner.model, state_dict)
        check_state_dict(self.runner.model, state_dict)
        self.scheduler.swap_weights(state_dict, version).result()

    def close(self) -> None:
        """Stop the worker thread (running and queued requests fail with ``EngineClosed``) and join it."""
        self.scheduler.close()

    def __enter__(self) -> BuiltinEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
