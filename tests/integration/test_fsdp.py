"""FSDP2 on CPU: two gloo ranks under torchrun train like one process.

About 20 s on an idle 2-core machine, most of it three processes importing torch and transformers.
The test runs this file as the torchrun worker script (``--worker OUT``); each rank builds the same
tiny model and batch, trains two steps with ``fsdp=True``, exports weights, saves state, and rank 0
writes what it saw. The single-process reference runs in the test itself.
"""

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import torch

from albatross.config import TrainerConfig
from albatross.records import Batch, Sample, TrainSample
from albatross.trainer.checkpoint import load_weights
from albatross.trainer.model import tiny_causal_lm
from albatross.trainer.step import Trainer

VOCAB = 300
TOL = {"atol": 1e-5, "rtol": 1e-5}


def make_batch(seed: int) -> Batch:
    rng = random.Random(seed)
    samples = []
    for n in (21, 14, 9, 17, 6):  # five samples, micro-batch budget 24: three micro-batches for 2 ranks
        mask = [0] * 4 + [1] * (n - 4)
        sample = Sample([rng.randrange(VOCAB) for _ in range(n)], mask,
                        [-rng.uniform(4.0, 7.0) if m else 0.0 for m in mask], [0 if m else -1 for m in mask])
        samples.append(TrainSample(sample, rng.uniform(-1.0, 1.0)))
    return Batch(samples=samples, groups=2, min_version=0)


def make_trainer(fsdp: bool, **knobs) -> Trainer:
    # model_construct: a 24-token budget, below [trainer]'s floor of 64, so the tiny batch packs into 3 rows
    section = TrainerConfig.model_construct(lr=1e-3, weight_decay=0.01, micro_batch_tokens=24, **knobs)
    return Trainer(tiny_causal_lm(VOCAB, 64, 2, seed=3), section, fsdp=fsdp, seed=3)


def worker(out: Path) -> None:
    from albatross.trainer.distributed import init_distributed

    rank, world = init_distributed("gloo")
    trainer = make_trainer(fsdp=True)
    local = {n: p.to_local().numel() for n, p in trainer.model.named_parameters()}
    m1 = trainer.step(make_batch(0), current_version=0)
    trainer.save(out / "state.pt")
    m2 = trainer.step(make_batch(1), current_version=1)
    trainer.load(out / "state.pt")
    again = trainer.step(make_batch(1), current_version=1)
    from albatross.trainer.checkpoint import export_weights

    export_weights(trainer.model, out / "weights", 2)
    ckpt = make_trainer(fsdp=True, activation_checkpointing=True).step(make_batch(0), current_version=0)
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"world": world, "losses": [m1["loss"], m2["loss"]],
                                                     "again": again["loss"], "tokens": m1["tokens"],
                                                     "grad_norm": m1["grad_norm"], "local": local,
                                                     "checkpointed": ckpt["loss"]}))
    torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_match_a_single_process(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", __file__, "--worker", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "result.json").read_text())

    single = make_trainer(fsdp=False)
    m1, m2 = single.step(make_batch(0), current_version=0), single.step(make_batch(1), current_version=1)
    assert got["world"] == 2
    assert got["tokens"] == m1["tokens"]
    for a, b in zip(got["losses"], [m1["loss"], m2["loss"]], strict=True):
        assert abs(a - b) < 1e-5
    assert abs(got["again"] - got["losses"][1]) < 1e-6  # resumed from the saved state under FSDP
    assert abs(got["checkpointed"] - m1["loss"]) < 1e-5  # FSDP with activation checkpointing
    assert abs(got["grad_norm"] - m1["grad_norm"]) < 1e-4
    full = {n: p.numel() for n, p in single.model.named_parameters()}
    assert all(got["local"][n] < full[n] for n in full if full[n] > 1)  # really sharded
    exported = tiny_causal_lm(VOCAB, 64, 2, seed=9)
    load_weights(exported, tmp_path / "weights" / "v000002")
    for (name, a), (_, b) in zip(single.model.named_parameters(), exported.named_parameters(), strict=True):
        torch.testing.assert_close(b, a.detach(), **TOL, msg=name)


if __name__ == "__main__" and "--worker" in sys.argv:
    worker(Path(sys.argv[sys.argv.index("--worker") + 1]))


def _worker_losses(tmp_path: Path, gpus: int) -> list[float]:
    """Losses of two steps through `trainer_main`, the trainer process `albatross train` starts: with
    `trainer.gpus = 2` it launches rank 1 itself and shards with FSDP2 over gloo."""
    import multiprocessing as mp

    from albatross.config import load_config

    model = tmp_path / "model"
    tiny_causal_lm(VOCAB, 64, 2, seed=3).save_pretrained(model)
    run = tmp_path / f"run{gpus}"
    cfg = load_config(None, ["trainer.lr=1e-3", "trainer.weight_decay=0.01", "trainer.micro_batch_tokens=64",
                             f"trainer.gpus={gpus}", "seed=3", "rl.n_floor=1", "rl.p_floor=0.0001"])
    ctx = mp.get_context("spawn")
    batch_q, result_q = ctx.Queue(), ctx.Queue()
    from albatross.orchestrator.trainer_worker import trainer_main

    proc = ctx.Process(target=trainer_main, args=(str(model), str(run), cfg.model_dump_json(), batch_q, result_q,
                                                  0, ""))
    proc.start()
    try:
        ready = result_q.get(timeout=240)
        assert "error" not in ready, ready.get("error")
        losses = []
        for seed in (0, 1):
            batch_q.put(make_batch(seed))
            msg = result_q.get(timeout=240)
            assert "error" not in msg, msg.get("error")
            losses.append(msg["loss"])
        batch_q.put(None)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert proc.exitcode == 0
    if gpus > 1:
        assert ready["device"].endswith("x 2 ranks")
        assert (run / "logs" / "trainer-rank1.log").is_file()
    assert (run / "weights" / "v000002").is_dir()
    return losses


def test_the_trainer_process_of_a_run_shards_over_ranks_it_starts_itself(tmp_path):
    two = _worker_losses(tmp_path, 2)
    one = _worker_losses(tmp_path, 1)
    for a, b in zip(two, one, strict=True):
        assert abs(a - b) < 1e-5
