"""Routing replay: the trainer routes each token to the experts the sampler chose, in fp32.

A token routed to other experts by the trainer than by the engine (numerics, batch shapes, weights a step
apart) gets a log-prob from another function than the one that sampled it, and the importance ratio of
RL breaks. ``install(model)`` swaps the forward of every MoE router (``*TopKRouter``: softmax routers of
``qwen3_moe`` / ``qwen3_next`` / ``qwen4_exp``; sigmoid routers with a score bias and expert groups of
``glm_moe_dsa`` / ``glm5_next``) for one that computes the router logits and scores in fp32 and takes its
top-k from ``Replay.forced`` where a token has a recorded choice (live top-k elsewhere). The expert weights
are the live scores of the forced experts, normalised as the family does, so gradients still reach the
router. The engine records through the same forward (``RoutingRecorder``): for each forward pass, the
experts of its last position, i.e. of the position whose logits sample the next token.

Router load-balancing losses are never part of RL here: they are computed only by the ``*ForCausalLM``
forward when ``output_router_logits`` is on, and the trainer calls the decoder alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class Replay:
    """Per router (model order): forced top-k ``[N, k]`` (-1 = live) or None; the last forward's choices."""

    forced: list[Tensor | None] = field(default_factory=list)
    last: list[Tensor | None] = field(default_factory=list)


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (modules named ``*TopKRouter`` / ``*TopkRouter``)."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def _sigmoid(router: nn.Module) -> bool:
    return hasattr(router, "e_score_correction_bias")


def _live_topk(router: nn.Module, scores_NE: Tensor) -> Tensor:
    """The family's own expert choice from fp32 scores (grouped, biased top-k for sigmoid routers)."""
    if not _sigmoid(router):
        return scores_NE.topk(router.top_k, dim=-1).indices
    choice_NE = scores_NE + router.e_score_correction_bias.float()
    groups = choice_NE.view(-1, router.num_group, router.num_experts // router.num_group)
    group_idx = groups.topk(2, dim=-1)[0].sum(-1).topk(router.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(groups[..., 0]).scatter_(1, group_idx, 1).bool()
    choice_NE = choice_NE.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
    return choice_NE.topk(router.top_k, dim=-1, sorted=False)[1]


def _weights(router: nn.Module, scores_NE: Tensor, idx_NK: Tensor) -> Tensor:
    w_NK = scores_NE.gather(1, idx_NK)
    if _sigmoid(router):
        if router.norm_topk_prob:
            w_NK = w_NK / (w_NK.sum(-1, keepdim=True) + 1e-20)
        return w_NK * router.routed_scaling_factor
    return w_NK / w_NK.sum(-1, keepdim=True) if router.norm_topk_prob else w_NK


def _replayed_forward(router: nn.Module, replay: Replay, i: int, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    h_NH = hidden.reshape(-1, router.hidden_dim)
    logits_NE = F.linear(h_NH.float(), router.weight.float())
    scores_NE = logits_NE.sigmoid() if _sigmoid(router) else logits_NE.softmax(-1)
    idx_NK = _live_topk(router, scores_NE.detach())
    forced = replay.forced[i]
    if forced is not None:
        if forced.shape[0] != idx_NK.shape[0]:
            raise ValueError(f"routing replay: router {i} got {idx_NK.shape[0]} tokens, "
                             f"the recorded routing has {forced.shape[0]}")
        forced = forced.to(idx_NK.device)
        idx_NK = torch.where(forced[:, :1] >= 0, forced, idx_NK)
    replay.last[i] = idx_NK[-1].detach()
    return logits_NE, _weights(router, scores_NE, idx_NK), idx_NK


def install(model: nn.Module) -> Replay:
    """Route every MoE router of ``model`` through ``Replay`` (idempotent; parameters untouched)."""
    current = getattr(model, "_albatross_replay", None)
    if current is not None:
        return current
    routers = moe_routers(model)
    replay = Replay([None] * len(routers), [None] * len(routers))
    for i, router in enumerate(routers):
        router.forward = functools.partial(_replayed_forward, router, replay, i)
    model._albatross_replay = replay
    return replay


def set_forced(replay: Replay, routing_TLK: Tensor | None) -> None:
    """Force the next forwards' routing: ``routing_TLK[t, l]`` the experts of token ``t`` at router ``l``
    (rows of -1: live). None: every router live. Kept until the next call (activation checkpointing)."""
    if routing_TLK is not None and routing_TLK.shape[1] != len(replay.forced):
        raise ValueError(f"routing replay: recorded routing has {routing_TLK.shape[1]} MoE layers, "
                         f"the model {len(replay.forced)}")
    for i in range(len(replay.forced)):
        replay.forced[i] = None if routing_TLK is None else routing_TLK[:, i]


def routing_tensor(routing: list[list[list[int]]], n_layers: int, k: int) -> Tensor:
    """``[T, n_layers, k]`` long from per-token lists (``[]`` = not recorded: -1)."""
    out = torch.full((len(routing), n_layers, k), -1, dtype=torch.long)
    for t, layers in enumerate(routing):
        if layers:
            out[t] = torch.tensor(layers, dtype=torch.long)
    return out


class RoutingRecorder:
    """Records, per forward pass of ``model``, the experts each router chose for the last position."""

    def __init__(self, model: nn.Module) -> None:
        self.replay = install(model)

    def start(self) -> None:
        set_forced(self.replay, None)
        self.replay.last = [None] * len(self.replay.forced)

    def last_token(self) -> list[list[int]]:
        """Per router: the expert ids chosen at the last position of the last forward pass."""
        return [[] if t is None else [int(e) for e in t.tolist()] for t in self.replay.last]


