"""The OpenAI-compatible server: in-process routes and errors, and the real `albatross serve` command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from albatross.engine import BuiltinEngine, SamplingParams
from albatross.engine.server import EngineServer
from albatross.engine.tokenizer import load_text_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def served(model_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = load_text_tokenizer(model_dir)
    engine = BuiltinEngine(str(model_dir), decode=tok.decode)
    server = EngineServer(engine, tok, "tiny").start()
    yield server
    server.close()
    engine.close()
    torch.set_num_threads(before)


def call(server_or_url, path: str, body=None, method: str | None = None, raw: bytes | None = None):
    url = server_or_url if isinstance(server_or_url, str) else server_or_url.url
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method or ("GET" if data is None else "POST"))
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
            return resp.status, (json.loads(text) if "json" in resp.headers["Content-Type"] else text)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_completion_with_token_ids_matches_the_engine(served) -> None:
    prompt = [2, 100, 101, 102, 3]
    status, out = call(served, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                   "temperature": 0, "logprobs": 0, "ignore_eos": True})
    assert status == 200
    want = served.engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0]
    choice = out["choices"][0]
    assert choice["token_ids"] == want.token_ids
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
    assert choice["versions"] == [0] * 6
    assert choice["prompt_token_ids"] == prompt
    assert choice["text"] == served.tok.decode(want.token_ids)
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                            "prompt_tokens_details": {"cached_tokens": out["usage"]["prompt_tokens_details"]
                                                      ["cached_tokens"]}}


def test_text_prompt_is_tokenised_and_batched(served) -> None:
    status, out = call(served, "/v1/completions", {"prompt": ["count the lines", "echo hello"], "max_tokens": 3,
                                                   "temperature": 0, "ignore_eos": True})
    assert status == 200
    assert [c["prompt_token_ids"] for c in out["choices"]] == [served.tok.encode("count the lines"),
                                                               served.tok.encode("echo hello")]
    assert out["choices"][0]["logprobs"] is None  # not asked for


def test_chat_uses_the_chat_template_and_stops_at_end_of_turn(served) -> None:
    messages = [{"role": "user", "content": "count the lines"}]
    status, out = call(served, "/v1/chat/completions", {"messages": messages, "max_tokens": 40, "seed": 1,
                                                        "logprobs": True})
    assert status == 200
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == served.tok.chat(messages)
    assert choice["message"]["role"] == "assistant"
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    if choice["finish_reason"] == "stop":
        assert choice["token_ids"][-1] in served.tok.stop_ids


def test_stop_string_is_cut_from_the_text(served) -> None:
    for seed in range(20):  # a seeded sample with some visible text (a random model also writes specials)
        body = {"prompt": [2, 100, 3], "max_tokens": 30, "seed": seed, "ignore_eos": True}
        free = call(served, "/v1/completions", body)[1]["choices"][0]["text"]
        if len(free) >= 5:
            break
    stop = free[3:5]
    out = call(served, "/v1/completions", {**body, "stop": stop})[1]["choices"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert out["text"] == free[: free.index(stop)]


def test_update_weights_sets_the_version_of_later_tokens(served, model_dir) -> None:
    status, out = call(served, "/update_weights", {"path": str(model_dir), "version": 4})
    assert (status, out["version"]) == (200, 4)
    out = call(served, "/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True})[1]
    assert out["choices"][0]["versions"] == [4, 4, 4]
    health = call(served, "/health")[1]
    assert (health["status"], health["version"]) == ("ok", 4) and health["busy_s"] > 0
    status, err = call(served, "/update_weights", {"path": str(model_dir / "nowhere"), "version": 5})
    assert status == 404 and "not found" in err["error"]["message"]
    assert call(served, "/update_weights", {"path": str(model_dir)})[0] == 400
    assert served.engine.version == 4


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/completions", None, 400, "JSON"),
        ("/v1/completions", {"prompt": [1], "max_tokens": "x"}, 400, "'max_tokens' must be int"),
        ("/v1/completions", {"prompt": []}, 400, "'prompt'"),
        ("/v1/completions", {"prompt": [10**6]}, 400, "prompt_ids must lie in"),
        ("/v1/completions", {"prompt": [1], "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": [1], "n": 2}, 400, "'n' must be 1"),
        ("/v1/completions", {"prompt": [1], "stream": True}, 400, "stream"),
        ("/v1/completions", {"prompt": [1], "model": "other"}, 404, "does not exist"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "'messages'"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "unknown chat role"),
        ("/v1/nothing", {}, 404, "no route"),
    ],
)
def test_malformed_requests_get_a_4xx_and_the_server_keeps_serving(served, path, body, status, message) -> None:
    raw = b"{not json" if body is None else None
    got, err = call(served, path, body, raw=raw)
    assert got == status
    assert message in err["error"]["message"]
    assert err["error"]["code"] == status
    assert call(served, "/health")[0] == 200


def test_wrong_method_is_405(served) -> None:
    assert call(served, "/v1/completions", method="GET")[0] == 405


def test_models_and_metrics(served) -> None:
    status, models = call(served, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny"
    before = served.engine.stats.generated_tokens
    call(served, "/v1/completions", {"prompt": [7, 8], "max_tokens": 2, "ignore_eos": True})
    status, text = call(served, "/metrics")
    assert status == 200
    generated = int(re.search(r"^albatross_generated_tokens_total (\d+)$", text, re.M).group(1))
    assert generated == before + 2
    assert re.search(r'^albatross_http_requests_total\{path="/v1/completions",code="200"\} \d+$', text, re.M)
    assert "# TYPE albatross_weight_version gauge" in text


def test_concurrent_requests_share_the_running_batch(served) -> None:
    passes = served.engine.stats.forward_passes
    results: list[int] = []

    def one(i: int) -> None:
        status, out = call(served, "/v1/completions", {"prompt": [2, 100 + i], "max_tokens": 20, "seed": i,
                                                       "ignore_eos": True})
        results.append(status)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [200] * 8
    assert served.engine.stats.forward_passes - passes < 8 * 20  # batched: fewer passes than tokens


# ------------------------------------------------------------------------------------------ the CLI


def test_albatross_serve_command(model_dir) -> None:
    cmd = [sys.executable, "-m", "albatross.cli", "serve", str(model_dir), "--port", "0",
           "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "albatross serve:" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        url = re.search(r"on (http://\S+)", line).group(1)
        assert call(url, "/health")[0] == 200
        status, out = call(url, "/v1/completions", {"prompt": "echo hello", "max_tokens": 4, "ignore_eos": True})
        assert status == 200 and len(out["choices"][0]["token_ids"]) == 4
    finally:
        proc.terminate()
        code = proc.wait(timeout=30)
    assert code == 0


def test_serve_rejects_a_directory_without_a_model(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "albatross.cli", "serve", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "not a model directory" in r.stderr
