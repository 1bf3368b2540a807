"""One optimisation step: pack, forward/backward per micro-batch with exact accumulation, clip, AdamW.

Model-agnostic over transformers causal LMs: hidden states come from ``model.get_decoder()`` and the
LM head from ``model.get_output_embeddings()``, so log-probs are computed in chunks (``logprobs.py``).
Every micro-batch's loss is divided by the token count of the whole batch, so the accumulated
gradient does not depend on how the batch was split.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from albatross.records import Batch, Sample, TrainSample
from albatross.rl.losses import LossFn, get_loss_fn, sft_loss
from albatross.trainer.checkpoint import load_state, save_state
from albatross.trainer.logprobs import chunked_logprobs
from albatross.trainer.packing import MicroBatch, block_causal_mask, pack

# How per-micro-batch loss metrics combine into batch metrics; anything else is a mean weighted by tokens.
SUM_KEYS = frozenset({"loss", "tokens", "active_tokens", "stale_tokens_dropped", "floored_tokens"})
SUM_PREFIXES = ("staleness_hist/",)
MAX_KEYS = frozenset({"staleness_max", "ratio_max"})


def merge_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine micro-batch metrics: sums for counts and the loss, max for maxima, token-weighted means."""
    total = sum(p.get("tokens", 0.0) for p in parts)
    out: dict[str, float] = {}
    for key in {k for p in parts for k in p}:
        vals = [(p[key], p.get("tokens", 0.0)) for p in parts if key in p]
        if key in SUM_KEYS or key.startswith(SUM_PREFIXES):
            out[key] = sum(v for v, _ in vals)
        elif key in MAX_KEYS:
            out[key] = max(v for v, _ in vals)
        else:
            out[key] = sum(v * w for v, w in vals) / total if total else 0.0
    return out


class Trainer:
    """AdamW over a causal LM's trainable parameters; ``step`` for RL, ``sft_step`` for the warm start."""

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        grad_clip: float | None = 1.0,
        micro_batch_tokens: int = 4096,
        loss: str = "tis",
        loss_kwargs: dict[str, Any] | None = None,
        logprob_chunk: int = 1024,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        self.model = model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=betas)
        self.loss_fn: LossFn = get_loss_fn(loss, **(loss_kwargs or {}))
        self.grad_clip = grad_clip
        self.micro_batch_tokens = micro_batch_tokens
        self.logprob_chunk = logprob_chunk
        self.temperature = temperature
        self.version = 0
        self.steps = 0

    # forward -------------------------------------------------------------------------------------
    def _attention_mask(self, mb: MicroBatch, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """Block-diagonal causal mask (boolean for sdpa, additive otherwise).

        Flash-attention kernels get no mask: transformers splits the sequences by the restarting
        position_ids. The dense mask is T x T, so long packed rows on GPU want flash attention.
        """
        impl = str(getattr(getattr(self.model, "config", None), "_attn_implementation", "") or "")
        if "flash" in impl:
            return None
        return block_causal_mask(mb.seq_lens, torch.bool if impl == "sdpa" else dtype, device)

    def forward_logprobs(self, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        """Trainer log-probs (with grad) and entropies of a micro-batch's targets, [T] each."""
        first = next(self.model.parameters())
        mask = self._attention_mask(mb, first.dtype, first.device)
        out = self.model.get_decoder()(
            input_ids=mb.input_ids.to(first.device),
            position_ids=mb.position_ids.to(first.device),
            attention_mask=mask,
            use_cache=False,
        )
        hidden_TH = out.last_hidden_state[0]
        return chunked_logprobs(
            hidden_TH,
            self.model.get_output_embeddings(),
            mb.targets.to(first.device),
            chunk_size=self.logprob_chunk,
            temperature=self.temperature,
        )

    # gradients -----------------------------------------------------------------------------------
    def accumulate(
        self,
        micro_batches: Sequence[MicroBatch],
        loss_of: Callable[[MicroBatch, Tensor, int], tuple[Tensor, dict]],
    ) -> dict[str, float]:
        """Zero grads, then forward/backward each micro-batch with the whole batch's token count."""
        self.optimizer.zero_grad(set_to_none=True)
        n_batch = sum(mb.num_loss_tokens for mb in micro_batches)
        parts = []
        for mb in micro_batches:
            logprobs, entropy = self.forward_logprobs(mb)
            loss, metrics = loss_of(mb, logprobs, n_batch)
            loss.backward()
            mask = mb.loss_mask.to(entropy.device)
            tokens = float(mask.sum())
            metrics["entropy"] = float((entropy * mask).sum()) / tokens if tokens else 0.0
            parts.append(metrics)
        return merge_metrics(parts) if parts else {"loss": 0.0, "tokens": 0.0}

    def rl_gradients(self, batch: Batch, current_version: int) -> dict[str, float]:
        """Accumulate the RL loss gradient of ``batch`` into ``.grad`` (no optimizer step)."""

        def loss_of(mb: MicroBatch, logprobs: Tensor, n: int) -> tuple[Tensor, dict]:
            d = logprobs.device
            return self.loss_fn(
                logprobs,
                mb.logprobs.to(d),
                mb.advantages.to(d),
                mb.loss_mask.to(d),
                mb.versions.to(d),
                current_version=current_version,
                num_batch_tokens=n,
            )

        return self.accumulate(pack(batch.samples, self.micro_batch_tokens), loss_of)

    def _apply(self, metrics: dict[str, float], t0: float, tokens: int) -> dict[str, float]:
        """Clip, step the optimizer, and add the step-level metrics."""
        clip = self.grad_clip if self.grad_clip else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        seconds = time.perf_counter() - t0
        return {
            **metrics,
            "grad_norm": float(grad_norm),
            "input_tokens": float(tokens),
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        }

    # public steps --------------------------------------------------------------------------------
    def step(self, batch: Batch, current_version: int | None = None) -> dict[str, float]:
        """One RL step on ``batch``; staleness is measured against ``current_version`` (default: own)."""
        t0 = time.perf_counter()
        version = self.version if current_version is None else current_version
        metrics = self.rl_gradients(batch, version)
        out = self._apply(metrics, t0, batch.num_tokens)
        self.version += 1
        out["version"] = float(self.version)
        return out

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One supervised step: masked cross-entropy on ``loss_mask`` tokens (the warm start)."""
        t0 = time.perf_counter()

        def loss_of(mb: MicroBatch, logprobs: Tensor, n: int) -> tuple[Tensor, dict]:
            return sft_loss(logprobs, mb.loss_mask.to(logprobs.device), num_batch_tokens=n)

        micro = pack([TrainSample(sample=s, advantage=0.0) for s in samples], self.micro_batch_tokens)
        metrics = self.accumulate(micro, loss_of)
        return self._apply(metrics, t0, sum(len(s.token_ids) for s in samples))

    # resume --------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        save_state(path, self.model, self.optimizer, self.steps, {"version": self.version})

    def load(self, path: str | Path) -> None:
        self.steps, extra = load_state(path, self.model, self.optimizer)
        self.version = int(extra.get("version", 0))
