"""Fused hyper-connection (gated residual) ops for ``qwen4_exp``.

Each ``qwen4_exp`` decoder layer keeps ``hc_count`` residual streams. Around the token mixer and around the
MLP, ``Qwen4ExpTextGatedResidual`` normalises the streams, computes a low-rank sigmoid mix that reads them
into the block's input, and a per-stream injection weight; after the block, transformers writes the block
output back into every stream with three separate ops (unsqueeze-multiply, flatten, add). As shipped the
two projections that read the normalised streams (mix-down and inject) are two matmuls over the same
input, and each step materialises its own intermediate.

Here (same weights, same math, fp32-rounding equal; tests/unit/test_trainer_study.py):

- the mix-down and inject projections are one matmul over the normalised streams (weights concatenated);
- the stream mix is one multiply and one mean over the stream axis;
- the write-back is one ``addcmul`` (streams + block output x injection weights), whose backward is a
  single fused pass as well;
- under activation checkpointing, an indexed-attention layer whose attention is the fast indexer's
  (``models/indexer.py``: its fused attention keeps only q, k, v, its output and log-sum-exp, and its
  long-document query chunks checkpoint themselves) is checkpointed around its attention, not through it:
  the residual ops and the MLP are recomputed in the backward, the attention is not (its own backward
  needs none of its intermediates).

On a CPU with small widths this saves little (the matmuls dominate); on a GPU, where these ops are
memory-bound elementwise kernels, fewer passes over the [T, hc x H] streams is what pays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from albatross.models import CausalLM
from albatross.models.indexer import FAST_INDEXER

LAYER_CLASSES = ("Qwen4ExpTextDecoderLayer",)
RESIDUAL_CLASSES = ("Qwen4ExpTextGatedResidual",)


class GatedResidual(Protocol):
    """The members of transformers' ``Qwen4ExpTextGatedResidual`` read here (matched by class name)."""

    hc_count: int
    hidden_size: int
    hc_norm: nn.Module
    input_mix_weight_down: nn.Linear
    input_mix_weight_up: nn.Linear
    block_inject_weight: nn.Linear | None  # None on the final stream mixer


class DecoderLayer(Protocol):
    """The members of transformers' ``Qwen4ExpTextDecoderLayer`` read here (matched by class name)."""

    training: bool
    layer_type: str
    ple: nn.Module | None
    attn_hyper_connection: GatedResidual
    mlp_hyper_connection: GatedResidual
    self_attn: nn.Module
    linear_attn: nn.Module
    mlp: nn.Module


def _mixed(hc: GatedResidual, streams: Tensor) -> tuple[Tensor, Tensor, int]:
    """(block input, the normalised streams' projections z, the mix-down rows of z)."""
    n, h = hc.hc_count, hc.hidden_size
    normed = hc.hc_norm(streams)
    down = hc.input_mix_weight_down.weight
    inject = hc.block_inject_weight
    weight = down if inject is None else torch.cat([down, inject.weight])
    z = F.linear(normed, weight) / n
    mix = torch.sigmoid(hc.input_mix_weight_up(F.silu(z[..., : down.shape[0]])))
    return torch.unflatten(mix * normed, -1, (n, h)).mean(dim=-2), z, down.shape[0]


def gated_residual(hc: GatedResidual, streams: Tensor) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """``Qwen4ExpTextGatedResidual.forward``: (block input, streams, injection weights), or the input alone."""
    if hc.block_inject_weight is None:
        return _mixed(hc, streams)[0]
    return block_residual(hc, streams)


