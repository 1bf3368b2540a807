"""Grouped MoE experts: tokens sorted by expert, one grouped matmul per projection.

transformers' eager experts loop over the experts that received tokens: a one-hot mask, a ``where`` and a
gather per expert, two matmuls, then a scatter-add back (``index_add_``), so the work is split into
``E`` small pieces with as many index operations. Here the (token, slot) pairs are sorted by expert once,
so each expert's tokens are one contiguous slice of a single [S, H] tensor (S = tokens x top-k), and each
projection is one grouped matmul over those slices (``torch._grouped_mm`` where the shapes allow it, else
a loop of plain matmuls over the contiguous slices). The outputs are un-permuted and summed back per token
weighted by the routing weights (one batched [1, k] x [k, H] product per token, no atomic scatter); the
gather's backward likewise un-permutes and sums over the slots (``Dispatch``).

``GroupedLinear`` is an autograd function: its backward computes the input gradient with the same
grouped matmul (against the transposed weights) and each expert's weight gradient from its contiguous
slice, so the gradients equal the eager loop's to fp32 rounding (tests/unit/test_trainer_study.py).

transformers 5.x ships the same idea as ``grouped_mm`` (and ``batched_mm``, one [S]-batched matmul over
gathered per-pair weights) behind ``config._experts_implementation``; the study compares all of them.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from albatross.models import CausalLM

EXPERT_CLASSES = ("Experts",)  # class-name suffix of transformers' 3D-weight expert collections


def _aligned(*tensors: Tensor) -> bool:
    """``torch._grouped_mm`` wants 16-byte aligned data and non-unit strides that are multiples of 16 bytes."""
    return all(t.data_ptr() % 16 == 0 and all(s == 1 or s * t.element_size() % 16 == 0 for s in t.stride())
               for t in tensors)


def _use_grouped_mm(x: Tensor, w: Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:  # a torch version boundary
        return False
    if x.device.type == "cuda":
        return w.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu" and _aligned(x, w)


def grouped_mm(x_SI: Tensor, w_EIO: Tensor, offsets: Tensor) -> Tensor:
    """Rows [offsets[e-1], offsets[e]) of ``x`` times ``w[e]``: [S, I] x [E, I, O] -> [S, O] (no autograd)."""
    if _use_grouped_mm(x_SI, w_EIO):
        return torch._grouped_mm(x_SI, w_EIO, offs=offsets)
    out = x_SI.new_empty(x_SI.shape[0], w_EIO.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x_SI[start:end], w_EIO[e], out=out[start:end])
        start = end
    return out


class GroupedLinear(torch.autograd.Function):
    """y[rows of expert e] = x[rows of e] @ W[e]^T for expert weights stored as [E, O, I] (nn.Linear layout)."""

    @staticmethod
    def forward(ctx: Any, x_SI: Tensor, weight_EOI: Tensor, offsets: Tensor) -> Tensor:
        x_SI = x_SI.contiguous()
        ctx.save_for_backward(x_SI, weight_EOI, offsets)
        with torch.autocast(x_SI.device.type, enabled=False):  # inputs already in the compute dtype
            return grouped_mm(x_SI, weight_EOI.transpose(-2, -1), offsets)

    @staticmethod
    def backward(ctx: Any, grad_SO: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x_SI, weight_EOI, offsets = ctx.saved_tensors
        grad_SO = grad_SO.contiguous().to(x_SI.dtype)
        grad_x = grouped_mm(grad_SO, weight_EOI, offsets) if ctx.needs_input_grad[0] else None
        grad_w = _weight_grad(x_SI, grad_SO, offsets, weight_EOI) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def _weight_grad(x_SI: Tensor, grad_SO: Tensor, offsets: Tensor, weight_EOI: Tensor) -> Tensor:
    """dW[e] = g[rows of e]^T x[rows of e], [E, O, I]; experts with no rows get 0."""
    # grouped over the shared (token) dimension on a GPU; on the CPU that kernel is slower than E matmuls
    if x_SI.device.type == "cuda" and _use_grouped_mm(x_SI.T, weight_EOI) and _aligned(grad_SO):
        return torch._grouped_mm(x_SI.T, grad_SO, offs=offsets).transpose(-2, -1)
    grad_w = torch.zeros_like(weight_EOI)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(grad_SO[start:end].T, x_SI[start:end], out=grad_w[e])
        start = end
    return grad_w


class Dispatch(torch.autograd.Function):
    """Each token's row copied to its k (token, slot) pairs in expert order: ``hidden[tokens]``, [N, H] -> [S, H].

    The backward sums each token's k pair gradients by un-permuting them (a gather at each pair's position in
    expert order) and a sum over the slots; autograd's backward of the gather is an accumulating scatter
    (``index_put_``), several times slower on a CPU, as is an ``index_copy_`` scatter.
    """

    @staticmethod
    def forward(ctx: Any, hidden_NH: Tensor, tokens_S: Tensor, position_S: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(position_S)
        ctx.k = k
        return hidden_NH.index_select(0, tokens_S)

    @staticmethod
    def backward(ctx: Any, grad_SH: Tensor) -> tuple[Tensor, None, None, None]:
        (position_S,) = ctx.saved_tensors
        unsorted = grad_SH.index_select(0, position_S)
        return unsorted.view(-1, ctx.k, grad_SH.shape[-1]).sum(1), None, None, None


def _compute_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    """Under autocast (bf16 on a GPU) the matmuls run in its dtype, as ``nn.Linear`` would; else the weights'."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


