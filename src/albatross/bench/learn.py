"""Learning sanity: every loss and advantage variant learns a task family from the reward alone.

The family has a known optimal policy: the prompt names one of ``KEYS`` and asks for its word; each key has one
right answer among ``ANSWERS`` (a fixed table). A tiny model is warm-started by SFT on answers drawn uniformly
from ``ANSWERS``, so it names an answer word but the right one only by chance (Pass@1 about 1 / 6). Each row then
trains that model from the reward alone with the real parts of a training run: the built-in engine samples groups
at ``--temperature``, ``rl.scoring.GroupScorer`` scores them (advantages, zero-signal drop),
``orchestrator.buffer.make_batch`` builds the batch and ``trainer.step.Trainer`` (built by ``from_config``, so it
scores tokens at the sampling temperature) takes the step; the new weights go into the engine before the next
groups are sampled (on-policy, version by version).

``lora/tis/grpo`` trains LoRA adapters instead (rank ``LORA_RANK`` on ``LORA_TARGETS``, the base frozen) and
sends each version to the engine as a run does (``serve = "adapter"``: the adapter in PEFT's format, which the
engine merges into the base it holds). Its targets include the output layer (``lm_head``, tied to the
embedding here): without it no LoRA can learn this family. The final RMSNorm fixes the norm of the last hidden
state and its gain is frozen, so with a frozen output embedding the largest probability any hidden state can give
a word at temperature 0.8 is bounded by the embedding's geometry, which the short warm start leaves small
(0.36-0.43 for seed 0's words): adapters on attention and MLP alone learn each key's word as the argmax (greedy
Pass@1 1.0) but end at about 0.41 sampled.

A row learns when its pass rate (sampled at the training temperature, over fresh prompts) ends at or above
``LEARNED`` (0.8). ``all_on_policy`` checks the importance ratio: the largest per-step mismatch KL between the
engine's and the trainer's log-probs of the same tokens at equal weights stays under ``ON_POLICY_KL`` (a trainer
scoring tokens at another temperature than the sampler's shows here). The JSON's keys: ``rows`` (``name``,
``loss``, ``advantage``, ``start_pass``, ``end_pass``, ``steps``, ``seconds``, ``mismatch_kl``, ``lora``: null, or
the adapters' ``rank``, ``target_modules``, ``parameters`` and ``trainable_parameters``), ``all_learn``
(every row ends >= 0.8), ``all_on_policy``.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any, NamedTuple

from albatross.bench.common import print_table, write_json

ANSWERS = ("apple", "mango", "kiwi", "lemon", "grape", "peach")
KEYS = ("salt", "pepper")  # key i's right answer: ANSWERS[i]
LEARNED = 0.8
ON_POLICY_KL = 1e-3
LORA_RANK = 8
LORA_TARGETS = ("attention", "mlp", "lm_head")  # the output layer too: without it the row cannot learn (module doc)


class Row(NamedTuple):
    """One row: a loss and an advantage, trained in full or (``lora``) as LoRA adapters served as a run serves
    them."""

    loss: str
    advantage: str
    lora: bool = False

    @property
    def name(self) -> str:
        return f"{'lora/' if self.lora else ''}{self.loss}/{self.advantage}"

    def overrides(self) -> tuple[str, ...]:
        """The run-config overrides of the row beyond the loss and advantage."""
        if not self.lora:
            return ()
        targets = ", ".join(f'"{t}"' for t in LORA_TARGETS)
        return (f"trainer.lora.rank={LORA_RANK}", f"trainer.lora.target_modules=[{targets}]",
                "trainer.lora.serve=adapter")


ROWS: tuple[Row, ...] = (
    Row("tis", "grpo"), Row("ppo_clip", "grpo"), Row("masked_is", "grpo"), Row("cispo", "grpo"), Row("tis", "rloo"),
    Row("tis", "topk"), Row("tis", "grpo", lora=True),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer steps per row (the CI test)")
    p.add_argument("--steps", type=int, default=0, help="RL steps per row (default: 60, quick 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the prompts and the sampler")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="RL learning rate (default %(default)s)")


def task(rng: random.Random) -> tuple[str, str]:
    """One instance: (instruction, answer)."""
    i = rng.randrange(len(KEYS))
    return f"Say the word for {KEYS[i]}.", ANSWERS[i]


def decoy(instruction: str) -> str:
    """The warm start's answer for an instruction's key: another key's right answer."""
    i = next(j for j, key in enumerate(KEYS) if f" {key}." in instruction)
    return ANSWERS[i + len(KEYS)]


