"""Generation for models whose cache is not plain KV: the seeds' hybrid families, one request at a time.

``qwen3_next`` / ``qwen4_exp`` / ``glm5_next`` mix linear-attention layers (a recurrent state and a causal-conv
window per request) with attention layers, and ``qwen4_exp`` / ``glm_moe_dsa`` / ``glm5_next`` keep an indexer's
key cache beside the KV. Their recurrent state cannot be left-padded, cropped or spliced like the KV grid of
``kvcache.py``, so ``HybridRunner`` lets transformers' own cache classes (``DynamicCache(config=...)``, which
builds each family's layer kinds) hold each request's state and runs every request as a batch of one: the
same forward passes as transformers' ``generate`` (prefill the prompt, then one token per step), so greedy
output equals it token for token. Continuous batching is coarse: requests join and leave at every step, and a
step runs one forward pass per running request.

Prefix reuse across turns: when a request finishes, its cache (prompt + completion but the last token) is kept
as a snapshot keyed by those token ids; a later prompt that extends a snapshot's ids continues from a copy of it
and prefills only the new tokens. Unlike KV, a recurrent state cannot be cut back, so only exact prefixes reuse
a snapshot. ``routing.py`` (``RoutingRecorder``) records each generated token's experts, and the keys its
sparse-attention indexers selected (DSA positions, QSA blocks), when asked.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from albatross.engine.base import Completion, Stats
from albatross.engine.builtin.runner import (
    PREFIX_CACHE_TOKENS,
    Decode,
    Done,
    ModelRunner,
    Request,
    SpecConfig,
    _cache_kwarg,
    _Seq,
    check_state_dict,
    untie_changed,
)
from albatross.engine.builtin.sampling import (
    SamplingTensors,
    build_sampling_tensors,
    request_uniforms,
    sample,
)


def needs_hybrid(model: torch.nn.Module) -> bool:
    """True when ``model``'s transformers cache has layers other than plain full-attention KV."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = getattr(model, "config", None)  # a transformers model's config (a plain torch module has none)
    if config is None:
        return False
    layers = getattr(DynamicCache(config=config), "layers", None) or []
    return any(type(layer) is not DynamicLayer for layer in layers)


def new_hybrid_cache(model: torch.nn.Module) -> object:
    """An empty transformers cache with the family's layer kinds (recurrent, KV, indexed KV)."""
    from transformers import DynamicCache

    config: Any = model.config  # a transformers PretrainedConfig (torch types the attribute Tensor | Module)
    return DynamicCache(config=config)


