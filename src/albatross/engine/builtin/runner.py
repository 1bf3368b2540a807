"""Batched generation with a KV cache for a transformers causal LM, plus weight loading.

One call of ``ModelRunner.generate`` runs a static batch: left-padded prefill, then one decode step per
token with a ``DynamicCache``; finished rows are dropped from the batch (and the cache) as they finish.

Sampling (all rows at once, no Python loop over the batch):
- temperature 0 is greedy; its log-prob is ``log_softmax(logits)`` of the chosen id.
- otherwise the distribution sampled from is ``softmax(logits / T)`` restricted to the top-k ids, then to the
  top-p nucleus of that (renormalised after top-k), renormalised. The returned log-prob is the log of that
  truncated, renormalised distribution at the sampled id; for T = 1 with no top-k / top-p it is exactly
  ``log_softmax(logits)``.
- each request draws its uniforms from its own ``torch.Generator`` (seeded with ``SamplingParams.seed`` when
  given) and samples by inverse CDF, so a seeded request gives the same ids whatever else is in the batch.

Every token records the version of the weights whose forward pass produced its logits.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from albatross.engine.base import Completion, SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams


def validate_request(prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the bad field; called before a request joins a batch."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: the engine needs at least one prompt token")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(
            f"prompt_ids must lie in [0, {vocab_size}); got min {min(prompt_ids)}, max {max(prompt_ids)}"
        )
    if params.temperature < 0:
        raise ValueError(f"SamplingParams.temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {params.top_k}")
    if params.max_tokens < 0:
        raise ValueError(f"SamplingParams.max_tokens must be >= 0, got {params.max_tokens}")


# ----------------------------------------------------------------------------------------------- sampling


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of the active rows, as tensors (row r of every field is one request)."""

    greedy_B: torch.Tensor  # bool
    temperature_B: torch.Tensor  # float; 1 for greedy rows
    top_k_B: torch.Tensor  # long; vocab size when off or greedy
    top_p_B: torch.Tensor  # float; 1 when off or greedy
    uniforms_BT: torch.Tensor  # float in [0, 1): the uniform for step t of each row
    max_tokens_B: torch.Tensor  # long
    stop_ids_BS: torch.Tensor  # long, padded with -1
    truncate: bool  # any row uses top-k or top-p
    k_max: int  # largest top_k (vocab size when some row has none): only the k_max best ids can be sampled

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        return SamplingTensors(
            greedy_B=self.greedy_B[rows],
            temperature_B=self.temperature_B[rows],
            top_k_B=self.top_k_B[rows],
            top_p_B=self.top_p_B[rows],
            uniforms_BT=self.uniforms_BT[rows],
            max_tokens_B=self.max_tokens_B[rows],
            stop_ids_BS=self.stop_ids_BS[rows],
            truncate=self.truncate,
            k_max=self.k_max,
        )


def _uniforms(params: SamplingParams, n: int, seed_source: torch.Generator) -> torch.Tensor:
    seed = params.seed
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=seed_source))
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=generator)


def build_sampling_tensors(
    params: Sequence[SamplingParams], vocab: int, device: torch.device, seed_source: torch.Generator
) -> SamplingTensors:
    n_steps = max(1, max(p.max_tokens for p in params))
    greedy = [p.temperature == 0 for p in params]
    top_k = [vocab if g or p.top_k == 0 else min(p.top_k, vocab) for p, g in zip(params, greedy, strict=True)]
    top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
    n_stop = max(1, max(len(p.stop_token_ids) for p in params))
    stops = [list(p.stop_token_ids) + [-1] * (n_stop - len(p.stop_token_ids)) for p in params]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return SamplingTensors(
        greedy_B=tensor(greedy, torch.bool),
        temperature_B=tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], torch.float32
        ),
        top_k_B=tensor(top_k, torch.long),
        top_p_B=tensor(top_p, torch.float32),
        uniforms_BT=torch.stack([_uniforms(p, n_steps, seed_source) for p in params]).to(device),
        max_tokens_B=tensor([p.max_tokens for p in params], torch.long),
        stop_ids_BS=tensor(stops, torch.long),
        truncate=any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p),
        k_max=max(top_k),
    )


