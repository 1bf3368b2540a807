"""Model loading (a local transformers checkpoint, never a hub), freezing and activation checkpointing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albatross.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel, Qwen2ForCausalLM

    from albatross.config import TrainerConfig
    from albatross.models import CausalLM


def load_model(directory: str | Path, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Load a causal LM from a local directory (never from a hub); ``glm5_next`` loads as its VLM.

    A checkpoint with multi-token-prediction weights gets its MTP head as ``model.mtp`` (``models/mtp.py``)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json: not a model directory")
    if _model_type(path) == "glm5_next":  # ships only as a vision-language model (load_any reads its MTP head)
        from albatross.models.tiny import load_any

        vlm: PreTrainedModel = load_any(path, dtype)
        return vlm
    from albatross.models.mtp import load_mtp

    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    load_mtp(model, path, required=False)  # transformers drops MTP weights; ``trainer.mtp`` decides their use
    return model


def to_device(model: PreTrainedModel, device: str | torch.device) -> PreTrainedModel:
    """``model.to(device)``, typed: transformers wraps ``to`` with ``functools.wraps(nn.Module.to)``, which type
    checkers read as a plain function taking the module first."""
    moved: PreTrainedModel = model.to(device)  # type: ignore[arg-type]  # transformers: see above
    return moved


def _model_type(path: Path) -> str | None:
    """``model_type`` of ``path/config.json``; None when unreadable (transformers then reports it)."""
    import json

    try:
        value = json.loads((path / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError, OSError):
        return None
    return value if isinstance(value, str) else None


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def freeze(model: CausalLM, patterns: Sequence[str]) -> list[str]:
    """Freeze the parameters that ``patterns`` select; return the frozen names.

    Each entry is a part name (``first_layers:N``, ``ngram``, ``indexer``, ``mtp``, ``vision``, ``router``;
    ``albatross.models.parts``) or a glob over ``model.named_parameters()`` names (``model.layers.0.*``).
    Frozen parameters get no gradient and the trainer leaves them out of the optimizer. An entry that
    matches nothing is an error, so a typo cannot silently train everything.
    """
    from albatross.models.parts import resolve_freeze

    frozen = resolve_freeze(model, patterns)
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    return frozen


class ModelOptionError(UserError, ValueError):
    """A model-specific trainer option the model cannot use (a user error: one line, exit code 2)."""


HOST_PARTS = ("ngram",)


def keep_on_host(model: CausalLM, parts: Sequence[str]) -> int:
    """Move the parameters of the named ``parts`` (``ngram``) to host memory; returns their bytes.

    transformers' n-gram embedding already gathers its rows on the device its table lives on and moves
    the result to the ids' device, so a table on the host is read there and only the gathered rows
    (and, in the backward, their gradients) cross to the accelerator: no device copy of the table, its
    gradient or its optimizer state. On a CPU run host and device are one, so this changes nothing.
    """
    from albatross.models.parts import PARTS

    modules: list[nn.Module] = []
    for part in parts:
        if part not in HOST_PARTS:
            raise ModelOptionError(f"trainer.host_params: {part!r}: expected one of {list(HOST_PARTS)}")
        found = [m for name, m in model.named_modules() if name and PARTS[part](name, m)]
        if not found:
            raise ModelOptionError(f"trainer.host_params: {part!r}: this {type(model).__name__} has no {part} "
                                   "parameters")
        modules += found
    for module in modules:
        module.to("cpu")
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def apply_model_options(model: CausalLM, trainer: TrainerConfig) -> dict[str, int]:
    """Install the model-specific kernels the ``[trainer]`` options ask for; returns what each touched.

    ``grouped_experts`` (``models/experts.py``), ``fast_indexer`` (``models/indexer.py``, QSA), ``fused_hyper``
    (``models/hyper.py``), ``host_params`` (``keep_on_host``). Each is exact (same log-probs and gradients
    to fp32 rounding) and off by default; one the model has nothing for is an error, not a silent no-op.
    Run before ``prepare_for_packing`` (``TokenLogprobs``), which leaves the layers installed here alone.
    """
    from albatross.models.experts import install_grouped_experts
    from albatross.models.hyper import install_fused_hyper
    from albatross.models.indexer import install_fast_indexer

    done: dict[str, int] = {}
    for option, wanted, install, what in (
        ("grouped_experts", trainer.grouped_experts, install_grouped_experts, "MoE experts"),
        ("fast_indexer", trainer.fast_indexer, install_fast_indexer, "QSA indexed attention (qwen4_exp)"),
        ("fused_hyper", trainer.fused_hyper, install_fused_hyper, "qwen4_exp hyper-connections"),
    ):
        if wanted:
            done[option] = install(model)
            if not done[option]:
                raise ModelOptionError(f"trainer.{option}: this {type(model).__name__} has no {what}")
    if trainer.host_params:
        done["host_param_bytes"] = keep_on_host(model, trainer.host_params)
    return done


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward instead of storing them.

    Uses transformers' own per-layer checkpointing (non-reentrant), so parameter names do not change. The
    hook transformers adds with it to make the embedding output require a gradient (``enable_input_require_grads``,
    which reentrant checkpointing and PEFT need) is removed: non-reentrant checkpointing reaches parameters
    without it, and with it a frozen bottom (``embed`` and ``first_layers:N`` frozen) would still run its
    backward (and its recomputation) for nothing.
    """
    # transformers' own attributes; the two method names differ between its versions
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(  # type: ignore[no-untyped-call]  # transformers: unannotated
            gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()  # type: ignore[no-untyped-call]  # transformers: unannotated


def decoder_of(model: PreTrainedModel) -> nn.Module:
    """The decoder stack of a transformers causal LM (its ``get_decoder()``)."""
    decoder: nn.Module = model.get_decoder()  # type: ignore[no-untyped-call]  # transformers: unannotated
    return decoder


def tiny_causal_lm(vocab_size: int = 300, hidden_size: int = 64, num_layers: int = 2, *, attn: str = "sdpa",
                   seed: int = 0, **overrides: Any) -> Qwen2ForCausalLM:
    """A small random Qwen2 causal LM built from a config, for tests and benchmarks (nothing downloaded).

    Heads of 32 dimensions (2 key/value heads), MLP twice the hidden size, tied embeddings; ``overrides``
    go to ``Qwen2Config`` (e.g. ``attention_dropout``).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(hidden_size // 32, 1)
    fields = {"vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
              "num_hidden_layers": num_layers, "num_attention_heads": heads,
              "num_key_value_heads": max(heads // 2, 1), "max_position_embeddings": 1 << 20,
              "tie_word_embeddings": True, "attn_implementation": attn, **overrides}
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**fields))
