"""Remote engines against a deterministic fake of SGLang's HTTP API (backed by the built-in engine): parsing,
versions, weight reloads, pause/resume, retries with backoff, and clear errors for missing or wrong servers.
The vLLM client is tested against a real vLLM server in tests/integration/test_vllm.py.

``FakeSGLang`` also runs as a process (``python -m sglang.launch_server`` with the fake package that
``fake_sglang_package`` writes): tests/integration/test_engine_launch.py launches it through ``make_engine`` and
pushes weights into it over its weight-update group (``/init_weights_update_group``,
``/update_weights_from_distributed``) with the gloo backend."""

from __future__ import annotations

import argparse
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from albatross.engine import BuiltinEngine, SamplingParams
from albatross.engine.remote import HTTPClient, RemoteError, SGLangEngine, VLLMEngine, spans_to_versions
from tiny_models import tiny_qwen2 as tiny_model


class FakeSGLang:
    """SGLang's /generate, /update_weights_from_disk, /pause_generation, /continue_generation, /health and
    /model_info, answered by a BuiltinEngine; ``fail_next`` answers that many requests with 503 first."""

    def __init__(self, engine: BuiltinEngine, model_info: bool = True, port: int = 0,
                 weight_version: str = "0") -> None:
        self.engine, self.model_info = engine, model_info
        self.weight_version = weight_version
        self.fail_next = 0
        self.calls: list[str] = []
        self.bodies: list[dict] = []
        self.paused = False
        self.group = None  # the weight-update process group, once joined
        self.received: dict = {}  # tensors of a distributed update, until its last bucket
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def answer(self, method: str, path: str, body: dict) -> tuple[int, object]:
        if path == "/_record":  # what the weight-update tests check
            return 200, {"calls": self.calls, "bodies": self.bodies}
        self.calls.append(path)
        self.bodies.append(body)
        if self.fail_next > 0:
            self.fail_next -= 1
            return 503, {"error": "busy"}
        if (method, path) == ("GET", "/health"):
            return 200, None
        if (method, path) == ("GET", "/model_info") and self.model_info:
            return 200, {"model_path": "fake", "weight_version": self.weight_version}
        if (method, path) == ("POST", "/generate"):
            return 200, self.generate(body)
        if (method, path) == ("POST", "/update_weights_from_disk"):
            self.engine.update_weights(body["model_path"], int(body["weight_version"]))
            self.weight_version = body["weight_version"]
            return 200, {"success": True, "message": "ok", "num_paused_requests": 0}
        if (method, path) in (("POST", "/pause_generation"), ("POST", "/continue_generation")):
            self.paused = path == "/pause_generation"
            return 200, {"status": "ok"}
        if (method, path) == ("GET", "/server_info") and self.model_info:
            return 200, {"tp_size": 1, "pp_size": 1, "dp_size": 1, "weight_version": self.weight_version}
        if (method, path) == ("POST", "/init_weights_update_group"):
            self.group = join_group(body)
            return 200, {"success": True, "message": "joined"}
        if (method, path) == ("POST", "/destroy_weights_update_group"):
            import torch.distributed as dist

            dist.destroy_process_group(self.group)
            self.group = None
            return 200, {"success": True, "message": "left"}
        if (method, path) == ("POST", "/update_weights_from_distributed"):
            return 200, self.receive(body)
        return 404, {"detail": "Not Found"}

    def receive(self, body: dict) -> dict:
        """Receive every tensor from rank 0 of the group, then swap them in and take the new version."""
        import torch.distributed as dist

        state = {}
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            state[name] = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(state[name], src=0, group=self.group)
        self.received.update(state)
        if body.get("weight_version") is not None:  # the last bucket: swap in every tensor received
            self.engine.update_weights_from_state_dict(self.received, int(body["weight_version"]))
            self.weight_version, self.received = body["weight_version"], {}
        return {"success": True, "message": f"{len(state)} tensors"}

    def generate(self, body: dict) -> dict:
        sp = body["sampling_params"]
        params = SamplingParams(temperature=sp["temperature"], top_p=sp["top_p"], top_k=max(0, sp["top_k"]),
                                max_tokens=sp["max_new_tokens"], stop_token_ids=sp["stop_token_ids"],
                                seed=sp.get("sampling_seed"))
        c = self.engine.generate([body["input_ids"]], params)[0]
        meta = {"finish_reason": {"type": c.finish_reason, "matched": c.stop_reason},
                "weight_version": self.weight_version, "prompt_tokens": len(body["input_ids"]),
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids, strict=True)]}
        return {"output_ids": c.token_ids, "meta_info": meta}

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
                body = json.loads(self.rfile.read(n) or b"{}")
                status, payload = fake.answer(method, self.path, body)
                data = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


