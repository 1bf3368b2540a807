"""The model of a run: ``model.path`` checked and loaded, or the demo recipe's tiny model; what the summary
says about it. A directory that cannot serve as a policy is a ``UserError`` naming it and what is wrong."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from albatross.errors import UserError

WEIGHT_GLOBS = ("*.safetensors", "*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                   "albatross_tokenizer.json", "generation_config.json")


@dataclass
class ModelInfo:
    """What ``summary.json`` says about the model: the directory given, its architecture and size."""

    path: str
    architecture: str
    parameters: int

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "architecture": self.architecture, "parameters": self.parameters}


def check_model_dir(path: str | Path, action_format: str = "auto") -> Any:
    """Check that ``path`` is a causal LM a run can train and serve; return its tokenizer.

    Raises ``UserError`` (one line: the directory and what is wrong) for a missing directory, no or unreadable
    config.json, a model type transformers has no causal LM for, no weights, a tokenizer that does not load,
    no chat template, or a template whose rendering is not what the harness appends turn by turn."""
    d = Path(path)
    if not d.is_dir():
        raise UserError(f"model.path {str(path)!r}: no such directory")
    _check_config(d)
    if not any(next(d.glob(g), None) for g in WEIGHT_GLOBS):
        raise UserError(f"model.path {d}: no weights (*.safetensors or *.bin)")
    tokenizer = load_model_tokenizer(d)
    check_template(tokenizer, d, action_format)
    return tokenizer


def _check_config(d: Path) -> None:
    if not (d / "config.json").is_file():
        raise UserError(f"model.path {d}: no config.json (not a transformers model directory)")
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad config
        raise UserError(f"model.path {d}/config.json: transformers cannot read it: {_first_line(e)}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"model.path {d}: model_type {config.model_type!r} has no causal LM in this transformers")


def load_model_tokenizer(d: str | Path) -> Any:
    """The tokenizer of a model directory (local files only); ``UserError`` when it has none that loads."""
    from albatross.engine.tokenizer import load_tokenizer

    try:
        return load_tokenizer(d)
    except Exception as e:  # FileNotFoundError, OSError, ValueError from tokenizers...
        raise UserError(f"model.path {d}: its tokenizer does not load: {_first_line(e)}") from None


def check_template(tokenizer: Any, d: Path, action_format: str = "auto") -> None:
    """The tokenizer has a chat template the harness can drive turn by turn (``harness/hf_chat.py``), with
    observations in the role that ``harness.action_format`` gives them."""
    from albatross.harness.hf_chat import check_chat_template

    role = {"tool_calls": "tool", "bash_block": "user"}.get(action_format)
    try:
        check_chat_template(tokenizer, d, observation_role=role)
    except ValueError as e:
        raise UserError(f"model.path {_first_line(e)}") from None


def describe(path: str, directory: str | Path) -> ModelInfo:
    """Architecture (config.json ``architectures``) and parameter count (from the safetensors headers, so
    nothing is loaded)."""
    d = Path(directory)
    config = json.loads((d / "config.json").read_text())
    arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
    return ModelInfo(path=path, architecture=arch, parameters=_count_parameters(d))


def _count_parameters(d: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                shape = st.get_slice(key).get_shape()
                n = 1
                for s in shape:
                    n *= s
                total += n
    return total


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    """Put the tokenizer (and chat template) of model directory ``src`` beside exported weights in ``dst``,
    so that ``dst`` loads as a whole model with transformers."""
    import shutil

    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)


def write_generation_config(src: str | Path, dst: str | Path, tokenizer: Any) -> None:
    """``dst/generation_config.json``: ``src``'s own (else one made from ``dst``'s config) whose ``eos_token_id`` also
    holds the token that ends an assistant turn in the chat template, so that ``generate`` stops where the
    harness stops a turn."""
    from transformers import AutoConfig, GenerationConfig

    from albatross.engine.tokenizer import stop_token_id

    try:
        gen = GenerationConfig.from_pretrained(str(src))
    except OSError:
        gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(dst)))
    eos = gen.eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    end = stop_token_id(tokenizer)
    gen.eos_token_id = [end, *[i for i in ids if i != end]] if end is not None else (ids or None)
    gen.save_pretrained(str(dst))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (read at call time, so a changed environment counts)."""
    import os

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_model_path(path: str, log: Any = None) -> Path:
    """The directory of ``model.path``: the directory itself, or the snapshot of a Hugging Face id in the local
    cache, downloaded first where the hub is reachable (not with ``HF_HUB_OFFLINE=1``). A missing model is one
    ``UserError`` line saying where it looked."""
    import os

    from albatross.config import is_hub_id

    if Path(path).expanduser().is_dir() or not is_hub_id(path):
        return Path(path).expanduser()
    cache = hub_cache_dir()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, cache_dir=str(cache), local_files_only=True))
    except Exception:  # not cached (huggingface_hub raises several types)
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("", "0", "false", "no"):
        reason = "HF_HUB_OFFLINE is set"
    else:
        if log is not None:
            log(f"[model] {path}: not in the Hugging Face cache {cache}; downloading from the hub")
        try:
            return Path(snapshot_download(path, cache_dir=str(cache)))
        except Exception as e:  # unreachable hub, unknown id, gated model
            reason = f"not downloaded: {_first_line(e)[:160]}"
    where = cache / ("models--" + path.replace("/", "--"))
    raise UserError(f"model.path {path!r}: not a directory, and not in the Hugging Face cache (looked in {where}; "
                    f"{reason})")
