"""One optimisation step: pack, forward/backward per micro-batch with exact accumulation, clip, AdamW.

Model-agnostic over transformers causal LMs (``TokenLogprobs``: decoder hidden states, then log-probs
in chunks over tokens). Every micro-batch's loss is divided by the token count of the whole batch, so
the accumulated gradient does not depend on how the batch was split, nor across how many FSDP ranks.
Every technique is a constructor argument, resolved once here; ``docs/trainer.md`` lists them all.
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from albatross.config import RunConfig, default
from albatross.records import Batch, Sample, TrainSample
from albatross.rl.losses import LossFn, entropy_bonus, get_loss_fn, kl_penalty, loss_knobs, sft_loss
from albatross.trainer import distributed as dist
from albatross.trainer.checkpoint import load_state, save_state
from albatross.trainer.logprobs import TokenLogprobs
from albatross.trainer.model import enable_activation_checkpointing, freeze
from albatross.trainer.offload import HostOffloadAdamW
from albatross.trainer.packing import MicroBatch, attention_inputs, pack

# How per-micro-batch loss metrics combine into batch metrics; anything else is a mean weighted by tokens.
SUM_KEYS = frozenset({"loss", "tokens", "active_tokens", "stale_tokens_dropped", "floored_tokens",
                      "kl_penalty", "entropy_bonus"})
SUM_PREFIXES = ("staleness_hist/",)
MAX_KEYS = frozenset({"staleness_max", "ratio_max"})

LossOf = Callable[[MicroBatch, Tensor, Tensor, int], tuple[Tensor, dict[str, float]]]
Regularizer = Callable[[MicroBatch, Tensor, Tensor, int], tuple[Tensor, dict[str, float]]]


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


def padding_micro_batch() -> MicroBatch:
    """One token with no loss: keeps FSDP ranks in step when a rank has fewer micro-batches."""
    zero_f, zero_l = torch.zeros(1), torch.zeros(1, dtype=torch.long)
    return MicroBatch(input_ids=zero_l[None], position_ids=zero_l[None], seq_lens=[1], targets=zero_l,
                      loss_mask=zero_f, logprobs=zero_f, versions=zero_l, advantages=zero_f)


def _regularizers(kl_coef: float, entropy_coef: float) -> list[Regularizer]:
    """Optional extra terms (none by default), chosen once."""
    regs: list[Regularizer] = []
    if kl_coef:
        regs.append(lambda mb, lp, ent, n: kl_penalty(lp, mb.logprobs.to(lp.device), mb.loss_mask.to(lp.device),
                                                      coef=kl_coef, num_batch_tokens=n))
    if entropy_coef:
        regs.append(lambda mb, lp, ent, n: entropy_bonus(ent, mb.loss_mask.to(lp.device), coef=entropy_coef,
                                                         num_batch_tokens=n))
    return regs


def _use_bf16(precision: str, device: torch.device) -> bool:
    if precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision must be 'auto', 'fp32' or 'bf16', got {precision!r}")
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def _optimizer(params: list[nn.Parameter], offload: bool, **adamw: Any) -> Any:
    return HostOffloadAdamW(params, **adamw) if offload else torch.optim.AdamW(params, **adamw)


def sampling_temperature(temperature: float) -> float:
    """The temperature the trainer scores tokens at: the sampler's, except greedy (0), whose log-probs the
    engines report at temperature 1."""
    return temperature if temperature > 0 else 1.0


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    """AdamW over a causal LM's trainable parameters; ``step`` for RL, ``sft_step`` for the warm start.

    Knobs beyond the optimizer (each resolved once, here; docs/trainer.md has the table):
    ``micro_batch_tokens`` packing budget; ``loss`` / ``loss_kwargs`` the policy loss (``rl.losses``);
    ``kl_coef`` / ``entropy_coef`` optional extra terms (0: none); ``logprob_chunk`` tokens per
    LM-head chunk (None: full logits); ``logprob_recompute`` recompute the head's logits in the
    backward (None: when a micro-batch's [T, V] log-probs would pass 512 MiB); ``attention`` document
    masking (``auto``, ``varlen``, ``flash``, ``dense``); ``activation_checkpointing``; ``freeze`` glob
    patterns of parameter names; ``offload_optimizer`` optimizer state in host memory; ``precision``
    (``auto``: bf16 on GPU, fp32 on CPU); ``fsdp`` shard across the ranks of an initialised group.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = default("trainer", "lr"),
        weight_decay: float = default("trainer", "weight_decay"),
        betas: tuple[float, float] = (0.9, 0.95),
        grad_clip: float | None = default("trainer", "grad_clip"),
        micro_batch_tokens: int = default("trainer", "micro_batch_tokens"),
        loss: str = default("rl", "loss"),
        loss_kwargs: dict[str, Any] | None = None,
        kl_coef: float = default("rl", "kl_coef"),
        entropy_coef: float = default("rl", "entropy_coef"),
        logprob_chunk: int | None = default("trainer", "logprob_chunk"),
        logprob_recompute: bool | None = None,
        temperature: float = default("sampling", "temperature"),
        attention: str = default("trainer", "attention"),
        activation_checkpointing: bool = default("trainer", "activation_checkpointing"),
        freeze: Sequence[str] = (),
        offload_optimizer: bool = default("trainer", "offload_optimizer"),
        precision: str = default("trainer", "precision"),
        fsdp: bool = False,
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        self.model = model.train()
        self.frozen = self._prepare_model(freeze, activation_checkpointing)
        self.attention = attention_inputs(model, attention)
        self.device = next(model.parameters()).device
        bf16 = _use_bf16(precision, self.device)
        self.policy = TokenLogprobs(model, chunk_size=logprob_chunk, temperature=temperature,
                                    entropy_grad=bool(entropy_coef), recompute=logprob_recompute)
        self.fsdp = fsdp
        if fsdp:
            if not dist.is_distributed():
                raise RuntimeError("fsdp=True needs an initialised process group of >1 ranks (torchrun)")
            dist.shard(self.policy, model, bf16=bf16, offload=offload_optimizer)
        self.grad_scale = float(dist.world_size()) if fsdp else 1.0  # FSDP averages over ranks; we sum
        self.autocast = self._autocast(bf16 and not fsdp)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # under FSDP the optimizer state is offloaded by FSDP's own CPUOffloadPolicy
        self.optimizer = _optimizer(self.params, offload_optimizer and not fsdp, lr=lr,
                                    weight_decay=weight_decay, betas=betas)
        self.loss_fn: LossFn = get_loss_fn(loss, **(loss_kwargs or {}))
        self.regularizers = _regularizers(kl_coef, entropy_coef)
        self.grad_clip = grad_clip
        self.micro_batch_tokens = micro_batch_tokens
        self.version = 0
        self.steps = 0

    @classmethod
    def from_config(cls, model: nn.Module, cfg: RunConfig, *, fsdp: bool = False, lr: float | None = None) -> Trainer:
        """The trainer of a run config: ``[trainer]`` and ``[rl]`` knobs, the loss of ``rl.loss`` with its own
        knobs, log-probs at the sampling temperature (so importance ratios compare like with like); ``lr``
        overrides ``trainer.lr`` (the warm start's own rate)."""
        rl, tc = cfg.rl, cfg.trainer
        return cls(
            model, lr=tc.lr if lr is None else lr, weight_decay=tc.weight_decay, grad_clip=tc.grad_clip,
            micro_batch_tokens=tc.micro_batch_tokens, loss=rl.loss, loss_kwargs=loss_knobs(rl),
            kl_coef=rl.kl_coef, entropy_coef=rl.entropy_coef, logprob_chunk=tc.logprob_chunk or None,
            temperature=sampling_temperature(cfg.sampling.temperature), attention=tc.attention,
            activation_checkpointing=tc.activation_checkpointing, freeze=tc.freeze,
            offload_optimizer=tc.offload_optimizer, precision=tc.precision, fsdp=fsdp, seed=cfg.seed,
        )

    def _prepare_model(self, patterns: Sequence[str], checkpointing: bool) -> list[str]:
        frozen = freeze(self.model, patterns) if patterns else []
        if checkpointing:
            enable_activation_checkpointing(self.model)
        return frozen

    def _autocast(self, bf16: bool) -> Callable[[], contextlib.AbstractContextManager]:
        if not bf16:
            return contextlib.nullcontext
        return functools.partial(torch.autocast, self.device.type, dtype=torch.bfloat16)

    # forward -------------------------------------------------------------------------------------
    def forward_logprobs(self, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        """Trainer log-probs (with grad) and entropies of a micro-batch's targets, [T] each."""
        d = self.device
        attn = self.attention(mb, torch.float32, d)
        with self.autocast():
            return self.policy(mb.input_ids.to(d), mb.position_ids.to(d), mb.targets.to(d), **attn)

    # gradients -----------------------------------------------------------------------------------
    def _micro_step(self, mb: MicroBatch, loss_of: LossOf, n_batch: int) -> dict[str, float]:
        logprobs, entropy = self.forward_logprobs(mb)
        loss, metrics = loss_of(mb, logprobs, entropy, n_batch)
        for reg in self.regularizers:
            extra, m = reg(mb, logprobs, entropy, n_batch)
            loss = loss + extra
            metrics.update(m)
        (loss * self.grad_scale).backward()
        mask = mb.loss_mask.to(entropy.device)
        tokens = float(mask.sum())
        metrics["entropy"] = float((entropy.detach() * mask).sum()) / tokens if tokens else 0.0
        return metrics

    def accumulate(self, micro_batches: Sequence[MicroBatch], loss_of: LossOf) -> dict[str, float]:
        """Zero grads, then forward/backward this rank's micro-batches, each normalised by the batch's tokens."""
        self.optimizer.zero_grad(set_to_none=True)
        n_batch = sum(mb.num_loss_tokens for mb in micro_batches)
        mine = dist.assign(micro_batches, dist.world_size(), dist.rank())
        parts = []
        for mb in mine:
            metrics = self._micro_step(mb or padding_micro_batch(), loss_of, n_batch)
            if mb is not None:
                parts.append(metrics)
        parts = [p for rank_parts in dist.gather(parts) for p in rank_parts]
        return merge_metrics(parts) if parts else {"loss": 0.0, "tokens": 0.0}

    def rl_gradients(self, batch: Batch, current_version: int) -> dict[str, float]:
        """Accumulate the RL loss gradient of ``batch`` into ``.grad`` (no optimizer step)."""

        def loss_of(mb: MicroBatch, logprobs: Tensor, entropy: Tensor, n: int) -> tuple[Tensor, dict]:
            d = logprobs.device
            return self.loss_fn(logprobs, mb.logprobs.to(d), mb.advantages.to(d), mb.loss_mask.to(d),
                                mb.versions.to(d), current_version=current_version, num_batch_tokens=n)

        return self.accumulate(pack(batch.samples, self.micro_batch_tokens), loss_of)

    def _apply(self, metrics: dict[str, float], t0: float, tokens: int) -> dict[str, float]:
        """Clip, step the optimizer, and add the step-level metrics."""
        clip = self.grad_clip if self.grad_clip else float("inf")
        grad_norm = dist.full_tensor(torch.nn.utils.clip_grad_norm_(self.params, clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        seconds = time.perf_counter() - t0
        return {**metrics, "grad_norm": float(grad_norm), "input_tokens": float(tokens), "seconds": seconds,
                "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}

    # public steps --------------------------------------------------------------------------------
    def step(
        self, batch: Batch, current_version: int | None = None, batch_info: dict[str, float] | None = None
    ) -> dict[str, float]:
        """One RL step on ``batch``; staleness is measured against ``current_version`` (default: own).

        ``batch_info`` (e.g. the orchestrator's counts of groups seen and dropped, by reason) is passed
        through into the metrics under ``batch/<key>``.
        """
        t0 = time.perf_counter()
        version = self.version if current_version is None else current_version
        metrics = self.rl_gradients(batch, version)
        out = self._apply(metrics, t0, batch.num_tokens)
        self.version += 1
        out["version"] = float(self.version)
        out["groups"] = float(batch.groups)
        out.update({f"batch/{k}": float(v) for k, v in (batch_info or {}).items()})
        return out

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One supervised step: masked cross-entropy on ``loss_mask`` tokens (the warm start)."""
        t0 = time.perf_counter()

        def loss_of(mb: MicroBatch, logprobs: Tensor, entropy: Tensor, n: int) -> tuple[Tensor, dict]:
            return sft_loss(logprobs, mb.loss_mask.to(logprobs.device), num_batch_tokens=n)

        micro = pack([TrainSample(sample=s, advantage=0.0) for s in samples], self.micro_batch_tokens)
        metrics = self.accumulate(micro, loss_of)
        return self._apply(metrics, t0, sum(len(s.token_ids) for s in samples))

    # resume --------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Model, optimizer, step, version and every rank's RNG state (every rank must call it)."""
        extra = {"version": self.version, "rng": dist.gather(rng_state())}
        save_state(path, self.model, self.optimizer, self.steps, extra)

    def load(self, path: str | Path) -> None:
        """Restore what ``save`` wrote, so the next steps repeat those of the uninterrupted run."""
        self.steps, extra = load_state(path, self.model, self.optimizer)
        self.version = int(extra.get("version", 0))
        states = extra.get("rng") or []
        if states:
            set_rng_state(states[dist.rank() % len(states)])