def join_group(body: dict):
    """Join the trainer's weight-update group as SGLang's workers do: TCP rendezvous, a prefix store named after
    the group, rank ``rank_offset``."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    rank, world, name = body["rank_offset"], body["world_size"], body["group_name"]
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    store, rank, world = next(c10d.rendezvous(url, rank, world, timeout=timedelta(seconds=60)))
    group, _ = c10d._new_process_group_helper(world, rank, [], body["backend"], c10d.PrefixStore(name, store),
                                              group_name=name, timeout=timedelta(seconds=60))
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


def serve_main(argv: list[str]) -> None:
    """``python -m sglang.launch_server`` of the fake package: the flags albatross passes (an unknown one exits
    with code 2, as SGLang's own parser does), a BuiltinEngine of ``--model-path`` behind ``FakeSGLang``."""
    p = argparse.ArgumentParser(prog="sglang.launch_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--context-length", type=int)
    p.add_argument("--mem-fraction-static", type=float)
    args = p.parse_args(argv)
    assert args.skip_tokenizer_init, argv  # token ids in and out
    torch.set_num_threads(1)
    server = FakeSGLang(BuiltinEngine(args.model_path), port=args.port, weight_version=args.weight_version)
    print(f"fake sglang on {server.url}", flush=True)
    server.thread.join()


def fake_sglang_package(root: Path) -> Path:
    """Write a package ``sglang`` whose ``launch_server`` runs ``serve_main``; put ``root`` on PYTHONPATH."""
    pkg = root / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('__version__ = "0.0-fake"\n')
    (pkg / "launch_server.py").write_text(
        f"import sys\nsys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]\n"
        "from test_engine_remote import serve_main\nserve_main(sys.argv[1:])\n")
    return root


@pytest.fixture
def fake():
    torch.set_num_threads(1)
    engine = BuiltinEngine(tiny_model(0))
    server = FakeSGLang(engine)
    yield server
    server.close()
    engine.close()


def test_sglang_generation_returns_ids_logprobs_and_versions(fake) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    with SGLangEngine(fake.url) as remote:
        got = remote.generate([[5, 6, 7], [9, 10]], params)
    want = fake.engine.generate([[5, 6, 7], [9, 10]], params)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs)
        assert g.versions == [0] * 8 and g.finish_reason == "length"


def test_sglang_weight_reload_labels_later_tokens(fake, tmp_path: Path) -> None:
    state = {k: v.clone() for k, v in tiny_model(1).state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with SGLangEngine(fake.url) as remote:
        remote.pause()
        assert fake.paused
        remote.resume()
        assert not fake.paused
        remote.update_weights(str(tmp_path), 3)
        assert remote.version == 3
        out = remote.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))[0]
        with pytest.raises(FileNotFoundError):
            remote.update_weights(str(tmp_path / "missing"), 4)
    assert out.versions == [3] * 4
    assert fake.engine.version == 3


def test_retries_with_backoff_then_succeeds(fake) -> None:
    with SGLangEngine(fake.url) as remote:
        fake.fail_next = 2
        remote.http.backoff = 0.01
        out = remote.generate([[5, 6]], SamplingParams(temperature=0.0, max_tokens=2))[0]
        assert len(out.token_ids) == 2
        assert fake.calls[-3:] == ["/generate"] * 3
        fake.fail_next = 10
        with pytest.raises(RemoteError, match="failed after 4 tries: HTTP 503"):
            remote.generate([[5, 6]], SamplingParams(max_tokens=2))