class Snapshots:
    """Finished requests' caches by token ids, at most ``max_tokens`` tokens in all (least recently used first)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], tuple[object, int]] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def put(self, ids: Sequence[int], cache: object, version: int) -> None:
        key = tuple(ids)
        if not key or len(key) > self.max_tokens:
            return
        if key in self._entries:
            self.tokens -= len(key)
        self._entries[key] = (cache, version)
        self.tokens += len(key)
        while self.tokens > self.max_tokens:
            self.tokens -= len(self._entries.popitem(last=False)[0])

    def lookup(self, prompt: Sequence[int], version: int) -> tuple[object | None, int]:
        """A copy of the cache of the longest snapshot whose ids are a proper prefix of ``prompt`` (under
        ``version``) and its length; ``(None, 0)`` when none."""
        prompt_t = tuple(prompt)
        best = max(
            (k for k, (_, v) in self._entries.items()
             if v == version and len(k) < len(prompt_t) and prompt_t[: len(k)] == k),
            key=len, default=None,
        )
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        return copy.deepcopy(self._entries[best][0]), len(best)


@dataclass
class _HybridSeq(_Seq):
    """One running request with its own cache and sampling tensors."""

    cache: object = None
    st: SamplingTensors | None = None
    last_id: int = 0
    routing: list[list[list[int]]] | None = field(default=None)

    def completion(self, reason: str) -> Completion:
        done = super().completion(reason)
        done.routing = self.routing
        return done


_S = TypeVar("_S", bound=_HybridSeq)


class SequenceRunner(ModelRunner, Generic[_S]):
    """A ``ModelRunner`` that runs each request (an ``_S``) on its own cache, one forward pass each: what
    ``HybridRunner`` and ``mtp_runner.MtpRunner`` share. Its snapshots replace the KV prefix cache.

    ``record_routing``: record each generated token's chosen experts per MoE layer, then its indexers' selected
    keys per sparse-attention layer, in ``Completion.routing``.
    """

    def __init__(
        self, model: torch.nn.Module, device: str | torch.device = "cpu", version: int = 0,
        prefix_cache_tokens: int = PREFIX_CACHE_TOKENS, spec: SpecConfig | None = None, decode: Decode | None = None,
        record_routing: bool = False,
    ) -> None:
        if spec is not None and spec.draft_tokens > 0:
            raise ValueError("speculative decoding is not supported for hybrid-cache models yet (speculative=0)")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.version = version
        lm: Any = model  # a transformers causal LM: torch.nn.Module does not declare its methods
        self.vocab_size = int(lm.get_input_embeddings().num_embeddings)
        self.spec = SpecConfig()
        self.decode = decode
        self.snapshots = Snapshots(prefix_cache_tokens)
        self.stats = Stats()
        self.fast_forward = False
        self._cache_kwarg = _cache_kwarg(model)
        self._seed_source = torch.Generator()
        self._seed_source.seed()
        self.recorder = None
        if record_routing:
            from albatross.models.routing import RoutingRecorder

            self.recorder = RoutingRecorder(self.model)
        self.running: list[_S] = []

    @property
    def n_running(self) -> int:
        return len(self.running)

    @property
    def cached_tokens(self) -> int:
        return self.snapshots.tokens

    def fail_all(self, exc: BaseException) -> None:
        running, self.running = self.running, []
        for seq in running:
            seq.done(exc)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy ``state_dict`` in (checked), set ``version``, drop the snapshots (they came from the old weights)."""
        untie_changed(self.model, state_dict)
        targets = check_state_dict(self.model, state_dict)
        with torch.no_grad():
            for name, tensor in state_dict.items():
                targets[name].copy_(tensor)
        self.version = version
        self.snapshots.clear()

    def _forward_one(self, seq: _HybridSeq, ids: Sequence[int]) -> torch.Tensor:
        """One forward pass of ``ids`` on ``seq``'s cache; the last position's logits ``[1, V]``."""
        ids_1T = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        self.stats.forward_passes += 1
        if self.recorder is not None:
            self.recorder.start()
        kwargs = {self._cache_kwarg: seq.cache}
        out = self.model(input_ids=ids_1T, use_cache=True, logits_to_keep=1, **kwargs)
        if self.recorder is not None:
            seq.routing = seq.routing if seq.routing is not None else []
            seq.routing.append(self.recorder.last_token())
        logits: torch.Tensor = out.logits
        return logits[:, -1, :]

    def _sample_append(self, seq: _HybridSeq, logits_1V: torch.Tensor) -> str | None:
        assert seq.st is not None  # set when the request started (``_start``)
        index = torch.tensor([len(seq.ids)], device=self.device)
        ids_1, logprobs_1 = sample(logits_1V, seq.st, index)
        seq.last_id = int(ids_1[0])
        return self._append(seq, [seq.last_id], [float(logprobs_1[0])])

    def _start(self, request: Request, done: Done, seq_type: type[_S]) -> _S | None:
        """Count the request and make its sequence with its sampling tensors; None (finished at once) when it
        asks for no tokens."""
        self.stats.requests += 1
        self.stats.prompt_tokens += len(request.prompt_ids)
        if request.params.max_tokens == 0:
            done(Completion([], [], [], "length"))
            return None
        uniforms = request_uniforms(request.params, self._seed_source)
        seq = seq_type(request, done, uniforms)
        seq.st = build_sampling_tensors([request.params], [uniforms], self.vocab_size, self.device)
        return seq

    def _settle(self, seq: _S, reason: str | None) -> None:
        """Keep a running request (``reason`` None), or finish it and keep its cache as a snapshot."""
        raise NotImplementedError


class HybridRunner(SequenceRunner[_HybridSeq]):
    """A ``ModelRunner`` for hybrid-cache models: per-request caches and forward passes (see the module docstring)."""

    def admit(self, items: Sequence[tuple[Request, Done]]) -> None:
        """Prefill each request on its own cache (from a snapshot when one holds a prefix), sample its first token."""
        with torch.inference_mode():
            for request, done in items:
                seq = self._start(request, done, _HybridSeq)
                if seq is None:
                    continue
                seq.cache, seq.cached = self.snapshots.lookup(request.prompt_ids, self.version)
                seq.cache = seq.cache if seq.cache is not None else new_hybrid_cache(self.model)
                self.stats.cached_prompt_tokens += seq.cached
                logits = self._forward_one(seq, request.prompt_ids[seq.cached :])
                self._settle(seq, self._sample_append(seq, logits))

    def step(self) -> None:
        """One token for every running request (one forward pass each)."""
        with torch.inference_mode():
            for seq in list(self.running):
                self.running.remove(seq)
                self._settle(seq, self._sample_append(seq, self._forward_one(seq, [seq.last_id])))

    def _settle(self, seq: _HybridSeq, reason: str | None) -> None:
        if reason is None:
            self.running.append(seq)
            return
        key = seq.request.prompt_ids + seq.ids[:-1]
        if self.snapshots.max_tokens > 0:
            self.snapshots.put(key, seq.cache, self.version)
        seq.cache = None
        seq.done(seq.completion(reason))