def _support_sorted(sorted_BK: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Which of the sorted logits survive top-k and then the top-p nucleus of the renormalised top-k."""
    rank_K = torch.arange(sorted_BK.shape[-1], device=sorted_BK.device)
    keep_BK = rank_K[None, :] < st.top_k_B[:, None]
    probs_BK = sorted_BK.masked_fill(~keep_BK, float("-inf")).softmax(-1)
    mass_before_BK = probs_BK.cumsum(-1) - probs_BK
    return keep_BK & ((mass_before_BK < st.top_p_B[:, None]) | (st.top_p_B[:, None] >= 1.0))


def _truncate(scaled_BV: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p support to -inf, keeping vocabulary order."""
    if st.k_max < scaled_BV.shape[-1]:  # every row has a top-k: a partial sort is enough
        sorted_BK, order_BK = scaled_BV.topk(st.k_max, dim=-1, sorted=True)
    else:
        sorted_BK, order_BK = scaled_BV.sort(-1, descending=True)
    keep_BV = torch.zeros_like(scaled_BV, dtype=torch.bool).scatter_(
        1, order_BK, _support_sorted(sorted_BK, st)
    )
    return scaled_BV.masked_fill(~keep_BV, float("-inf"))


def sample(logits_BV: torch.Tensor, st: SamplingTensors, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one id per row; return (ids_B, logprobs_B) as described in the module docstring.

    The inverse CDF runs over the vocabulary in id order, so a row's id depends only on its own logits and
    uniform, not on whether other rows in the batch made the truncation path run."""
    scaled_BV = logits_BV.float() / st.temperature_B[:, None]
    if st.truncate:
        scaled_BV = _truncate(scaled_BV, st)
    logp_BV = scaled_BV.log_softmax(-1)
    cdf_BV = logp_BV.exp().cumsum(-1)
    x_B1 = (st.uniforms_BT[:, step] * cdf_BV[:, -1]).unsqueeze(1)
    ids_B = torch.searchsorted(cdf_BV, x_B1, right=True).squeeze(1).clamp_(max=logp_BV.shape[-1] - 1)
    ids_B = torch.where(st.greedy_B, logits_BV.argmax(-1), ids_B)
    logprobs_B = logp_BV.gather(1, ids_B[:, None]).squeeze(1)
    return _avoid_excluded(ids_B, logprobs_B, logp_BV)


def _avoid_excluded(
    ids_B: torch.Tensor, logprobs_B: torch.Tensor, logp_BV: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rounding at the top of the CDF can land on an excluded id; take the row's best id instead."""
    ids_B = torch.where(torch.isinf(logprobs_B), logp_BV.argmax(-1), ids_B)
    return ids_B, logp_BV.gather(1, ids_B[:, None]).squeeze(1)


# ---------------------------------------------------------------------------------------------- generation


@dataclass
class _Batch:
    """Decode state of the rows still running; ``rows_B`` maps them to request indices."""

    rows_B: torch.Tensor
    last_ids_B: torch.Tensor
    mask_BL: torch.Tensor | None  # None when no active row has padding
    next_pos_B: torch.Tensor
    st: SamplingTensors
    cache: object

    def keep(self, keep_B: torch.Tensor) -> None:
        idx = keep_B.nonzero().squeeze(1)
        self.cache.batch_select_indices(idx)  # type: ignore[attr-defined]
        self.rows_B, self.last_ids_B = self.rows_B[idx], self.last_ids_B[idx]
        self.next_pos_B, self.st = self.next_pos_B[idx], self.st.select(idx)
        if self.mask_BL is not None:
            self.mask_BL = self.mask_BL[idx]
            if bool(self.mask_BL.all()):  # the padded rows are gone
                self.mask_BL = None


@dataclass
class _Outputs:
    """Generated ids and log-probs of every request, by request index and step."""

    ids_RT: torch.Tensor
    logprobs_RT: torch.Tensor
    versions_T: list[int]

    def completion(self, row: int, n: int, reason: str) -> Completion:
        return Completion(
            token_ids=self.ids_RT[row, :n].tolist(),
            logprobs=self.logprobs_RT[row, :n].tolist(),
            versions=self.versions_T[:n],
            finish_reason=reason,
        )


def _left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _cache_kwarg(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model: torch.nn.Module) -> object:
    """A ``DynamicCache`` whose plain full-attention layers grow in place (see ``_growing_layer_class``)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = getattr(model, "config", None)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    layers = getattr(cache, "layers", [])
    grow = _growing_layer_class()
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            layers[i] = grow()
    return cache


_GROWING_LAYER: type | None = None


def _growing_layer_class() -> type:
    """A ``DynamicLayer`` that appends into a buffer with spare capacity instead of concatenating.

    ``DynamicLayer`` copies the whole cache on every decode step (``torch.cat``); this one doubles its buffer
    when full, so a step writes one position. ``keys`` / ``values`` are views of the filled part.
    """
    global _GROWING_LAYER
    if _GROWING_LAYER is not None:
        return _GROWING_LAYER
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            self.length = 0
            self.buf_k: torch.Tensor | None = None
            self.buf_v: torch.Tensor | None = None

        def _reserve(self, k: torch.Tensor, v: torch.Tensor, need: int) -> None:
            if self.buf_k is not None and need <= self.buf_k.shape[-2]:
                return
            cap = max(need, 64, 2 * (0 if self.buf_k is None else self.buf_k.shape[-2]))
            new_k = k.new_empty(*k.shape[:-2], cap, k.shape[-1])
            new_v = v.new_empty(*v.shape[:-2], cap, v.shape[-1])
            if self.buf_k is not None:
                new_k[..., : self.length, :] = self.buf_k[..., : self.length, :]
                new_v[..., : self.length, :] = self.buf_v[..., : self.length, :]
            self.buf_k, self.buf_v = new_k, new_v

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            self._reserve(key_states, value_states, end)
            self.buf_k[..., self.length : end, :] = key_states
            self.buf_v[..., self.length : end, :] = value_states
            self.length = end
            self.keys, self.values = self.buf_k[..., :end, :], self.buf_v[..., :end, :]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.get_seq_length() > 0:
                self.buf_k, self.buf_v = self.buf_k[indices], self.buf_v[indices]
                self.keys, self.values = self.buf_k[..., : self.length, :], self.buf_v[..., : self.length, :]

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove < 0 and self.is_initialized:
                self.length = max(0, self.length + tokens_to_remove)
                self.keys, self.values = self.buf_k[..., : self.length, :], self.buf_v[..., : self.length, :]
            else:
                super().crop(tokens_to_remove)

    _GROWING_LAYER = GrowingLayer
    return GrowingLayer


class ModelRunner:
    """Owns the model; runs static batches and applies weight swaps (call both from one thread)."""

    def __init__(self, model: torch.nn.Module, device: str | torch.device = "cpu", version: int = 0) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.version = version
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self._cache_kwarg = _cache_kwarg(model)
        self._keep_last = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._seed_source = torch.Generator()
        self._seed_source.seed()

    # ---------------------------------------------------------------------------------- weights

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Check names and shapes, then copy ``state_dict`` into the model in place and set ``version``."""
        targets = check_state_dict(self.model, state_dict)
        with torch.no_grad():
            for name, tensor in state_dict.items():
                targets[name].copy_(tensor)
        self.version = version

    # ---------------------------------------------------------------------------------- generation

    def _forward(
        self,
        ids_BL: torch.Tensor,
        batch_mask: torch.Tensor | None,
        pos_BL: torch.Tensor,
        cache: object,
        last_only: bool,
    ) -> torch.Tensor:
        kwargs: dict[str, object] = {self._cache_kwarg: cache}
        if last_only and self._keep_last:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=ids_BL, attention_mask=batch_mask, position_ids=pos_BL, use_cache=True, **kwargs
        )
        return out.logits[:, -1, :]

    def _prefill(self, requests: Sequence[Request]) -> tuple[_Batch, torch.Tensor]:
        ids_BL, mask_BL = _left_pad([r.prompt_ids for r in requests], self.device)
        pos_BL = (mask_BL.cumsum(-1) - 1).clamp_(min=0)
        padded = bool((mask_BL == 0).any())
        cache = _new_cache(self.model)
        logits_BV = self._forward(ids_BL, mask_BL if padded else None, pos_BL, cache, last_only=True)
        st = build_sampling_tensors(
            [r.params for r in requests], logits_BV.shape[-1], self.device, self._seed_source
        )
        rows_B = torch.arange(len(requests), device=self.device)
        batch = _Batch(rows_B, rows_B, mask_BL if padded else None, pos_BL[:, -1] + 1, st, cache)
        return batch, logits_BV

    def _decode(self, batch: _Batch) -> torch.Tensor:
        if batch.mask_BL is not None:
            ones_B1 = batch.mask_BL.new_ones(batch.mask_BL.shape[0], 1)
            batch.mask_BL = torch.cat([batch.mask_BL, ones_B1], dim=1)
        logits_BV = self._forward(
            batch.last_ids_B[:, None], batch.mask_BL, batch.next_pos_B[:, None], batch.cache, last_only=False
        )
        batch.next_pos_B = batch.next_pos_B + 1
        return logits_BV

    def generate(
        self,
        requests: Sequence[Request],
        between_steps: Callable[[], None] | None = None,
        on_finish: Callable[[int, Completion], None] | None = None,
    ) -> list[Completion]:
        """Run ``requests`` as one batch. ``between_steps`` runs before every forward pass (the place for weight
        swaps); ``on_finish(index, completion)`` runs as soon as a request is done."""
        results: list[Completion | None] = [None] * len(requests)

        def finish(row: int, completion: Completion) -> None:
            results[row] = completion
            if on_finish is not None:
                on_finish(row, completion)

        todo = [i for i, r in enumerate(requests) if r.params.max_tokens > 0]
        for i in sorted(set(range(len(requests))) - set(todo)):
            finish(i, Completion([], [], [], "length"))
        if todo:
            with torch.inference_mode():
                self._run([requests[i] for i in todo], between_steps, lambda r, c: finish(todo[r], c))
        return [c for c in results if c is not None]

    def _run(
        self,
        requests: Sequence[Request],
        between_steps: Callable[[], None] | None,
        finish: Callable[[int, Completion], None],
    ) -> None:
        if between_steps is not None:
            between_steps()
        batch, logits_BV = self._prefill(requests)
        n_steps = batch.st.uniforms_BT.shape[1]
        out = _Outputs(
            ids_RT=torch.zeros(len(requests), n_steps, dtype=torch.long, device=self.device),
            logprobs_RT=torch.zeros(len(requests), n_steps, dtype=torch.float32, device=self.device),
            versions_T=[],
        )
        for step in range(n_steps):
            out.versions_T.append(self.version)
            if not self._sample_step(batch, logits_BV, step, out, finish):
                return
            if between_steps is not None:
                between_steps()
            logits_BV = self._decode(batch)

    def _sample_step(
        self,
        batch: _Batch,
        logits_BV: torch.Tensor,
        step: int,
        out: _Outputs,
        finish: Callable[[int, Completion], None],
    ) -> bool:
        """Sample one token per active row, finish rows that are done; return whether any row is left."""
        ids_B, logprobs_B = sample(logits_BV, batch.st, step)
        out.ids_RT[batch.rows_B, step] = ids_B
        out.logprobs_RT[batch.rows_B, step] = logprobs_B
        stopped_B = (ids_B[:, None] == batch.st.stop_ids_BS).any(-1)
        done_B = stopped_B | (batch.st.max_tokens_B <= step + 1)
        batch.last_ids_B = ids_B
        if not bool(done_B.any()):
            return True
        for row, stop in zip(batch.rows_B[done_B].tolist(), stopped_B[done_B].tolist(), strict=True):
            finish(row, out.completion(row, step + 1, "stop" if stop else "length"))
        if bool(done_B.all()):
            return False
        batch.keep(~done_B)
        return True


# ------------------------------------------------------------------------------------------------ weights


def check_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Check ``state_dict`` against ``model`` (names and shapes, strict) without changing anything.

    A name may be missing when the model ties it to a tensor that is present (e.g. ``lm_head.weight`` tied to
    ``model.embed_tokens.weight``). Returns the model's tensors by name, for copying into. Raises ``ValueError``.
    """
    targets = model.state_dict(keep_vars=True)
    problems = [f"unexpected key {k!r}" for k in state_dict if k not in targets]
    problems += [
        f"shape mismatch for {k!r}: checkpoint {tuple(v.shape)}, model {tuple(targets[k].shape)}"
        for k, v in state_dict.items()
        if k in targets and tuple(v.shape) != tuple(targets[k].shape)
    ]
    present = {targets[k].data_ptr() for k in state_dict if k in targets}
    problems += [
        f"missing key {k!r}"
        for k, t in targets.items()
        if k not in state_dict and t.data_ptr() not in present
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ValueError(f"checkpoint does not match the model: {shown}")
    return {k: t.data if isinstance(t, torch.nn.Parameter) else t for k, t in targets.items()}


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Read ``model.safetensors`` from directory ``path``, or else every ``*.safetensors`` file in it, merged."""
    from safetensors.torch import load_file

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"weights directory not found: {root}")
    files = (
        [root / "model.safetensors"]
        if (root / "model.safetensors").is_file()
        else sorted(root.glob("*.safetensors"))
    )
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {root}")
    merged: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_file(str(file))
        clash = merged.keys() & part.keys()
        if clash:
            raise ValueError(f"{file}: keys also present in another shard: {sorted(clash)[:3]}")
        merged.update(part)
    return merged
