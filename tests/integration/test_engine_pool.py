"""Engine replicas: sticky, least-loaded sessions; `albatross serve` replica processes that are killed
with SIGKILL are restarted with the newest weights while requests in flight fail as engine errors."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from albatross.config import EngineConfig
from albatross.engine import BuiltinEngine, Completion, SamplingParams
from albatross.engine.base import EngineError, SingleEngine
from albatross.engine.pool import EnginePool, LocalReplica

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


class Recorder(SingleEngine):
    """A deterministic engine that records which prompts it served."""

    def __init__(self, name: str) -> None:
        self.name, self.version, self.prompts = name, 0, []
        self.loaded: list[int] = []

    def generate(self, prompts, params):
        self.prompts += prompts
        return [Completion([1], [0.0], [self.version], "length") for _ in prompts]

    def update_weights(self, path: str, version: int) -> None:
        self.version = version
        self.loaded.append(version)

    def close(self) -> None:
        pass


def test_sessions_stick_to_one_replica_and_spread_over_the_least_loaded() -> None:
    engines = [Recorder("a"), Recorder("b"), Recorder("c")]
    with EnginePool([LocalReplica(e) for e in engines], log=lambda _: None) as pool:
        sessions = [pool.session() for _ in range(6)]
        assert sorted(pool.sessions) == [2, 2, 2]  # spread evenly
        for n, s in enumerate(sessions):
            for turn in range(3):
                s.generate([[n, turn]], GREEDY)
        for e in engines:  # every turn of an attempt went to the replica that served its first turn
            attempts = {p[0] for p in e.prompts}
            assert all(sum(p[0] == a for p in e.prompts) == 3 for a in attempts)
        for s in sessions[:2]:
            s.close()
        busy = [i for i in range(3) if pool.sessions[i] == 2]
        newcomer = pool.session()
        assert newcomer.index not in busy  # the least loaded replica gets the new attempt
        pool.update_weights("/nowhere", 4)
        assert [e.loaded for e in engines] == [[4], [4], [4]] and newcomer.version == 4


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def _perturbed_weights(model_dir: Path, root: Path, version: int) -> Path:
    from albatross.trainer.checkpoint import export_weights
    from albatross.trainer.model import load_model

    model = load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return export_weights(model, root, version)


def test_a_killed_replica_process_is_restarted_with_the_newest_weights(model_dir: Path, tmp_path: Path) -> None:
    logs: list[str] = []
    pool = EnginePool.of_processes(model_dir, EngineConfig(replicas=2), tmp_path / "logs", log=logs.append)
    pids = list(pool.pids().values())
    try:
        prompt = [[3, 4, 5]]
        with BuiltinEngine(str(model_dir)) as alone:  # the HTTP replica gives what the engine gives alone
            want = alone.generate(prompt, GREEDY)[0]
        got = pool.generate(prompt, GREEDY)[0]
        assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-4)

        path = _perturbed_weights(model_dir, tmp_path / "weights", 1)
        pool.update_weights(str(path), 1)
        session = pool.session()
        assert set(session.generate(prompt, GREEDY)[0].versions) == {1}
        victim = pool.replicas[session.index].pid
        os.kill(victim, signal.SIGKILL)  # the engine process dies mid-run
        with pytest.raises(EngineError):
            session.generate(prompt, GREEDY)
        session.close()
        deadline = time.monotonic() + 120
        while pool.restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pool.restarts == 1 and any("restarted as pid" in line for line in logs), logs
        assert pool.pids()[f"engine{session.index}"] != victim
        # every replica serves the newest weights, the restarted one included
        outs = [s.generate(prompt, GREEDY)[0] for s in (pool.session(), pool.session())]
        assert all(set(o.versions) == {1} for o in outs) and outs[0].token_ids == outs[1].token_ids
        pids = list(pool.pids().values())
    finally:
        pool.close()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "a replica process outlived close()"


def test_requests_in_flight_when_a_replica_dies_fail_as_engine_errors(model_dir: Path, tmp_path: Path) -> None:
    pool = EnginePool.of_processes(model_dir, EngineConfig(), tmp_path / "logs", log=lambda _: None)
    errors: list[BaseException] = []
    try:
        session = pool.session()
        long = SamplingParams(temperature=1.0, max_tokens=200, seed=1)

        def call() -> None:
            try:
                for _ in range(50):
                    session.generate([[3, 4, 5]], long)
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                errors.append(e)

        worker = threading.Thread(target=call)
        worker.start()
        time.sleep(1.0)
        os.kill(pool.replicas[0].pid, signal.SIGKILL)
        worker.join(timeout=60)
        assert not worker.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], EngineError), errors
        session.close()
        with pool.session() as fresh:  # waits for the restart, then serves
            assert len(fresh.generate([[3]], GREEDY)[0].token_ids) == 6
    finally:
        pool.close()


def test_process_replicas_take_the_engine_section(tmp_path: Path) -> None:
    from albatross.engine.pool import ProcessReplica

    default = ProcessReplica(tmp_path, tmp_path / "log", EngineConfig())
    assert default.start_timeout_s == EngineConfig().start_timeout_s == 900.0
    tuned = ProcessReplica(tmp_path, tmp_path / "log", EngineConfig(start_timeout_s=5, threads=2, max_batch_size=8))
    assert (tuned.start_timeout_s, tuned.threads, tuned.max_batch_size) == (5, 2, 8)
