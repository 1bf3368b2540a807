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
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from albatross.config import ConfigError, LoRAConfig, RLConfig, RunConfig, TrainerConfig, default
from albatross.records import Batch, Sample, TrainSample
from albatross.rl.losses import (
    LossFn,
    entropy_bonus,
    get_loss_fn,
    kl_penalty,
    loss_knobs,
    mismatch_kl,
    sft_loss,
)
from albatross.trainer import distributed as dist
from albatross.trainer.checkpoint import load_state, save_state
from albatross.trainer.logprobs import TokenLogprobs
from albatross.trainer.model import apply_model_options, decoder_of, enable_activation_checkpointing, freeze
from albatross.trainer.offload import HostOffloadAdamW, TrainerOptimizer
from albatross.trainer.packing import MicroBatch, attention_inputs, pack

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from albatross.models.mtp import Mtp

# How per-micro-batch loss metrics combine into batch metrics; anything else is a mean weighted by tokens.
SUM_KEYS = frozenset({"loss", "tokens", "active_tokens", "stale_tokens_dropped", "floored_tokens",
                      "kl_penalty", "entropy_bonus", "mtp_tokens"})
SUM_PREFIXES = ("staleness_hist/",)
MAX_KEYS = frozenset({"staleness_max", "ratio_max"})

BETAS = (0.9, 0.95)  # AdamW's moment decay rates (not a config knob)

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


def _optimizer(params: list[nn.Parameter], offload: bool, lr: float, weight_decay: float) -> TrainerOptimizer:
    if offload:
        return HostOffloadAdamW(params, lr=lr, weight_decay=weight_decay, betas=BETAS)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=BETAS)


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


def _prepare_mtp(model: PreTrainedModel, mode: str, freeze: Sequence[str]) -> Mtp | None:
    """Apply ``trainer.mtp`` to the model's MTP head (``model.mtp``, loaded by ``load_model``); return the
    head when it stays. ``train`` needs one; ``frozen`` keeps it without gradients; ``off`` drops it."""
    from albatross.models import family
    from albatross.models.mtp import detach_mtp, get_mtp

    if mode not in ("off", "train", "frozen"):
        raise ConfigError(f"trainer.mtp: expected 'off', 'train' or 'frozen', got {mode!r}")
    head = get_mtp(model)
    if mode == "off":
        if head is not None and "mtp" in freeze:
            raise ConfigError("trainer.freeze has \"mtp\" but trainer.mtp = \"off\" drops the MTP head: set "
                              "trainer.mtp = \"frozen\" to keep it frozen, or take \"mtp\" out of trainer.freeze")
        detach_mtp(model)
        return None
    if mode == "train" and head is None:
        raise ConfigError(f"trainer.mtp = \"train\": the model ({family(model)}) has no MTP head "
                          "(no mtp.* / MTP-layer weights in model.path, or a family without one)")
    if mode == "train" and "mtp" in freeze:
        raise ConfigError("trainer.mtp = \"train\" but trainer.freeze has \"mtp\": use trainer.mtp = \"frozen\"")
    if head is not None and mode == "frozen":
        head.requires_grad_(False)
    return head