def block_residual(hc: GatedResidual, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's gated residual (one with injection weights): (block input, streams, injection weights)."""
    mixed, z, rows = _mixed(hc, streams)
    return mixed, streams, 2 * torch.sigmoid(z[..., rows:])


def write_back(streams: Tensor, block_out: Tensor, weights: Tensor) -> Tensor:
    """streams + block output x per-stream injection weight, in one op: [..., hc x H]."""
    return torch.addcmul(torch.unflatten(streams, -1, (weights.shape[-1], -1)), block_out.unsqueeze(-2),
                         weights.unsqueeze(-1)).flatten(-2)


def _attention_apart(layer: DecoderLayer) -> bool:
    """Checkpointing this layer leaves its attention out: the fast indexer's, which keeps little for its backward."""
    return layer.layer_type != "linear_attention" and bool(layer.self_attn.__dict__.get(FAST_INDEXER, False))


def _checkpointing(layer: object) -> bool:
    """transformers' ``gradient_checkpointing`` flag as set on the layer (``set_gradient_checkpointing``)."""
    return bool(layer.__dict__.get("_albatross_checkpointing", False))


def _set_checkpointing(layer: object, value: bool) -> None:
    layer.__dict__["_albatross_checkpointing"] = value


def _layer_checkpointed(layer: DecoderLayer) -> bool:
    """What transformers' wrapper reads: checkpoint the whole layer, unless it checkpoints around its attention."""
    return _checkpointing(layer) and not _attention_apart(layer)


def _before_mixer(layer: DecoderLayer, hidden_states: Tensor, ple_input_ids: Tensor | None, cache: object,
                  conv_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """PLE, then the token mixer's gated residual: (mixer input, streams, injection weights)."""
    if layer.ple is not None:
        hidden_states = hidden_states + layer.ple(hidden_states, ple_input_ids, cache, conv_mask=conv_mask)
    return block_residual(layer.attn_hyper_connection, hidden_states)


def _after_mixer(layer: DecoderLayer, streams: Tensor, x: Tensor, weights: Tensor) -> Tensor:
    """The mixer's write-back, then the MLP with its gated residual."""
    x, streams, weights = block_residual(layer.mlp_hyper_connection, write_back(streams, x, weights))
    return write_back(streams, layer.mlp(x), weights)


def _run(fn: Callable[..., Any], *args: object) -> Any:
    return fn(*args)


def fused_layer_forward(layer: DecoderLayer, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                        attention_mask: Tensor | None = None, conv_mask: Tensor | None = None, cache: object = None,
                        ple_input_ids: Tensor | None = None, **kwargs: Any) -> Tensor:
    """``Qwen4ExpTextDecoderLayer.forward`` with the fused residual ops (its submodules called as shipped).

    A layer checkpointed around its attention (``_attention_apart``) checkpoints the parts before and after
    the attention and runs the attention as it is."""
    run: Callable[..., Any] = _run  # or the checkpoint of each part
    if _checkpointing(layer) and _attention_apart(layer) and layer.training and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        run, cache = functools.partial(checkpoint, use_reentrant=False), None
    x, streams, weights = run(_before_mixer, layer, hidden_states, ple_input_ids, cache, conv_mask)
    if layer.layer_type == "linear_attention":
        x = layer.linear_attn(x, cache=cache, attention_mask=conv_mask, **kwargs)
    else:
        x, _ = layer.self_attn(x, position_embeddings, attention_mask=attention_mask, cache=cache, **kwargs)
    out: Tensor = run(_after_mixer, layer, streams, x, weights)
    return out


_FUSED_CLASSES: dict[type, type] = {}


def fused_class(cls: type) -> type:
    """``cls`` (a decoder layer class) with ``fused_layer_forward`` as its forward, same name and module.

    A subclass, not an instance ``forward``: transformers wraps each layer class's ``forward`` with its
    activation checkpointing (``GradientCheckpointingLayer.__init_subclass__``), which an instance attribute
    would bypass, so the layers would keep every activation however ``activation_checkpointing`` is set.
    """
    if cls in _FUSED_CLASSES.values():
        return cls
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": fused_layer_forward, "__module__": cls.__module__,
            "gradient_checkpointing": property(_layer_checkpointed, _set_checkpointing),
            "__qualname__": cls.__qualname__, "__doc__": fused_layer_forward.__doc__})
    return _FUSED_CLASSES[cls]


def install_fused_hyper(model: CausalLM) -> int:
    """Swap the ``qwen4_exp`` decoder layers' and final mixer's forwards for the fused ones; returns how many
    modules changed (0: the model has no such hyper-connections). An MTP head is left as it is."""
    count = 0
    for module in model.get_decoder().modules():  # an MTP head keeps its own forward
        name = type(module).__name__
        if name in LAYER_CLASSES:
            flag = module.__dict__.pop("gradient_checkpointing", None)
            module.__class__ = fused_class(type(module))
            if flag is not None:
                module.gradient_checkpointing = flag
            count += 1
        elif name in RESIDUAL_CLASSES:
            hc = cast(GatedResidual, module)  # matched by class name: a transformers ``Qwen4ExpTextGatedResidual``
            if hc.block_inject_weight is None:  # the final stream mixer
                module.forward = functools.partial(gated_residual, hc)
                count += 1
    return count
