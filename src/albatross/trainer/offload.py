"""Optimizer state in host memory: the device keeps only the parameters it computes with and their grads.

``HostOffloadAdamW`` keeps an fp32 master copy of every trainable parameter and AdamW's two moments on
the host (pinned when CUDA is present, so the copies are asynchronous). A step copies the gradients to
the host, runs AdamW there, and copies the updated masters back into the device parameters. For a model
of P parameters this moves 12 P bytes of fp32 state (masters + moments) off the accelerator, and with
bf16 device parameters the masters keep the update in full precision.

Under FSDP2 the same role is played by ``CPUOffloadPolicy`` (see ``distributed.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn


def _host_copy(t: Tensor, pin: bool) -> Tensor:
    host = t.detach().to("cpu", torch.float32, copy=True)
    return host.pin_memory() if pin else host


class HostOffloadAdamW:
    """AdamW stepping on host-side fp32 masters; same results as ``torch.optim.AdamW`` on fp32 params."""

    def __init__(self, params: Iterable[nn.Parameter], *, lr: float, weight_decay: float,
                 betas: tuple[float, float]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.pin = torch.cuda.is_available()
        self.masters = [_host_copy(p, self.pin) for p in self.params]
        self.grad_buffers = [torch.zeros_like(m).pin_memory() if self.pin else torch.zeros_like(m)
                             for m in self.masters]
        self.inner = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay, betas=betas)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> dict[Tensor, dict[str, Any]]:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    @torch.no_grad()
    def step(self) -> None:
        """Grads to host, AdamW on the masters, masters back to the device parameters."""
        for p, m, buf in zip(self.params, self.masters, self.grad_buffers, strict=True):
            m.grad = None if p.grad is None else buf.copy_(p.grad, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()
        self.inner.step()
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m, non_blocking=self.pin)

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the AdamW state of every master that has none yet (zero moments, one step of learning rate 0),
        so that a checkpoint can be loaded into it in place."""
        if all(m in self.inner.state for m in self.masters):
            return
        saved = [(g["lr"], g["weight_decay"]) for g in self.inner.param_groups]
        for g in self.inner.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        for m in self.masters:
            m.grad = torch.zeros_like(m) if m not in self.inner.state else None
        self.inner.step()
        for g, (lr, wd) in zip(self.inner.param_groups, saved, strict=True):
            g["lr"], g["weight_decay"] = lr, wd
        for m in self.masters:
            m.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the moments; the masters are refreshed from the (already loaded) parameters."""
        self.inner.load_state_dict(state)
        for p, m in zip(self.params, self.masters, strict=True):
            m.copy_(p)

    def state_bytes(self) -> int:
        """Bytes of optimizer state (masters and moments) held in host memory."""
        moments = sum(t.numel() * t.element_size() for s in self.inner.state.values()
                      for t in s.values() if isinstance(t, Tensor))
        return moments + sum(m.numel() * m.element_size() for m in self.masters)


# What the trainer steps with: ``torch.optim.AdamW``, or its host-offloaded twin (not a ``torch.optim.Optimizer``)
TrainerOptimizer: TypeAlias = torch.optim.Optimizer | HostOffloadAdamW