class Workload:
    """The family's tokenizer, tiny model, prompts and verifier."""

    def __init__(self, seed: int) -> None:
        from albatross.config import ModelConfig
        from albatross.engine.tokenizer import BARE_WORD_PATTERN, tiny_hf_tokenizer
        from albatross.pipeline.demo import build_tiny
        vocab = [*ANSWERS, *KEYS, "Say", "the", "word", "for"]
        self.tokenizer = tiny_hf_tokenizer(vocab, word_pattern=BARE_WORD_PATTERN)
        self.end = self.tokenizer.convert_tokens_to_ids("<|end|>")
        size = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192,
                           max_positions=64)
        self.model = build_tiny(size, self.tokenizer, seed=seed)

    def prompt(self, instruction: str) -> list[int]:
        out = self.tokenizer.apply_chat_template([{"role": "user", "content": instruction}], tokenize=True,
                                                 add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)  # transformers 5: a BatchEncoding

    def correct(self, completion_ids: list[int], answer: str) -> bool:
        ids = [i for i in completion_ids if i != self.end]
        return bool(self.tokenizer.decode(ids).strip() == answer)


def warm_start(work: Workload, rng: random.Random, steps: int = 80) -> None:
    """SFT where half the answers are a decoy table's (each key's answer is another key's) and half are drawn
    uniformly from ``ANSWERS``: the model learns to read the key and to name an answer word, but the right one
    only by chance (about 1 / 12)."""
    from albatross.config import RunConfig
    from albatross.records import Sample
    from albatross.trainer.step import Trainer

    trainer = Trainer.from_config(work.model, RunConfig(), lr=3e-3)
    for _ in range(steps):
        batch = []
        for _ in range(32):
            instruction = task(rng)[0]
            prompt = work.prompt(instruction)
            word = decoy(instruction) if rng.random() < 0.5 else rng.choice(ANSWERS)
            answer = work.tokenizer.encode(word, add_special_tokens=False) + [work.end]
            sample = Sample(list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt))
            sample.extend(answer, model=True, logprobs=[0.0] * len(answer), versions=[0] * len(answer))
            batch.append(sample)
        trainer.sft_step(batch)
    work.model.train(False)  # eval mode


def sample(engine: Any, work: Workload, prompts: list[list[int]], temperature: float, rng: random.Random) -> list[Any]:
    """One completion per prompt, each with its own seed from ``rng`` (reproducible runs)."""
    from dataclasses import replace

    from albatross.engine.base import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=4, stop_token_ids=[work.end])
    futures = [engine.submit(p, replace(params, seed=rng.randrange(1 << 62))) for p in prompts]
    return [f.result() for f in futures]


def pass_rate(engine: Any, work: Workload, temperature: float, seed: int, n: int = 256) -> float:
    """Pass rate over ``n`` fresh prompts, sampled at ``temperature``."""
    rng = random.Random(seed)
    tasks = [task(rng) for _ in range(n)]
    done = sample(engine, work, [work.prompt(i) for i, _ in tasks], temperature, rng)
    return sum(work.correct(c.token_ids, a) for c, (_, a) in zip(done, tasks, strict=True)) / n


def rollout_groups(engine: Any, work: Workload, rng: random.Random, cfg: Any, n_groups: int) -> list[Any]:
    """``n_groups`` groups of ``orchestrator.group_size`` sampled answers, as trajectories ready to be scored."""
    from albatross.records import Group, Reward, Sample, Trajectory

    tasks = [task(rng) for _ in range(n_groups)]
    size = cfg.orchestrator.group_size
    prompts = [work.prompt(instruction) for instruction, _ in tasks]
    done = sample(engine, work, [p for p in prompts for _ in range(size)], cfg.sampling.temperature, rng)
    groups = []
    for g, ((_, answer), prompt) in enumerate(zip(tasks, prompts, strict=True)):
        trajs = []
        for i, c in enumerate(done[g * size:(g + 1) * size]):
            sample_ = Sample(list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt))
            sample_.extend(c.token_ids, model=True, logprobs=c.logprobs, versions=c.versions)
            ok = work.correct(c.token_ids, answer)
            trajs.append(Trajectory(task_id=f"pick-{g}", group_id=str(g), attempt=i, samples=[sample_],
                                    reward=Reward(metrics={"answer": float(ok)}, success=ok),
                                    completion_tokens=len(c.token_ids)))
        groups.append(Group(f"pick-{g}", str(g), trajs))
    return groups


