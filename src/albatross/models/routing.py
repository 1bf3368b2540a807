"""Routing replay: the trainer routes each token to the experts (and sparse-attention keys) the sampler chose.

A token routed to other experts by the trainer than by the engine (numerics, batch shapes, weights a step
apart) gets a log-prob from another function than the one that sampled it, and the importance ratio of
RL breaks. ``install(model)`` swaps the forward of every MoE router (``*TopKRouter``: softmax routers of
``qwen3_moe`` / ``qwen3_next`` / ``qwen4_exp``; sigmoid routers with a score bias and expert groups of
``glm_moe_dsa`` / ``glm5_next``) for one that computes the router logits and scores in fp32 and takes its
top-k from ``Replay.forced`` where a token has a recorded choice (live top-k elsewhere). The expert weights
are the live scores of the forced experts, normalised as the family does, so gradients still reach the
router. The engine records through the same forward (``RoutingRecorder``): for each forward pass, the
experts of its last position, i.e. of the position whose logits sample the next token.

Sparse-attention indexers are replayed the same way (``install`` also wraps every known ``*Indexer``): the
engine records, for the position whose logits sample the next token, the keys its indexer selected, and the
trainer's forward uses that selection for that token instead of its live top-k. The selection is in key
positions from the start of the sequence, which in the trainer's per-document forward (``segments``) are
positions from the start of the document: the sample is the engine's sequence. Kinds (``INDEXER_KINDS``):

- ``positions`` (DSA: ``glm_moe_dsa``, ``glm5_next``): the selected key positions; the indexer returns
  ``[B, S, W]`` top-k indices, which a replayed row replaces (padded by repeating an entry: same set).
- ``blocks`` (QSA: ``qwen4_exp``): the selected complete blocks of ``indexer_compress_ratio`` visible keys
  (``budget / ratio`` numbers instead of ``budget`` positions); the keys after the last complete block are
  always attended, so the indexer's ``[B, 1, S, kv]`` mask row is rebuilt from the blocks and the query's
  visible keys.

Indexers give no gradient (their output is a selection: integer indices or a boolean mask), so replay changes
no gradient path: attention still gets gradients through the selected keys. A recorded token's row per layer is: one list per MoE router
(its k experts), then one list per indexer (its selection), in model order.

Router load-balancing losses are never part of RL here: they are computed only by the ``*ForCausalLM``
forward when ``output_router_logits`` is on, and the trainer calls the decoder alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from albatross.models import decoder_layers
from albatross.models.segments import replaced_forward

_REPLAY = "_albatross_replay"  # where ``install`` keeps a model's ``Replay``
INDEXER_KINDS = {"GlmMoeDsaIndexer": "positions", "Glm5NextTextIndexer": "positions",
                 "Qwen4ExpTextQSAIndexer": "blocks"}


@dataclass
class Replay:
    """Per router (model order): forced top-k ``[N, k]`` (-1 = live) or None; the last forward's choices.

    Per indexer: forced selections ``[T, W]`` over the whole row (-1 padding; a row of -1: live) or None; a
    cursor (the row's next token, as the per-document forward calls an indexer once per document, in order);
    the last forward's selection at its last position, kept only while ``record`` is on (the engine).
    """

    forced: list[Tensor | None] = field(default_factory=list)
    last: list[Tensor | None] = field(default_factory=list)
    selections: list[Tensor | None] = field(default_factory=list)
    cursor: list[int] = field(default_factory=list)
    last_selection: list[list[int]] = field(default_factory=list)
    ratios: list[int] = field(default_factory=list)  # per indexer: keys per QSA block (1 for DSA)
    record: bool = False


class TopKRouter(Protocol):
    """The members of transformers' ``*TopKRouter`` read here (matched by class name); a sigmoid router
    (``glm_moe_dsa`` / ``glm5_next``) also has the grouped-choice members of ``SigmoidRouter``."""

    top_k: int
    hidden_dim: int
    norm_topk_prob: bool
    weight: Tensor


class SigmoidRouter(TopKRouter, Protocol):
    """A sigmoid router with a score bias and expert groups."""

    e_score_correction_bias: Tensor
    num_group: int
    num_experts: int
    topk_group: int
    routed_scaling_factor: float


def _decoder_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of the decoder's layers, in order: not an MTP head's layer, which the sampling forward
    does not run (its routing is not recorded)."""
    return [m for layer in decoder_layers(model) for m in layer.modules()]


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The decoder's MoE routers in layer order (modules named ``*TopKRouter`` / ``*TopkRouter``)."""
    return [m for m in _decoder_modules(model) if type(m).__name__.lower().endswith("topkrouter")]


def _sigmoid(router: TopKRouter) -> TypeGuard[SigmoidRouter]:
    return hasattr(router, "e_score_correction_bias")  # a transformers router: which family's


def _live_topk(router: TopKRouter, scores_NE: Tensor) -> Tensor:
    """The family's own expert choice from fp32 scores (grouped, biased top-k for sigmoid routers)."""
    if not _sigmoid(router):
        return scores_NE.topk(router.top_k, dim=-1).indices
    choice_NE = scores_NE + router.e_score_correction_bias.float()
    groups = choice_NE.view(-1, router.num_group, router.num_experts // router.num_group)
    group_idx = groups.topk(2, dim=-1)[0].sum(-1).topk(router.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(groups[..., 0]).scatter_(1, group_idx, 1).bool()
    choice_NE = choice_NE.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
    return choice_NE.topk(router.top_k, dim=-1, sorted=False)[1]


def _weights(router: TopKRouter, scores_NE: Tensor, idx_NK: Tensor) -> Tensor:
    w_NK = scores_NE.gather(1, idx_NK)
    if _sigmoid(router):
        if router.norm_topk_prob:
            w_NK = w_NK / (w_NK.sum(-1, keepdim=True) + 1e-20)
        return w_NK * router.routed_scaling_factor
    return w_NK / w_NK.sum(-1, keepdim=True) if router.norm_topk_prob else w_NK


def _replayed_forward(router: TopKRouter, replay: Replay, i: int, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    h_NH = hidden.reshape(-1, router.hidden_dim)
    logits_NE = F.linear(h_NH.float(), router.weight.float())
    scores_NE = logits_NE.sigmoid() if _sigmoid(router) else logits_NE.softmax(-1)
    idx_NK = _live_topk(router, scores_NE.detach())
    forced = replay.forced[i]
    if forced is not None:
        if forced.shape[0] != idx_NK.shape[0]:
            raise ValueError(f"routing replay: router {i} got {idx_NK.shape[0]} tokens, "
                             f"the recorded routing has {forced.shape[0]}")
        forced = forced[:, : idx_NK.shape[1]].to(idx_NK.device)
        idx_NK = torch.where(forced[:, :1] >= 0, forced, idx_NK)
    replay.last[i] = idx_NK[-1].detach()
    return logits_NE, _weights(router, scores_NE, idx_NK), idx_NK


def sparse_indexers(model: nn.Module) -> list[nn.Module]:
    """The decoder's sparse-attention indexers in layer order (an indexer of no known kind is refused)."""
    found = [m for m in _decoder_modules(model) if type(m).__name__.endswith("Indexer")]
    unknown = sorted({type(m).__name__ for m in found} - set(INDEXER_KINDS))
    if unknown:
        raise NotImplementedError(f"routing replay cannot replay the selections of {', '.join(unknown)}; "
                                  f"known indexers: {sorted(INDEXER_KINDS)}")
    return found


def _check_indexers_called(model: nn.Module, indexers: list[nn.Module]) -> None:
    """Refuse attention layers whose forward no longer calls their indexer module: a whole-row replacement that
    selects keys itself (``trainer.fast_indexer``, ``models/indexer.py``) would leave a recorded selection unused."""
    for module in _decoder_modules(model):
        forward = module.forward
        # a transformers attention layer: whether it has an indexer, and which
        if any(getattr(module, "indexer", None) is ix for ix in indexers) and \
                isinstance(forward, functools.partial) and forward.func is replaced_forward:
            raise NotImplementedError(f"routing replay cannot replay the indexer selections of {type(module).__name__}: "
                                      "its forward was replaced by one that selects keys itself "
                                      "(trainer.fast_indexer); turn one of them off")


def _indexer_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The QSA indexer's ``attention_mask`` argument (its third): which keys each query sees."""
    return args[2] if len(args) > 2 else kwargs.get("attention_mask")


def _take_rows(replay: Replay, j: int, n: int) -> Tensor | None:
    """The forced selections of the next ``n`` tokens of the row for indexer ``j`` (advances its cursor)."""
    forced = replay.selections[j]
    if forced is None:
        return None
    start, total = replay.cursor[j], forced.shape[0]
    if start + n > total:
        raise ValueError(f"routing replay: indexer {j} got {n} tokens at token {start}, "
                         f"the recorded selections cover {total}")
    replay.cursor[j] = (start + n) % total
    return forced[start:start + n]


def _indexer_forward(original: Callable[..., Any], kind: str, replay: Replay, j: int,
                     *args: Any, **kwargs: Any) -> Tensor:
    """The indexer as shipped, then its rows with a recorded selection replaced (and, recording, its last row's
    selection kept). Runs on the whole row or on one document of it (the cursor says which rows)."""
    out: Tensor = original(*args, **kwargs)
    forced = _take_rows(replay, j, out.shape[2] if kind == "blocks" else out.shape[1])
    forced = None if forced is None or not bool((forced >= 0).any()) else forced.to(out.device)
    if forced is None and not replay.record:
        return out
    if kind == "blocks":
        visible = _visible(_indexer_args(args, kwargs))
        out = out if forced is None else _replay_blocks(_batch_one(out), visible, forced, replay.ratios[j])
        if replay.record:
            replay.last_selection[j] = _last_blocks(out, visible, replay.ratios[j])
        return out
    out = out if forced is None else _replay_positions(_batch_one(out), forced)
    if replay.record:
        replay.last_selection[j] = _last_positions(out)
    return out


def _batch_one(out: Tensor) -> Tensor:
    if out.shape[0] != 1:
        raise ValueError("routing replay: indexer selections are replayed on batch-1 rows only")
    return out


def _visible(mask: Tensor | None) -> Tensor:
    if mask is None:
        raise ValueError("routing replay: a QSA indexer needs its attention mask")
    return mask if mask.dtype == torch.bool else mask == 0


def _block_ids(visible_SK: Tensor, ratio: int) -> tuple[Tensor, Tensor]:
    """Per query and key: the key's QSA block (rank among the query's visible keys // ratio; -1 if not visible),
    and per query the number of complete blocks (keys after them form the always-attended tail)."""
    rank = visible_SK.long().cumsum(-1) - 1
    block = torch.where(visible_SK, rank // ratio, -1)
    return block, visible_SK.sum(-1) // ratio


def _replay_blocks(mask_B1SK: Tensor, visible_B1SK: Tensor, forced_SW: Tensor, ratio: int) -> Tensor:
    """The QSA selection mask with recorded rows rebuilt: keys of the recorded blocks plus the visible tail."""
    visible = visible_B1SK[0, 0].expand(mask_B1SK.shape[-2:])
    block, complete = _block_ids(visible, ratio)
    if bool((forced_SW >= complete[:, None]).any()):
        raise ValueError("routing replay: a recorded QSA block is past the query's complete blocks "
                         "(the sample's tokens are not the engine's sequence)")
    n_blocks = int(complete.max()) + 1
    chosen = torch.zeros(forced_SW.shape[0], n_blocks + 1, dtype=torch.bool, device=mask_B1SK.device)
    chosen.scatter_(1, torch.where(forced_SW >= 0, forced_SW, n_blocks), True)
    in_blocks = chosen.gather(1, block.clamp(min=0)) & (block >= 0) & (block < complete[:, None])
    tail = visible & (block >= complete[:, None])
    rows = (forced_SW >= 0).any(-1)
    out = mask_B1SK.clone()
    out[0, 0, rows] = (in_blocks | tail)[rows]
    return out


def _last_blocks(mask_B1SK: Tensor, visible_B1SK: Tensor, ratio: int) -> list[int]:
    """The complete blocks the QSA indexer selected for the last query (sorted)."""
    visible = visible_B1SK[0, 0, -1:].expand(1, mask_B1SK.shape[-1])
    block, complete = _block_ids(visible, ratio)
    picked = block[0][mask_B1SK[0, 0, -1] & (block[0] >= 0) & (block[0] < complete[0])]
    return sorted({int(b) for b in picked.tolist()})


def _replay_positions(indices_BSW: Tensor, forced_SW: Tensor) -> Tensor:
    """DSA top-k indices with recorded rows replaced; -1 padding becomes a repeat of the row's first key."""
    positions = torch.arange(forced_SW.shape[0], device=forced_SW.device)[:, None]
    if bool((forced_SW > positions).any()):
        raise ValueError("routing replay: a recorded DSA key is after its query "
                         "(the sample's tokens are not the engine's sequence)")
    width = max(indices_BSW.shape[-1], forced_SW.shape[-1])
    forced = torch.where(forced_SW >= 0, forced_SW, forced_SW[:, :1])
    forced = _widen(forced, width).to(indices_BSW.dtype)
    out = _widen(indices_BSW[0], width).clone()
    rows = (forced_SW >= 0).any(-1)
    out[rows] = forced[rows]
    return out[None]


def _widen(indices_SW: Tensor, width: int) -> Tensor:
    """Indices widened to ``width`` columns by repeating the last one (the same set of keys)."""
    extra = width - indices_SW.shape[-1]
    return indices_SW if extra <= 0 else torch.cat([indices_SW, indices_SW[:, -1:].expand(-1, extra)], dim=-1)


def _last_positions(indices_BSW: Tensor) -> list[int]:
    """The key positions the DSA indexer selected for the last query (sorted, -1 padding dropped)."""
    return sorted({int(i) for i in indices_BSW[0, -1].tolist() if i >= 0})


def install(model: nn.Module) -> Replay:
    """Route every MoE router and sparse-attention indexer of ``model`` through ``Replay`` (idempotent;
    parameters untouched)."""
    current = installed(model)
    if current is not None:
        return current
    routers, indexers = moe_routers(model), sparse_indexers(model)
    _check_indexers_called(model, indexers)
    replay = Replay([None] * len(routers), [None] * len(routers), [None] * len(indexers), [0] * len(indexers),
                    [[] for _ in indexers], [int(getattr(m, "compress_ratio", 1)) for m in indexers])  # 1: DSA has none
    for i, router in enumerate(routers):
        # matched by class name (``moe_routers``): a transformers ``*TopKRouter``
        router.forward = functools.partial(_replayed_forward, cast(TopKRouter, router), replay, i)
    for j, indexer in enumerate(indexers):
        kind = INDEXER_KINDS[type(indexer).__name__]
        indexer.forward = functools.partial(_indexer_forward, indexer.forward, kind, replay, j)
    model.__dict__[_REPLAY] = replay
    return replay


def installed(model: nn.Module) -> Replay | None:
    """The ``Replay`` that ``install`` gave ``model``, or None."""
    current = model.__dict__.get(_REPLAY)
    return current if isinstance(current, Replay) else None


def set_forced(replay: Replay, routing_TLK: Tensor | None) -> None:
    """Force the next forwards' routing: ``routing_TLK[t, l]`` the experts of token ``t`` at router ``l``, then
    the selection of indexer ``l - routers`` (rows of -1: live; a recording of routers only forces those).
    None: every router and indexer live. Kept until the next call (activation checkpointing)."""
    n_routers, n_indexers = len(replay.forced), len(replay.selections)
    if routing_TLK is not None and routing_TLK.shape[1] not in (n_routers, n_routers + n_indexers):
        raise ValueError(f"routing replay: recorded routing has {routing_TLK.shape[1]} layers, the model "
                         f"{n_routers} MoE routers and {n_indexers} sparse-attention indexers")
    for i in range(n_routers):
        replay.forced[i] = None if routing_TLK is None else routing_TLK[:, i]
    with_indexers = routing_TLK is not None and routing_TLK.shape[1] == n_routers + n_indexers
    for j in range(n_indexers):
        replay.selections[j] = routing_TLK[:, n_routers + j] if routing_TLK is not None and with_indexers else None
        replay.cursor[j] = 0


def routing_tensor(routing: list[list[list[int]]], n_layers: int, k: int) -> Tensor:
    """``[T, n_layers, W]`` long from per-token lists (``[]`` = not recorded: -1); W is ``k`` or the widest
    recorded list (indexer selections are wider than a router's k), shorter lists padded with -1."""
    width = max([k] + [len(entry) for layers in routing for entry in layers])
    out = torch.full((len(routing), n_layers, width), -1, dtype=torch.long)
    for t, layers in enumerate(routing):
        for layer, entry in enumerate(layers):
            if entry:
                out[t, layer, : len(entry)] = torch.tensor(entry, dtype=torch.long)
    return out


class RoutingRecorder:
    """Records, per forward pass of ``model``, the experts each router chose (and the keys each indexer
    selected) for the last position."""

    def __init__(self, model: nn.Module) -> None:
        self.replay = install(model)

    def start(self) -> None:
        set_forced(self.replay, None)
        self.replay.record = True
        self.replay.last = [None] * len(self.replay.forced)
        self.replay.last_selection = [[] for _ in self.replay.selections]

    def last_token(self) -> list[list[int]]:
        """Per router: the expert ids chosen at the last position of the last forward pass; then per indexer
        the keys (DSA positions, QSA blocks) it selected there."""
        experts = [[] if t is None else [int(e) for e in t.tolist()] for t in self.replay.last]
        return experts + [list(s) for s in self.replay.last_selection]