def sort_by_expert(top_k_index: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(position of each flattened (token, slot) pair in expert order, the token id at each position of that
    order, end offset of each expert)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return position, order // top_k_index.shape[-1], torch.cumsum(counts, 0).to(torch.int32)


class Experts(Protocol):
    """The members of transformers' 3D-weight expert collections (``*Experts``) read here."""

    num_experts: int
    gate_up_proj: Tensor  # [E, 2 x I, H]
    down_proj: Tensor  # [E, H, I]

    def _apply_gate(self, gate_up: Tensor) -> Tensor: ...


def _grouped_linear(x_SI: Tensor, weight_EOI: Tensor, offsets: Tensor) -> Tensor:
    out: Tensor = GroupedLinear.apply(x_SI, weight_EOI, offsets)  # type: ignore[no-untyped-call]  # torch's Function.apply is unannotated
    return out


def grouped_experts_forward(module: Experts, hidden_states: Tensor, top_k_index: Tensor,
                            top_k_weights: Tensor) -> Tensor:
    """The experts' output [N, H] for tokens [N, H] routed to ``top_k_index`` [N, k] with ``top_k_weights``."""
    n, k = top_k_index.shape
    position, tokens, offsets = sort_by_expert(top_k_index, module.num_experts)
    dtype = _compute_dtype(hidden_states, module.gate_up_proj)
    dispatched: Tensor = Dispatch.apply(hidden_states, tokens, position, k)  # type: ignore[no-untyped-call]  # torch's Function.apply is unannotated
    x_SH = dispatched.to(dtype)
    gate_up = _grouped_linear(x_SH, module.gate_up_proj.to(dtype), offsets)
    y_SH = _grouped_linear(module._apply_gate(gate_up), module.down_proj.to(dtype), offsets)
    unsorted = y_SH.index_select(0, position).view(n, k, -1)  # back to (token, slot) order
    # the routing-weighted sum over the k slots as one batched [1, k] x [k, H] product per token
    return torch.bmm(top_k_weights[:, None, :].to(y_SH.dtype), unsorted)[:, 0].to(hidden_states.dtype)


def _check(module: nn.Module) -> None:
    unsupported = [flag for flag, bad in (("is_transposed", True), ("has_bias", True), ("has_gate", False),
                                          ("has_post_expert_norm", True), ("is_concatenated", False))
                   if getattr(module, flag, not bad) == bad]  # transformers' layout flags (absent: the default)
    weight = getattr(module, "gate_up_proj", None)
    if unsupported or not isinstance(weight, Tensor) or weight.dim() != 3:
        raise NotImplementedError(f"grouped experts: {type(module).__name__} has a weight layout albatross does not "
                                  f"group ({', '.join(unsupported) or 'no 3D gate_up_proj'})")


def expert_modules(model: CausalLM) -> list[nn.Module]:
    """transformers' 3D-weight expert collections of ``model`` (``*Experts`` with ``gate_up_proj``)."""
    # transformers modules: hasattr tells the 3D-weight collections from per-expert module lists
    return [m for m in model.modules()
            if type(m).__name__.endswith(EXPERT_CLASSES) and hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


def install_grouped_experts(model: CausalLM) -> int:
    """Run every expert collection of ``model`` through ``grouped_experts_forward``; returns how many.

    Parameters are untouched (names, shapes, checkpoints); generation takes the same path.
    """
    modules = expert_modules(model)
    for module in modules:
        _check(module)
        # matched by class name and weights (``expert_modules``): a transformers ``*Experts``
        module.forward = functools.partial(grouped_experts_forward, cast(Experts, module))
    return len(modules)