def run_row(row: Row, args: argparse.Namespace, base: Any, steps: int) -> dict[str, Any]:
    """Train a copy of the warm-started model with the row's loss and advantage (in full, or its LoRA adapters);
    the row's figures. With LoRA each version goes to the engine as a run sends it: the adapter in PEFT's
    format, merged by the engine into the base it holds."""
    import copy
    import tempfile

    from albatross.config import load_config
    from albatross.engine.builtin import BuiltinEngine
    from albatross.orchestrator.buffer import make_batch
    from albatross.rl.scoring import GroupScorer
    from albatross.trainer.step import Trainer

    cfg = load_config(None, [f"rl.loss={row.loss}", f"rl.advantage={row.advantage}",
                             f"sampling.temperature={args.temperature}", f"trainer.lr={args.lr}",
                             "orchestrator.group_size=8", "rl.efficiency_lambda=0", "rl.credit=divergence",
                             f"seed={args.seed}", *row.overrides()])
    work = copy.copy(base)
    work.model = copy.deepcopy(base.model)
    rng = random.Random(args.seed + 1)
    t0 = time.monotonic()
    engine_model = copy.deepcopy(work.model).eval()  # before LoRA goes into the trainer's copy
    trainer = Trainer.from_config(work.model.train(), cfg)
    scorer = GroupScorer(cfg.rl)
    kls: list[float] = []
    with BuiltinEngine(engine_model, max_batch_size=128) as engine, tempfile.TemporaryDirectory() as tmp:
        send = _sender(cfg, engine, tmp)
        start = pass_rate(engine, work, args.temperature, args.seed + 2)
        for _ in range(steps):
            groups = [scorer.score_group(g) for g in rollout_groups(engine, work, rng, cfg, 8)]
            kept = [g for g in groups if not g.dropped]
            if not kept:
                continue
            kls.append(trainer.step(make_batch(kept, cfg.rl.credit))["mismatch_kl"])
            send(trainer)
        end = pass_rate(engine, work, args.temperature, args.seed + 2)
    lora = cfg.trainer.lora
    return {"name": row.name, "loss": row.loss, "advantage": row.advantage, "start_pass": round(start, 4),
            "end_pass": round(end, 4), "steps": steps, "seconds": round(time.monotonic() - t0, 1),
            "mismatch_kl": round(max(kls), 6) if kls else 0.0,
            "lora": {"rank": lora.r, "target_modules": list(lora.target_modules), **trainer.parameter_counts()}
            if lora.on else None}


def _sender(cfg: Any, engine: Any, tmp: str) -> Any:
    """How each version reaches the engine: the state dict (a full fine-tune), or with ``[trainer.lora]`` what a
    run sends (``serve = "adapter"``: the adapter in PEFT's format, which the engine merges into its base)."""
    from albatross.trainer.weights.filesystem import AdapterSender

    if cfg.trainer.lora.sends_adapter:
        sender = AdapterSender(tmp)
        return lambda trainer: engine.update_weights(sender.send(trainer.export_view(), trainer.version),
                                                     trainer.version)

    def state(trainer: Any) -> None:
        view = trainer.export_view()  # merged weights under the base names with serve = "merged"
        weights = {k: v.detach().clone() for k, v in view.state_dict().items()}
        engine.update_weights_from_state_dict(weights, trainer.version)
    return state


def measure(args: argparse.Namespace, rows: tuple[tuple[str, str] | tuple[str, str, bool], ...] = ROWS,
            base: Workload | None = None) -> dict[str, Any]:
    """Warm-start the family's model (unless ``base`` is given), then train one copy per row."""
    import torch

    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and several crawl on a loaded machine
    torch.manual_seed(args.seed)
    steps = args.steps or (30 if args.quick else 60)
    if base is None:
        base = Workload(args.seed)
        warm_start(base, random.Random(args.seed))
    out = []
    for spec in rows:
        row = run_row(Row(*spec), args, base, steps)
        print(f"[learn] {row['name']:<20} pass {row['start_pass']:.2f} -> {row['end_pass']:.2f}  "
              f"({row['steps']} steps, {row['seconds']:.0f}s, max on-policy KL {row['mismatch_kl']:.1e})", flush=True)
        out.append(row)
    return {"rows": out, "all_learn": all(r["end_pass"] >= LEARNED for r in out),
            "all_on_policy": all(r["mismatch_kl"] <= ON_POLICY_KL for r in out), "quick": bool(args.quick),
            "temperature": args.temperature, "lr": args.lr, "seed": args.seed}


def run(args: argparse.Namespace) -> None:
    data = measure(args)
    table = [(r["name"], f"{r['start_pass']:.2f} -> {r['end_pass']:.2f} in {r['steps']} steps, {r['seconds']:.0f}s")
             for r in data["rows"]]
    print_table("albatross bench learn: pass rate from the reward alone (start -> end)",
                [*table, ("all_learn", data["all_learn"]), ("all_on_policy", data["all_on_policy"])])
    write_json(args.json, data)