def test_a_server_that_dies_mid_answer_is_retried_then_a_remote_error() -> None:
    """A replica killed while it sends a completion leaves a short body (IncompleteRead, an HTTPException): the
    client retries and then raises RemoteError, which the engine pool handles, never the raw exception."""
    calls = []

    class Dying(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            calls.append(1)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "1013")
            self.end_headers()
            self.wfile.write(b'{"choices": [')  # then the connection closes

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Dying)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = HTTPClient(f"http://127.0.0.1:{httpd.server_address[1]}", retries=2, backoff=0.01)
        with pytest.raises(RemoteError, match="failed after 3 tries: IncompleteRead"):
            client.call("POST", "/v1/completions", {"prompt": [1]})
        assert len(calls) == 3
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_client_error_is_not_retried(fake) -> None:
    client = HTTPClient(fake.url, retries=3, backoff=0.01)
    with pytest.raises(RemoteError, match="HTTP 404"):
        client.call("POST", "/nothing", {})
    assert fake.calls == ["/nothing"]


def test_missing_and_incompatible_servers_are_clear_errors() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteError, match="no healthy sglang server"):
        SGLangEngine(f"http://127.0.0.1:{port}", connect_timeout=0.5)
    engine = BuiltinEngine(tiny_model(0))
    not_sglang = FakeSGLang(engine, model_info=False)
    try:
        with pytest.raises(RemoteError, match="not an SGLang server"):
            SGLangEngine(not_sglang.url)
        with pytest.raises(RemoteError, match="/v1/models"):  # nor a vLLM server
            VLLMEngine(not_sglang.url, retries=0)
    finally:
        not_sglang.close()
        engine.close()


def test_vllm_weight_version_spans_become_per_token_versions() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert spans_to_versions(spans, 5, default=0) == [3, 3, 4, 4, 4]
    assert spans_to_versions(None, 3, default=7) == [7, 7, 7]


def test_sglang_weight_group_size_comes_from_server_info_or_is_an_error(fake) -> None:
    """``tp_size`` is read from ``/server_info``; a server without it (a 404 whose JSON body is a dict) is an
    error, never a group of the wrong size (a rendezvous at TP > 1 would then hang)."""
    from albatross.engine.base import EngineError
    from albatross.trainer.weights.servers import SGLangServer

    assert SGLangServer(fake.url).ranks() == 1
    engine = BuiltinEngine(tiny_model(0))
    bare = FakeSGLang(engine, model_info=False)
    try:
        with pytest.raises(EngineError, match="gives tp_size"):
            SGLangServer(bare.url).ranks()
    finally:
        bare.close()
        engine.close()


def test_sglang_logprobs_are_renormalised_over_the_tokens_top_k_and_top_p_keep() -> None:
    """SGLang reports log-probs after temperature, before top-k / top-p: the sampled distribution's are those
    divided by the mass its sampler keeps (ranks below top_k whose mass ranked above is at most top_p)."""
    import math

    from albatross.engine.remote import kept_mass, renormalised

    probs = [0.5, 0.2, 0.15, 0.1, 0.05]
    assert kept_mass(probs, 0.6, 0) == pytest.approx(0.7)  # 0.5 kept (0 above), 0.2 kept (0.5 above), 0.15 not
    assert kept_mass(probs, 1.0, 2) == pytest.approx(0.7)
    assert kept_mass(probs, 0.4, 0) == pytest.approx(0.5)
    assert kept_mass(probs[:2], 0.9, 0) == pytest.approx(0.9)  # the kept set runs past the list: top_p
    ranked = [math.log(p) for p in probs]
    params = SamplingParams(temperature=0.7, top_p=0.6)
    assert renormalised(math.log(0.2), ranked, params) == pytest.approx(math.log(0.2 / 0.7))
