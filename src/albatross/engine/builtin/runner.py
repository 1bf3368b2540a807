"""Continuous batching on a transformers causal LM: requests join and leave the running batch at every step.

``ModelRunner`` owns the model and the running batch. Each call of ``admit`` or ``step`` is one forward pass:
- ``admit`` prefills joining requests (only the part of each prompt the prefix cache does not hold), samples
  their first token and merges them into the running batch's KV grid (``kvcache.Grid``);
- ``step`` decodes one token for every running row, or, with speculative decoding on, verifies each row's
  n-gram draft and appends 1 to ``1 + draft`` tokens per row (``speculative.py``).
A row leaves as soon as it is done (stop token, stop string, max tokens); its KV goes to the prefix cache so the
next turn of the same attempt prefills only its new tokens. Sampling is described in ``sampling.py``.

Every token records the version of the weights whose forward pass produced its logits. Call everything from one
thread (the scheduler's worker).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from albatross.engine.base import Completion, SamplingParams, Stats
from albatross.engine.builtin import fastpath
from albatross.engine.builtin.kvcache import Grid, PrefixCache, new_cache, prefix_grid
from albatross.engine.builtin.sampling import (
    SamplingTensors,
    build_sampling_tensors,
    log_distribution,
    request_uniforms,
    sample,
)
from albatross.engine.builtin.speculative import NgramIndex, verify

Decode = Callable[[Sequence[int]], str]
Done = Callable[[Completion | BaseException], None]  # called once per request: its completion or its failure


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams


def validate_request(
    prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int, can_decode: bool = True
) -> None:
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
    if any(not s for s in params.stop):
        raise ValueError("SamplingParams.stop must not contain an empty string")
    if params.stop and not can_decode:
        raise ValueError("SamplingParams.stop needs a tokenizer: give the engine one (or use stop_token_ids)")


@dataclass
class _Seq:
    """One running request."""

    request: Request
    done: Done
    uniforms: torch.Tensor
    cached: int = 0
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    ngrams: NgramIndex | None = None
    stop_reason: int | str | None = None

    def completion(self, reason: str) -> Completion:
        return Completion(self.ids, self.logprobs, self.versions, reason, self.stop_reason, self.cached)


def _left_pad(seqs: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, p in enumerate(seqs):
        ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _cache_kwarg(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class SpecConfig:
    """Speculative decoding: ``draft_tokens`` per row and step (0 = off). ``method``: ``ngram`` (prompt lookup,
    suffix n-grams ``n_min..n_max``; plain-KV models) or ``mtp`` (the model's MTP head; ``mtp_runner.py``)."""

    draft_tokens: int = 0
    n_min: int = 1
    n_max: int = 3
    method: str = "ngram"


_FREE = _Seq(Request([0], SamplingParams(temperature=0.0, max_tokens=1)), lambda _: None, torch.zeros(2, 1))
"""Stands in for a free slot when sampling tensors are built (its tokens are discarded)."""


PREFIX_CACHE_TOKENS = 65536
"""Default token budget of the KV (or snapshots) kept from finished requests for the next turn."""


class ModelRunner:
    """Owns the model and the running batch; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: str | torch.device = "cpu",
        version: int = 0,
        prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
        spec: SpecConfig | None = None,
        decode: Decode | None = None,
        fast_forward: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.version = version
        lm: Any = model  # a transformers causal LM: torch.nn.Module does not declare its methods
        self.vocab_size = int(lm.get_input_embeddings().num_embeddings)
        self.spec = spec or SpecConfig()
        self.decode = decode
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.stats = Stats()
        self._cache_kwarg = _cache_kwarg(model)
        self._keep_last = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.fast_forward = fast_forward and fastpath.supports(model)
        self._seed_source = torch.Generator()
        self._seed_source.seed()
        new_cache(self.model)  # fails early for models whose cache the engine cannot manage
        self._reset_batch()

    def _reset_batch(self) -> None:
        self.rows: list[_Seq | None] = []  # None: a free slot (its row of the grid is junk until reused)
        self.grid: Grid | None = None
        self.last_ids_B = torch.zeros(0, dtype=torch.long, device=self.device)
        self.next_pos_B = torch.zeros(0, dtype=torch.long, device=self.device)
        self.index_B = torch.zeros(0, dtype=torch.long, device=self.device)
        self.st: SamplingTensors | None = None

    # ---------------------------------------------------------------------------------- weights

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Check names and shapes, copy ``state_dict`` into the model in place, set ``version``. The prefix cache
        is dropped (its KV came from the old weights); running rows keep their KV and continue."""
        untie_changed(self.model, state_dict)
        targets = check_state_dict(self.model, state_dict)
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if tensor.data_ptr() != targets[name].data_ptr():  # the model's own tensor: nothing to copy
                    targets[name].copy_(tensor)
        self.version = version
        self.prefix_cache.clear()

    # ---------------------------------------------------------------------------------- batch

    @property
    def cached_tokens(self) -> int:
        """Tokens the prefix cache holds."""
        return self.prefix_cache.tokens

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.vocab_size, self.decode is not None)

    @property
    def n_running(self) -> int:
        return sum(s is not None for s in self.rows)

    def fail_all(self, exc: BaseException) -> None:
        """Drop every running row; each request fails with ``exc``."""
        rows = self.rows
        self._reset_batch()
        for seq in rows:
            if seq is not None:
                seq.done(exc)

    def _forward(
        self, ids_BT: torch.Tensor, mask_BL: torch.Tensor | None, pos_BT: torch.Tensor, cache: object,
        last_only: bool,
    ) -> torch.Tensor:
        kwargs: dict[str, object] = {self._cache_kwarg: cache}
        if last_only and self._keep_last:
            kwargs["logits_to_keep"] = 1
        if mask_BL is not None and bool(mask_BL.all()):
            mask_BL = None
        self.stats.forward_passes += 1
        if self.fast_forward:
            logits = fastpath.forward(self.model, ids_BT, mask_BL, pos_BT, cache, last_only)
            return logits[:, -1, :] if last_only else logits
        out = self.model(input_ids=ids_BT, attention_mask=mask_BL, position_ids=pos_BT, use_cache=True, **kwargs)
        hf_logits: torch.Tensor = out.logits
        return hf_logits[:, -1, :] if last_only else hf_logits

    # ---------------------------------------------------------------------------------- admission

    def admit(self, items: Sequence[tuple[Request, Done]]) -> None:
        """Prefill ``items`` (one forward pass), sample their first tokens, add the unfinished ones to the batch."""
        seqs = []
        for request, done in items:
            self.stats.requests += 1
            self.stats.prompt_tokens += len(request.prompt_ids)
            if request.params.max_tokens == 0:
                done(Completion([], [], [], "length"))
            else:
                seqs.append(_Seq(request, done, request_uniforms(request.params, self._seed_source)))
        if seqs:
            with torch.inference_mode():
                self._prefill(seqs)

    def _prefill(self, seqs: list[_Seq]) -> None:
        found = [self.prefix_cache.lookup(s.request.prompt_ids, self.version) for s in seqs]
        for seq, (_, n) in zip(seqs, found, strict=True):
            seq.cached = n
            self.stats.cached_prompt_tokens += n
        deltas = [s.request.prompt_ids[s.cached :] for s in seqs]
        ids_BT, dmask_BT = _left_pad(deltas, self.device)
        cached_B = torch.tensor([s.cached for s in seqs], device=self.device)
        pos_BT = cached_B[:, None] + (dmask_BT.cumsum(-1) - 1).clamp_(min=0)
        grid = prefix_grid(self.model, [kv for kv, _ in found], self.device)
        if grid is None:
            grid = Grid(new_cache(self.model), dmask_BT)
            mask_BL = dmask_BT
        else:
            mask_BL = grid.append_mask(dmask_BT)
        logits_BV = self._forward(ids_BT, mask_BL, pos_BT, grid.cache, last_only=True)
        st = self._sampling([s for s in seqs])
        index_B = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
        ids_B, logprobs_B = sample(logits_BV, st, index_B)
        if self.spec.draft_tokens > 0:
            for seq in seqs:
                seq.ngrams = NgramIndex(self.spec.n_min, self.spec.n_max)
                seq.ngrams.extend(seq.request.prompt_ids)
        keep = self._record(seqs, ids_B.tolist(), [[lp] for lp in logprobs_B.tolist()], st, grid)
        self._join(seqs, grid, ids_B, cached_B + dmask_BT.sum(1), keep)

    def _join(
        self, seqs: list[_Seq], grid: Grid, ids_B: torch.Tensor, next_pos_B: torch.Tensor, keep: list[bool]
    ) -> None:
        """Joining rows take free slots first (copying only their own KV), the rest extend the grid."""
        joiners = [j for j, k in enumerate(keep) if k]
        if not joiners:
            return
        free = [r for r, s in enumerate(self.rows) if s is None]
        for j, slot in zip(joiners, free, strict=False):
            self._place(slot, seqs[j], grid, j, int(ids_B[j]), int(next_pos_B[j]))
        rest = joiners[len(free) :]
        if rest:
            idx = torch.tensor(rest, device=self.device)
            if len(rest) < len(seqs):
                grid.select(idx)
            self.grid = grid if self.grid is None else self.grid.merge(grid, self.model)
            self.rows += [seqs[j] for j in rest]
            self.last_ids_B = torch.cat([self.last_ids_B, ids_B[idx]])
            self.next_pos_B = torch.cat([self.next_pos_B, next_pos_B[idx]])
            self.index_B = torch.cat([self.index_B, torch.ones_like(idx)])
        self.st = self._sampling(self.rows)
        self._maybe_compact()

    def _place(self, slot: int, seq: _Seq, grid: Grid, j: int, last_id: int, next_pos: int) -> None:
        """Write row ``j`` of ``grid`` (a joiner) into free ``slot`` of the running grid, right-aligned."""
        assert self.grid is not None
        n = int(grid.mask_BL[j].sum())
        if n > self.grid.length:
            self.grid.pad_left(n - self.grid.length, self.model)
        self.grid.write_row(slot, grid.row_kv(j, n))
        self.rows[slot] = seq
        self.last_ids_B[slot], self.next_pos_B[slot], self.index_B[slot] = last_id, next_pos, 1

    def _sampling(self, seqs: Sequence[_Seq | None]) -> SamplingTensors:
        live = [s if s is not None else _FREE for s in seqs]
        return build_sampling_tensors(
            [s.request.params for s in live], [s.uniforms for s in live], self.vocab_size, self.device
        )

    # ---------------------------------------------------------------------------------- decoding

    def step(self) -> None:
        """One forward pass for every running row: a plain decode step, or a speculative one when drafts exist."""
        if not self.n_running:
            return
        with torch.inference_mode():
            drafts = self._drafts() if self.spec.draft_tokens > 0 else None
            if drafts is not None and any(drafts):
                self._spec_step(drafts)
            else:
                self._decode_step()

    def _decode_step(self) -> None:
        assert self.grid is not None and self.st is not None
        mask_BL = self.grid.append_mask(torch.ones_like(self.last_ids_B)[:, None])
        logits_BV = self._forward(
            self.last_ids_B[:, None], mask_BL, self.next_pos_B[:, None], self.grid.cache, last_only=False
        )
        ids_B, logprobs_B = sample(logits_BV[:, -1], self.st, self.index_B)
        self.last_ids_B, self.next_pos_B, self.index_B = ids_B, self.next_pos_B + 1, self.index_B + 1
        keep = self._record(self.rows, ids_B.tolist(), [[lp] for lp in logprobs_B.tolist()], self.st, self.grid)
        self._leave(keep)

    def _drafts(self) -> list[list[int]]:
        assert self.st is not None  # drafts are proposed for a running batch, which has its sampling tensors
        left = (self.st.max_tokens_B - self.index_B).tolist()
        k = self.spec.draft_tokens
        return [
            s.ngrams.propose(min(k, n - 1)) if s is not None and s.ngrams is not None else []
            for s, n in zip(self.rows, left, strict=True)
        ]

    def _spec_step(self, drafts: list[list[int]]) -> None:
        assert self.grid is not None and self.st is not None
        B, K = len(drafts), max(len(d) for d in drafts)
        drafts_BK = torch.full((B, K), -1, dtype=torch.long)
        for r, d in enumerate(drafts):
            drafts_BK[r, : len(d)] = torch.tensor(d, dtype=torch.long)
        drafts_BK = drafts_BK.to(self.device)
        n_drafts_B = torch.tensor([len(d) for d in drafts], device=self.device)
        ids_BT = torch.cat([self.last_ids_B[:, None], drafts_BK.clamp(min=0)], dim=1)
        arange_T = torch.arange(K + 1, device=self.device)
        in_mask_BT = (arange_T[None, :] <= n_drafts_B[:, None]).long()
        mask_BL = self.grid.append_mask(in_mask_BT)
        logits_BTV = self._forward(
            ids_BT, mask_BL, self.next_pos_B[:, None] + arange_T, self.grid.cache, last_only=False
        )
        logp_BTV = log_distribution(logits_BTV.reshape(B * (K + 1), -1), self.st.repeat(K + 1)).view(B, K + 1, -1)
        v = verify(logp_BTV, drafts_BK, n_drafts_B, self.st, self.index_B)
        self._after_verify(drafts, v.accepted_B, v.draft_logprobs_BK, v.final_ids_B, v.final_logprobs_B)

    def _after_verify(
        self, drafts: list[list[int]], accepted_B: torch.Tensor, draft_lp_BK: torch.Tensor,
        final_B: torch.Tensor, final_lp_B: torch.Tensor,
    ) -> None:
        assert self.grid is not None and self.st is not None
        K = draft_lp_BK.shape[1]
        cols_T = torch.arange(K + 1, device=self.device)
        self.grid.mask_BL[:, -(K + 1) :] *= (cols_T[None, :] <= accepted_B[:, None]).long()
        n_acc, finals, draft_lps = accepted_B.tolist(), final_B.tolist(), draft_lp_BK.tolist()
        final_lps = final_lp_B.tolist()
        tokens = [drafts[r][: n_acc[r]] + [finals[r]] for r in range(len(self.rows))]
        logprobs = [draft_lps[r][: n_acc[r]] + [final_lps[r]] for r in range(len(self.rows))]
        self.stats.draft_tokens += sum(len(d) for d in drafts)
        self.stats.accepted_draft_tokens += sum(n_acc)
        self.last_ids_B = final_B
        self.next_pos_B = self.next_pos_B + 1 + accepted_B
        self.index_B = self.index_B + 1 + accepted_B
        keep = self._record_multi(self.rows, tokens, logprobs, self.st)
        self._leave(keep)

    # ---------------------------------------------------------------------------------- finishing

    def _record(
        self, seqs: Sequence[_Seq | None], ids: list[int], logprobs: list[list[float]], st: SamplingTensors,
        grid: Grid,
    ) -> list[bool]:
        return self._record_multi(seqs, [[i] for i in ids], logprobs, st, grid)

    def _record_multi(
        self, seqs: Sequence[_Seq | None], tokens: list[list[int]], logprobs: list[list[float]],
        st: SamplingTensors, grid: Grid | None = None,
    ) -> list[bool]:
        """Append each row's new tokens; finish rows that are done; return which rows keep running."""
        keep = []
        for r, seq in enumerate(seqs):
            if seq is None:
                keep.append(False)
                continue
            reason = self._append(seq, tokens[r], logprobs[r])
            if reason is not None:
                self._finish(seq, r, reason, grid or self.grid)
            keep.append(reason is None)
        return keep

    def _append(self, seq: _Seq, toks: list[int], lps: list[float]) -> str | None:
        """Append tokens up to the first stop; return the finish reason, or None while the row runs."""
        params = seq.request.params
        for tok, lp in zip(toks, lps, strict=True):
            seq.ids.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.version)
            if seq.ngrams is not None:
                seq.ngrams.extend([tok])
            self.stats.generated_tokens += 1
            if tok in params.stop_token_ids:
                seq.stop_reason = tok
                return "stop"
            if params.stop and self._hit_stop_string(seq):
                return "stop"
            if len(seq.ids) >= params.max_tokens:
                return "length"
        return None

    def _hit_stop_string(self, seq: _Seq) -> bool:
        assert self.decode is not None
        text = self.decode(seq.ids)
        for stop in seq.request.params.stop:
            if stop in text:
                seq.stop_reason = stop
                return True
        return False

    def _finish(self, seq: _Seq, row: int, reason: str, grid: Grid | None) -> None:
        key = seq.request.prompt_ids + seq.ids[:-1]
        if grid is not None and self.prefix_cache.max_tokens > 0:
            self.prefix_cache.put(key, grid.row_kv(row, len(key)), self.version)
        seq.done(seq.completion(reason))

    def _leave(self, keep: list[bool]) -> None:
        """Finished rows become free slots; the grid drops them only once most of its rows are free."""
        finished = [r for r, (s, k) in enumerate(zip(self.rows, keep, strict=True)) if s is not None and not k]
        for r in finished:
            self.rows[r] = None
        if not any(keep):
            self._reset_batch()
            return
        if 2 * (len(self.rows) - sum(keep)) > len(self.rows):
            idx = torch.tensor([i for i, k in enumerate(keep) if k], device=self.device)
            assert self.grid is not None
            self.grid.select(idx)
            self.rows = [s for s, k in zip(self.rows, keep, strict=True) if k]
            self.last_ids_B, self.next_pos_B = self.last_ids_B[idx], self.next_pos_B[idx]
            self.index_B = self.index_B[idx]
            finished = [0]
        if finished:
            self.st = self._sampling(self.rows)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Squeeze the holes out when that drops at least a quarter of the grid's columns."""
        if self.grid is not None and self.grid.length > 64 and self.grid.reclaimable() > self.grid.length // 4:
            self.grid.compact(self.model)

    # ---------------------------------------------------------------------------------- one-shot batches

    def generate(
        self,
        requests: Sequence[Request],
        between_steps: Callable[[], None] | None = None,
        on_finish: Callable[[int, Completion], None] | None = None,
    ) -> list[Completion]:
        """Run ``requests`` to completion (all admitted at once). ``between_steps`` runs before every forward pass;
        ``on_finish(index, completion)`` runs as soon as a request is done."""
        results: list[Completion | None] = [None] * len(requests)

        def done_fn(i: int) -> Done:
            def done(c: Completion | BaseException) -> None:
                if isinstance(c, BaseException):
                    raise c
                results[i] = c
                if on_finish is not None:
                    on_finish(i, c)

            return done

        for r in requests:
            self.validate(r.prompt_ids, r.params)
        if between_steps is not None and any(r.params.max_tokens > 0 for r in requests):
            between_steps()
        self.admit([(r, done_fn(i)) for i, r in enumerate(requests)])
        while self.n_running:
            if between_steps is not None:
                between_steps()
            self.step()
        return [c for c in results if c is not None]


# ------------------------------------------------------------------------------------------------ weights


def untie_changed(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Give a tied parameter its own storage when ``state_dict`` brings different values for names that share it
    (a LoRA adapter on a tied LM head: the merged ``lm_head.weight`` is no longer ``model.embed_tokens.weight``);
    the names untied. The same values under both names (a checkpoint's tied alias) leave the tie alone."""
    params = dict(model.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    untied = []
    for name in state_dict:
        p = params.get(name)
        if p is None:
            continue
        other = first.setdefault(p.data_ptr(), name)
        if other == name or state_dict[name] is state_dict[other] or torch.equal(state_dict[name], state_dict[other]):
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        module.register_parameter(leaf, torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
        untied.append(name)
    return untied


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