class Trainer:
    """AdamW over a causal LM's trainable parameters; ``step`` for RL, ``sft_step`` for the warm start.

    Every knob is a field of ``TrainerConfig`` (``[trainer]``) or ``RLConfig`` (``[rl]``), read once, here;
    docs/trainer.md has the table. The log-prob head recomputes its logits in the backward when a micro-batch's
    [T, V] probabilities would pass ``logprobs.KEEP_BYTES`` (256 MiB), or on a CPU when one chunk's would pass
    ``logprobs.MMAP_BYTES``; model-specific kernels and host-resident parts: ``trainer.model.apply_model_options``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        trainer: TrainerConfig | None = None,
        rl: RLConfig | None = None,
        *,
        temperature: float = default("sampling", "temperature"),
        seed: int = default("", "seed"),
        fsdp: bool = False,
    ) -> None:
        """``trainer`` / ``rl``: the ``[trainer]`` and ``[rl]`` sections (their defaults when None);
        ``temperature`` the sampler's (> 0: ``sampling_temperature``); ``fsdp`` shard across the ranks of an
        initialised group."""
        tc = trainer if trainer is not None else TrainerConfig()
        rl = rl if rl is not None else RLConfig()
        torch.manual_seed(seed)
        model.train()
        self.model = model
        self.mtp = _prepare_mtp(model, tc.mtp, tc.freeze)
        if fsdp and tc.mtp == "train":
            raise ConfigError("trainer.mtp = \"train\" is not supported with FSDP (trainer.gpus > 1) yet")
        self.mtp_loss_weight = tc.mtp_loss_weight
        if tc.host_params and fsdp:
            raise ValueError("trainer.host_params is not supported with FSDP (gpus > 1) yet")
        self.model_options = apply_model_options(model, tc)
        self.device = next(model.parameters()).device
        bf16 = _use_bf16(tc.precision, self.device)
        self.lora = self._prepare_lora(tc.lora, fsdp, tc.mtp, bf16)
        self.frozen = self._prepare_model(tc.freeze, tc.activation_checkpointing)
        self.attention = attention_inputs(model, tc.attention)
        self.policy = TokenLogprobs(model, chunk_size=tc.logprob_chunk or None, temperature=temperature,
                                    entropy_grad=bool(rl.entropy_coef))
        self.loss_only = tc.logprob_loss_only
        self.fsdp = fsdp
        if fsdp:
            if not dist.is_distributed():
                raise RuntimeError("fsdp=True needs an initialised process group of >1 ranks (torchrun)")
            dist.shard(self.policy, model, bf16=bf16, offload=tc.offload_optimizer)
        self.grad_scale = float(dist.world_size()) if fsdp else 1.0  # FSDP averages over ranks; we sum
        self.autocast = self._autocast(bf16 and not fsdp)
        # the MTP head's parameters are clipped apart from the policy's, so its loss never rescales them
        mtp_ids = {id(p) for p in self.mtp.parameters()} if self.mtp is not None else set()
        self.params = [p for p in model.parameters() if p.requires_grad and id(p) not in mtp_ids]
        self.mtp_params = [p for p in model.parameters() if p.requires_grad and id(p) in mtp_ids]
        self._hidden: list[Tensor] = []
        if self.mtp_params:
            decoder_of(model).register_forward_hook(self._keep_hidden)
        # under FSDP the optimizer state is offloaded by FSDP's own CPUOffloadPolicy
        self.optimizer = _optimizer(self.params + self.mtp_params, tc.offload_optimizer and not fsdp, tc.lr,
                                    tc.weight_decay)
        self.loss_fn: LossFn = get_loss_fn(rl.loss, **loss_knobs(rl))
        self.regularizers = _regularizers(rl.kl_coef, rl.entropy_coef)
        self.grad_clip = tc.grad_clip
        self.micro_batch_tokens = tc.micro_batch_tokens
        self.version = 0
        self.steps = 0

    @classmethod
    def from_config(cls, model: PreTrainedModel, cfg: RunConfig, *, fsdp: bool = False, lr: float | None = None,
                    lora: bool = True) -> Trainer:
        """The trainer of a run config: its ``[trainer]`` and ``[rl]`` sections, log-probs at the sampling
        temperature (so importance ratios compare like with like), the run's seed; ``lr`` overrides
        ``trainer.lr`` (the warm start's own rate); ``lora=False`` ignores ``[trainer.lora]`` (the warm start
        trains the whole model)."""
        tc = cfg.trainer
        if lr is not None or not lora:
            tc = tc.model_copy(update={"lr": tc.lr if lr is None else lr, "lora": tc.lora if lora else LoRAConfig()})
        return cls(model, tc, cfg.rl, temperature=sampling_temperature(cfg.sampling.temperature), seed=cfg.seed,
                   fsdp=fsdp)

    def _prepare_lora(self, lora: LoRAConfig, fsdp: bool, mtp: str, bf16: bool) -> Any:
        """Inject ``[trainer.lora]``'s adapters (base frozen; ``trainer/lora.py``); the ``peft.LoraConfig``, or
        None for a full fine-tune. Under bf16 autocast the frozen base is stored in bf16 (its matmuls run in bf16
        anyway); the adapters stay fp32 with their fp32 optimizer state."""
        from albatross.trainer.lora import LoRAError, apply_lora

        if not lora.on:
            return None
        if fsdp:
            raise LoRAError("trainer.lora with trainer.gpus > 1 (FSDP2) is not supported yet: use one trainer GPU")
        if mtp == "train":
            raise LoRAError("trainer.lora with trainer.mtp = \"train\" is not supported: use \"frozen\" or \"off\"")
        config = apply_lora(self.model, lora)
        if bf16:
            for p in self.model.parameters():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(torch.bfloat16)
        return config

    def export_view(self) -> nn.Module:
        """What the weight transports send: the model, or with LoRA its merged weights under the base names
        (``lora.MergedView``; one per send)."""
        if self.lora is None:
            return self.model
        from albatross.trainer.lora import MergedView

        return MergedView(self.model, self.lora)

    def parameter_counts(self) -> dict[str, int]:
        """``parameters`` and ``trainable_parameters`` (with gradients and optimizer state)."""
        from albatross.trainer.lora import parameter_counts

        return parameter_counts(self.model)

    def save_adapter(self, directory: str | Path, base_path: str = "") -> Path | None:
        """Write the LoRA adapter in PEFT's format to ``directory`` (None without LoRA)."""
        if self.lora is None:
            return None
        from albatross.trainer.lora import save_adapter

        return save_adapter(self.model, self.lora, directory, base_path)

    def _prepare_model(self, patterns: Sequence[str], checkpointing: bool) -> list[str]:
        frozen = freeze(self.model, patterns) if patterns else []
        if checkpointing:
            enable_activation_checkpointing(self.model)
        return frozen

    def _autocast(self, bf16: bool) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        if not bf16:
            return contextlib.nullcontext
        return functools.partial(torch.autocast, self.device.type, dtype=torch.bfloat16)

    # forward -------------------------------------------------------------------------------------
    def _scored(self, mb: MicroBatch) -> dict[str, Tensor]:
        """``logprob_loss_only``: the LM head runs at the micro-batch's loss tokens only (every loss, metric
        and regulariser reads log-probs through ``loss_mask``)."""
        return {"score_mask": mb.loss_mask.to(self.device) > 0} if self.loss_only else {}

    def forward_logprobs(self, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        """Trainer log-probs (with grad) and entropies of a micro-batch's targets, [T] each (0 off the loss
        tokens with ``logprob_loss_only``)."""
        d = self.device
        attn = self.attention(mb, torch.float32, d)
        with self.autocast():
            out: tuple[Tensor, Tensor] = self.policy(mb.input_ids.to(d), mb.position_ids.to(d), mb.targets.to(d),
                                                     **attn, **self._scored(mb))
        return out

    # gradients -----------------------------------------------------------------------------------
    def _keep_hidden(self, module: nn.Module, args: Any, output: Any) -> None:
        """Decoder forward hook (``trainer.mtp = "train"``): keep the final hidden states for the MTP loss."""
        # a transformers model output, or the plain tuple of a decoder returning one
        self._hidden[:] = [output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]]

    def _mtp_loss(self, head: Mtp, mb: MicroBatch, n_batch: int) -> tuple[Tensor, dict[str, float]]:
        """The MTP head's auxiliary loss on the micro-batch's DETACHED hidden states (``models/mtp.py``)."""
        from albatross.models.mtp import mtp_loss

        hidden, self._hidden[:] = self._hidden[0], []
        with self.autocast():
            loss, metrics = mtp_loss(head, hidden, mb.input_ids.to(self.device), list(mb.seq_lens),
                                     mb.loss_mask.to(self.device), n_batch)
        return self.mtp_loss_weight * loss, metrics

    def live_mismatch_kl(self, mb: MicroBatch) -> float:
        """Routing replay's counterfactual: the mismatch KL of ``mb``'s loss tokens with live routing and indexer
        selections (a no-grad forward without the recorded ones). Run before the micro-batch's own forward, so
        what that forward leaves for its backward (forced routing, hidden states) is its own."""
        d = self.device
        attn = {k: v for k, v in self.attention(mb, torch.float32, d).items() if k != "routing"}
        with torch.no_grad(), self.autocast():
            logprobs, _ = self.policy(mb.input_ids.to(d), mb.position_ids.to(d), mb.targets.to(d), **attn,
                                      **self._scored(mb))
        return mismatch_kl(logprobs - mb.logprobs.to(d), mb.loss_mask.to(d))

    def _micro_step(self, mb: MicroBatch, loss_of: LossOf, n_batch: int, live_kl: bool = False) -> dict[str, float]:
        no_replay = self.live_mismatch_kl(mb) if live_kl else None
        logprobs, entropy = self.forward_logprobs(mb)
        loss, metrics = loss_of(mb, logprobs, entropy, n_batch)
        for reg in self.regularizers:
            extra, m = reg(mb, logprobs, entropy, n_batch)
            loss = loss + extra
            metrics.update(m)
        if self.mtp_params and self.mtp is not None:
            extra, m = self._mtp_loss(self.mtp, mb, n_batch)
            loss = loss + extra
            metrics.update(m)
        torch.autograd.backward(loss * self.grad_scale)
        mask = mb.loss_mask.to(entropy.device)
        tokens = float(mask.sum())
        metrics["entropy"] = float((entropy.detach() * mask).sum()) / tokens if tokens else 0.0
        if no_replay is not None:
            metrics["mismatch_kl_no_replay"] = no_replay
        return metrics

    def accumulate(self, micro_batches: Sequence[MicroBatch], loss_of: LossOf,
                   live_kl: bool = False) -> dict[str, float]:
        """Zero grads, then forward/backward this rank's micro-batches, each normalised by the batch's tokens.

        ``live_kl``: also log ``mismatch_kl_no_replay`` (every micro-batch, so FSDP ranks stay in step)."""
        self.optimizer.zero_grad(set_to_none=True)
        n_batch = sum(mb.num_loss_tokens for mb in micro_batches)
        mine = dist.assign(micro_batches, dist.world_size(), dist.rank())
        parts = []
        for mb in mine:
            metrics = self._micro_step(mb or padding_micro_batch(), loss_of, n_batch, live_kl)
            if mb is not None:
                parts.append(metrics)
        parts = [p for rank_parts in dist.gather(parts) for p in rank_parts]
        return merge_metrics(parts) if parts else {"loss": 0.0, "tokens": 0.0}

    def rl_gradients(self, batch: Batch, current_version: int) -> dict[str, float]:
        """Accumulate the RL loss gradient of ``batch`` into ``.grad`` (no optimizer step)."""

        def loss_of(mb: MicroBatch, logprobs: Tensor, entropy: Tensor, n: int) -> tuple[Tensor, dict[str, float]]:
            d = logprobs.device
            return self.loss_fn(logprobs, mb.logprobs.to(d), mb.advantages.to(d), mb.loss_mask.to(d),
                                mb.versions.to(d), current_version=current_version, num_batch_tokens=n)

        micro_batches = pack(batch.samples, self.micro_batch_tokens)
        replayed = any(mb.routing is not None for mb in micro_batches)  # routing replay: KL without it too
        return self.accumulate(micro_batches, loss_of, live_kl=replayed)

    def _apply(self, metrics: dict[str, float], t0: float, tokens: int) -> dict[str, float]:
        """Clip, step the optimizer, and add the step-level metrics."""
        grad_norm = dist.full_tensor(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        if self.mtp_params:
            torch.nn.utils.clip_grad_norm_(self.mtp_params, self.grad_clip)
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

        def loss_of(mb: MicroBatch, logprobs: Tensor, entropy: Tensor, n: int) -> tuple[Tensor, dict[str, float]]:
            return sft_loss(logprobs, mb.loss_mask.to(logprobs.device), num_batch_tokens=n)

        micro = pack([TrainSample(sample=s, advantage=0.0) for s in samples], self.micro_batch_tokens)
        metrics = self.accumulate(micro, loss_of)
        return self._apply(metrics, t0, sum(len(s.token_ids) for s in samples))

    # resume --------------------------------------------------------------------------------------
    def save(self, path: str | Path, dtype: str = "float32", background: bool = False,
             private: bool = False) -> Future[int]:
        """Model (in ``dtype``), optimizer, step, version and every rank's RNG state (every rank must call it);
        ``background``: written from a thread after a copy to host memory; ``private``: ``path`` is each rank's own
        (``checkpoint.save_state``). A future of the bytes written."""
        extra = {"version": self.version, "rng": dist.gather(rng_state())}
        return save_state(path, self.model, self.optimizer, self.steps, extra, dtype=dtype, background=background,
                          private=private)

    def load(self, path: str | Path) -> None:
        """Restore what ``save`` wrote, so the next steps repeat those of the uninterrupted run."""
        self.steps, extra = load_state(path, self.model, self.optimizer)
        self.version = int(extra.get("version", 0))
        states = extra.get("rng") or []
        if states:
            set_rng_state(states[dist.rank() % len(states)])
