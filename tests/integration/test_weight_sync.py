"""The weight transports against stand-ins that record every call: the ``nccl`` sender drives a vLLM 0.32-shaped
stand-in (its routes as ``trainer/weights/servers.py`` lists them; the weight group on gloo, here in one process)
through pause, buckets, tied weights, version and resume; a resumed trainer sends its checkpoint's weights before
its first step and writes the final weights itself; exports are sharded safetensors in the model's dtype.
The stand-in runs as its own process (``python THIS_FILE --stand-in DIR``: two gloo ranks cannot rendezvous in one
process); it answers ``GET /_record`` with its calls and writes what it received to ``DIR`` at each finish.
(NCCL by unique id, the path to real vLLM workers on GPUs, runs in ``albatross bench gpu``.)"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from albatross.trainer.weights.comm import GROUP
from albatross.trainer.weights.nccl import NCCLSender


class RecordingVLLM:
    """vLLM's weight routes: joins the trainer's gloo group as rank ``rank_offset``, receives each tensor the
    ``/update_weights`` body names, and records every call with whether generation was paused at the time."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.calls: list[tuple[str, bool]] = []
        self.bodies: dict[str, list[Any]] = {}
        self.paused, self.version, self.group = False, None, None
        self.weights: dict[str, torch.Tensor] = {}
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]

    def answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if path == "/_record":
            return 200, {"calls": self.calls, "version": self.version, "paused": self.paused}
        self.calls.append((path, self.paused))
        self.bodies.setdefault(path, []).append(body)
        route = path.split("?")[0]
        if route == "/get_world_size":
            return 200, {"world_size": 1}
        if route == "/init_weight_transfer_engine":
            self.group = self.join(body["init_info"])
            return 200, {"message": "Weight transfer initialized"}
        if route in ("/pause", "/resume"):
            self.paused = route == "/pause"
            return 200, {"status": route[1:] + "d"}
        if route == "/update_weights":
            info = body["update_info"]
            for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                torch.distributed.broadcast(t, src=0, group=self.group)
                self.weights[name] = t
            return 200, {"message": "Weights updated"}
        if route == "/finish_weight_update":
            from safetensors.torch import save_file

            self.version = body["weight_version"]
            save_file({k: v.clone() for k, v in self.weights.items()}, str(self.out / f"v{self.version}.safetensors"))
            return 200, {"message": "Weight update finished"}
        if route == "/reset_prefix_cache":
            return 200, {"success": "reset_running_requests=true" in path}
        if route in ("/start_weight_update", "/shutdown_weight_transfer_engine"):
            return 200, {"message": "ok"}
        return 404, {"detail": "Not Found"}

    def join(self, info: dict[str, Any]) -> Any:
        """The TCP rendezvous of the tests' gloo mode (real vLLM workers join by ``nccl_unique_id_b64``)."""
        from datetime import timedelta

        from torch.distributed import distributed_c10d as c10d

        assert info["packed"] is False and info["backend"] == "gloo"
        url = f"tcp://{info['master_address']}:{info['master_port']}"
        store, rank, world = next(c10d.rendezvous(url, info["rank_offset"], info["world_size"],
                                                  timeout=timedelta(seconds=60)))
        group, _ = c10d._new_process_group_helper(world, rank, [], "gloo", c10d.PrefixStore(GROUP, store),
                                                  group_name=GROUP, timeout=timedelta(seconds=60))
        c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
        return group

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._reply("GET")

            def do_POST(self) -> None:
                self._reply("POST")

            def _reply(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                status, payload = fake.answer(method, self.path, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


class StandIn:
    """The test's handle on a ``RecordingVLLM`` process."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen([sys.executable, __file__, "--stand-in", str(out)], stdout=subprocess.PIPE,
                                     text=True)
        self.url = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert self.url.startswith("http://"), self.url

    def record(self) -> dict[str, Any]:
        from albatross.engine.remote import HTTPClient

        return HTTPClient(self.url).call("GET", "/_record")[1]

    def paths(self) -> list[str]:
        return [p for p, _ in self.record()["calls"]]

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.out / f"v{version}.safetensors"))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def stand_in(tmp_path: Path):
    (tmp_path / "stand-in").mkdir()
    server = StandIn(tmp_path / "stand-in")
    (tmp_path / "engines.json").write_text(json.dumps({"type": "vllm", "weight_sync": "nccl",
                                                       "urls": [server.url]}))
    yield server
    server.close()


@pytest.fixture(scope="module")
def bf16_model_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """The tiny (tied) model saved in bf16: its declared dtype is what exports are written in."""
    from albatross.trainer.model import load_model

    out = tmp_path_factory.mktemp("bf16") / "model"
    load_model(tiny_model_dir).to(torch.bfloat16).save_pretrained(out)
    return out


def nudged(model_dir: Path, seed: int) -> torch.nn.Module:
    from albatross.trainer.model import load_model

    model = load_model(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def test_nccl_sender_pauses_sends_every_served_name_in_buckets_and_resumes(stand_in, bf16_model_dir,
                                                                           tmp_path: Path) -> None:
    model = nudged(bf16_model_dir, 1)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    sender = NCCLSender("vllm", tmp_path, backend="gloo", device="cpu", dtype="bfloat16", names="served",
                        bucket_bytes=64 << 10)
    try:
        assert sender.send(model, 3) == ""
        record = stand_in.record()
        sent = [p for p, _ in record["calls"]]
        updates = sent.count("/update_weights")
        assert updates >= 2  # bucket by bucket
        assert sent == ["/get_world_size", "/init_weight_transfer_engine", "/pause?mode=keep", "/start_weight_update",
                        *["/update_weights"] * updates, "/finish_weight_update",
                        "/reset_prefix_cache?reset_running_requests=true", "/resume"]
        assert all(paused for path, paused in record["calls"][3:-1])  # generation paused around the update
        assert record["version"] == "3" and not record["paused"]
        got = stand_in.weights(3)
        want = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        assert set(got) == set(want) and "lm_head.weight" in got  # the tied head too
        for name, t in want.items():
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t), name

        sender.send(nudged(bf16_model_dir, 2), 4)  # the group is kept: no second rendezvous
        again = stand_in.paths()[len(sent):]
        assert "/init_weight_transfer_engine" not in again and stand_in.record()["version"] == "4"
    finally:
        sender.close()
    assert stand_in.paths()[-1] == "/shutdown_weight_transfer_engine"


class Messages(list):
    def put(self, item: dict[str, Any]) -> None:
        self.append(item)


def test_a_resumed_trainer_sends_its_checkpoint_first_and_writes_final_weights(stand_in, bf16_model_dir,
                                                                               tmp_path: Path) -> None:
    """Under ``nccl`` no weights are on disk: a resumed trainer pushes its checkpoint's weights before any step,
    and at the end of the run writes the last version itself (``<out>/final``'s source), in the model's dtype."""
    from safetensors import safe_open

    from albatross.config import RunConfig
    from albatross.orchestrator.trainer_worker import FINISH, _steps
    from albatross.trainer.model import load_model
    from albatross.trainer.step import Trainer

    cfg = RunConfig()
    trained = Trainer.from_config(nudged(bf16_model_dir, 5), cfg)
    trained.version = 7
    ckpt = tmp_path / "checkpoints" / "trainer-v000007"
    assert trained.save(ckpt, dtype="bfloat16").result() > 0
    sender = NCCLSender("vllm", tmp_path, backend="gloo", device="cpu", dtype="bfloat16", names="served")
    messages = Messages()
    try:
        _steps(Trainer.from_config(load_model(bf16_model_dir), cfg), sender, tmp_path, cfg, lambda: FINISH,
               messages, 0, str(ckpt), "cpu", "bfloat16")
    finally:
        sender.close()
    counts = {k: messages[0].pop(k) for k in ("parameters", "trainable_parameters")}
    assert messages[0] == {"ready": True, "device": "cpu", "path": "", "version": 7}
    assert counts["parameters"] == counts["trainable_parameters"] > 0  # a full fine-tune trains every parameter
    assert stand_in.record()["version"] == "7"
    got = stand_in.weights(7)
    for name, t in trained.model.state_dict().items():
        assert torch.equal(got[name], t.detach().to(torch.bfloat16)), name
    final = Path(messages[-1]["final"])
    assert final == tmp_path / "weights" / "v000007"
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_exports_are_sharded_safetensors_in_the_models_dtype(bf16_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from albatross.engine import BuiltinEngine, SamplingParams
    from albatross.trainer.checkpoint import INDEX_NAME, export_weights
    from albatross.trainer.weights.tensors import declared_dtype

    assert declared_dtype(bf16_model_dir) == "bfloat16"
    model = nudged(bf16_model_dir, 3)
    out = export_weights(model, tmp_path / "weights", 2, dtype="bfloat16", names="served", shard_bytes=64 << 10)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    assert set(index) == set(model.state_dict()) and "lm_head.weight" in index
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t.to(torch.bfloat16)), name
    with BuiltinEngine(str(bf16_model_dir)) as engine:
        engine.update_weights(str(out), 2)
        assert engine.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=3))[0].versions == [2] * 3


if __name__ == "__main__" and sys.argv[1:2] == ["--stand-in"]:
    torch.set_num_threads(1)
    server = RecordingVLLM(Path(sys.argv[2]))
    print(server.url, flush=True)
    while True:
        time.sleep(3600)
