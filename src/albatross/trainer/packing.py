"""Pack samples into micro-batches under a token budget, with no padding.

A micro-batch is one row of concatenated samples. Each sample of n tokens contributes its first n - 1
tokens as inputs and its last n - 1 tokens as targets, so every field is aligned with the *target*:
``loss_mask``, ``logprobs`` (rollout log-prob of the target), ``versions`` and ``advantages``.
``position_ids`` restart at 0 for each sample. Samples are placed first-fit decreasing; a sample
longer than the budget gets a micro-batch of its own.

Document masking (attention never crosses a sample boundary) has three implementations, one chosen per
trainer at start-up (``attention_inputs``):

- ``varlen`` (default): the model's attention is swapped for ``varlen_attention``, which runs causal
  ``scaled_dot_product_attention`` on each sample's slice of the row (boundaries passed as
  ``cu_seq_lens_q``). No T x T mask is built, attention cost follows each sample's own length, and it
  runs on CPU and GPU. Called without boundaries (generation, padded batches) it is plain ``sdpa``.
- ``flash``: a model loaded with a ``flash_attention_*`` implementation gets the same boundaries, which
  transformers hands to flash-attn's varlen kernel.
- ``dense``: an explicit [T, T] block-causal mask (``block_causal_mask``) for ``sdpa`` or ``eager``;
  simple and exact, but quadratic in the row length; kept as a reference.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from albatross.config import default
from albatross.records import TrainSample

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class MicroBatch:
    input_ids: Tensor  # [1, T] long
    position_ids: Tensor  # [1, T] long, restarting at 0 per sample
    seq_lens: list[int]  # tokens of each packed sample, in order
    targets: Tensor  # [T] long, the next token
    loss_mask: Tensor  # [T] float, 1 where the target is a model token
    logprobs: Tensor  # [T] float, rollout log-prob of the target
    versions: Tensor  # [T] long, policy version of the target
    advantages: Tensor  # [T] float
    routing: Tensor | None = None  # [T, MoE layers, k] long: recorded experts per input position (-1: live)

    @property
    def num_tokens(self) -> int:
        return int(self.targets.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def cu_seq_lens(self) -> Tensor:
        """Cumulative sample boundaries [num_samples + 1] (int32), as varlen attention kernels take them."""
        return torch.tensor([0, *itertools.accumulate(self.seq_lens)], dtype=torch.int32)


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices grouped into bins of total length <= budget (an item over budget gets its own bin)."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def _concat(samples: Sequence[TrainSample]) -> MicroBatch:
    ids: list[int] = []
    pos: list[int] = []
    tgt: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    vers: list[int] = []
    advs: list[float] = []
    lens: list[int] = []
    for ts in samples:
        s, n = ts.sample, len(ts.sample.token_ids) - 1
        ids += s.token_ids[:-1]
        pos += range(n)
        tgt += s.token_ids[1:]
        mask += s.loss_mask[1:]
        lps += s.logprobs[1:]
        vers += s.versions[1:]
        advs += [ts.advantage] * n
        lens.append(n)
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        seq_lens=lens,
        targets=torch.tensor(tgt, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        logprobs=torch.tensor(lps, dtype=torch.float32),
        versions=torch.tensor(vers, dtype=torch.long),
        advantages=torch.tensor(advs, dtype=torch.float32),
        routing=_routing(samples),
    )


def _routing(samples: Sequence[TrainSample]) -> Tensor | None:
    """Recorded routing aligned like ``logprobs``: input position t gets the experts that sampled target t."""
    known = next((r for ts in samples for r in ts.sample.routing or [] if r), None)
    if known is None:
        return None
    from albatross.models.routing import routing_tensor

    rows = [r for ts in samples for r in (ts.sample.routing or [[]] * len(ts.sample.token_ids))[1:]]
    return routing_tensor(rows, len(known), len(known[0]))


def pack(samples: Sequence[TrainSample], max_tokens: int) -> list[MicroBatch]:
    """Micro-batches of at most ``max_tokens`` input tokens; samples with < 2 tokens are skipped."""
    kept = [s for s in samples if len(s.sample.token_ids) >= 2]
    bins = first_fit_decreasing([len(s.sample.token_ids) - 1 for s in kept], max_tokens)
    return [_concat([kept[i] for i in sorted(b)]) for b in bins]


def block_causal_mask(
    seq_lens: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Tensor:
    """[1, 1, T, T] mask letting query t attend key s only within its own sample and for s <= t.

    With ``dtype=torch.bool`` it is True where attention is allowed (for sdpa, a quarter of the memory);
    with a float dtype it is additive: 0 where allowed, the dtype's minimum elsewhere (for eager).
    """
    seg = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=device), torch.tensor(seq_lens, device=device)
    )
    t = seg.shape[0]
    allowed = torch.ones(t, t, dtype=torch.bool, device=device).tril() & (seg[:, None] == seg[None, :])
    if dtype == torch.bool:
        return allowed[None, None]
    mask = torch.zeros(t, t, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


# document masking ---------------------------------------------------------------------------------

VARLEN = "albatross_varlen"  # the name ``varlen_attention`` is registered under in transformers

AttentionInputs = Callable[[MicroBatch, torch.dtype, torch.device], dict[str, Any]]


def _segment_attention(q: Tensor, k: Tensor, v: Tensor, dropout: float, scaling: float | None,
                       sliding_window: int | None) -> Tensor:
    """Causal sdpa over one sample, [1, heads, n, d]; a sliding window becomes an explicit band mask."""
    gqa = q.shape[1] != k.shape[1]
    n = q.shape[2]
    if sliding_window is None or sliding_window >= n:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
        )
    idx = torch.arange(n, device=q.device)
    band = (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < sliding_window)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=band, dropout_p=dropout, scale=scaling, enable_gqa=gqa
    )


def varlen_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: causal attention inside each packed sample, [B, T, heads, d] out.

    With ``cu_seq_lens_q`` (a packed row, batch 1) each sample's queries attend only to its own keys;
    without it this is transformers' ``sdpa`` (so generation with the same model keeps working).
    """
    indices = kwargs.pop("indices", None)
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if indices is not None:  # a sparse-attention top-k selection (DSA), as eager / sdpa apply it
            from albatross.models.masks import select_keys

            attention_mask = select_keys(attention_mask, indices, key.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention takes one packed row, got batch {query.shape[0]}")
    if indices is not None:
        raise NotImplementedError("sparse-attention indices on a packed row: call "
                                  "albatross.models.prepare_for_packing(model) first")
    extras = sorted(k for k in ("softcap", "s_aux", "position_bias") if kwargs.get(k) is not None)
    if extras:  # attention features plain sdpa cannot express
        raise NotImplementedError(f"varlen attention does not support {extras}; use attention='dense' "
                                  "or a flash_attention_* model")
    lens = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    # split, not slicing: its backward is one concatenation instead of a zero-filled copy per sample
    parts = zip(torch.split(query, lens, 2), torch.split(key, lens, 2), torch.split(value, lens, 2), strict=True)
    outs = [_segment_attention(q, k, v, dropout, scaling, sliding_window) for q, k, v in parts if q.shape[2]]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register_varlen_attention() -> str:
    """Register ``varlen_attention`` (and sdpa's mask builder for its fallback) with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, sdpa_mask)
    return VARLEN


def _varlen_inputs(mb: MicroBatch, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    # An all-ones padding mask stops transformers from building its own packed [T, T] mask.
    cu = mb.cu_seq_lens.to(device)
    longest = max(mb.seq_lens, default=0)
    return {"attention_mask": torch.ones(1, mb.num_tokens, dtype=torch.bool, device=device),
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _flash_inputs(mb: MicroBatch, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    out = _varlen_inputs(mb, dtype, device)
    out["attention_mask"] = None
    return out


def _dense_inputs(bool_mask: bool) -> AttentionInputs:
    def inputs(mb: MicroBatch, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        return {"attention_mask": block_causal_mask(mb.seq_lens, torch.bool if bool_mask else dtype, device)}

    return inputs


ATTENTION_MODES = ("auto", "varlen", "flash", "dense")


def attention_inputs(model: PreTrainedModel, mode: str = default("trainer", "attention")) -> AttentionInputs:
    """Pick the document-masking implementation once; may switch ``model`` to ``varlen_attention``.

    ``auto``: ``flash`` when the model already runs a flash-attn implementation, else ``varlen``.
    Returns a function giving the attention keyword arguments of a micro-batch's forward.
    """
    if mode not in ATTENTION_MODES:
        raise ValueError(f"unknown attention mode {mode!r}; choose one of {list(ATTENTION_MODES)}")
    impl = str(model.config._attn_implementation or "")
    if mode == "auto":
        mode = "flash" if impl.startswith("flash") else "varlen"
    if mode == "flash":
        if not impl.startswith("flash"):
            raise ValueError(f"attention 'flash' needs a flash_attention_* model, this one uses {impl!r}")
        return _with_routing(_flash_inputs)
    if mode == "varlen":
        if impl != VARLEN:
            model.set_attn_implementation(register_varlen_attention())
        return _with_routing(_varlen_inputs)
    return _with_routing(_dense_inputs(bool_mask=impl != "eager"))


def _with_routing(inputs: AttentionInputs) -> AttentionInputs:
    """Also pass a micro-batch's recorded routing (``routing=``, for ``TokenLogprobs``' routing replay)."""

    def with_routing(mb: MicroBatch, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        out = inputs(mb, dtype, device)
        if mb.routing is not None:
            out["routing"] = mb.routing
        return out

    return with_routing
