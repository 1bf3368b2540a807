"""`albatross serve` cannot be used to exhaust the machine: bounded lengths, finite sampling parameters, 4xx for
bad requests, a deep listen backlog, 429 above the concurrency bound, weight versions that never go backwards.

The memory probe runs a real `albatross serve` process under an RLIMIT_DATA of 3 GiB, so that the code before the
fix (which allocated 2 x max_tokens uniforms up front) fails the test instead of taking the machine's memory.
"""

from __future__ import annotations

import json
import re
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("transformers")

POSITIONS = 256  # the tiny_model_dir fixture's max_positions
DATA_LIMIT = 3 << 30


def call(url: str, path: str, body=None, raw: bytes | None = None, method: str | None = None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method or ("GET" if data is None else "POST"))
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read().decode()), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "null"), dict(e.headers)


def _limit_data() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (DATA_LIMIT, DATA_LIMIT))


def _kib(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


@pytest.fixture(scope="module")
def serve(tiny_model_dir: Path):
    """A real `albatross serve` process on a free loopback port: (url, pid)."""
    cmd = [sys.executable, "-m", "albatross.cli", "serve", str(tiny_model_dir), "--port", "0",
           "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_limit_data)
    try:
        line, deadline = "", time.monotonic() + 180
        while "albatross serve:" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        match = re.search(r"on (http://\S+)", line)
        assert match, f"server did not start: {line!r}"
        yield match.group(1), proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------------------------------ lengths and memory


def test_max_tokens_1e9_is_clamped_to_the_positions_without_memory_growth(serve) -> None:
    url, pid = serve
    assert call(url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})[0] == 200
    rss_before = _kib(pid, "VmRSS")
    status, out, _ = call(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 10**9, "ignore_eos": True})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == POSITIONS - 3  # clamped to the room the prompt leaves
    assert _kib(pid, "VmHWM") - rss_before < 500 * 1024  # peak RSS grew by less than 500 MB
    assert call(url, "/health")[0] == 200


def test_a_prompt_longer_than_the_positions_is_a_400_naming_the_limit(serve) -> None:
    url, _ = serve
    status, err, _ = call(url, "/v1/completions", {"prompt": [5] * (POSITIONS + 10), "max_tokens": 1})
    assert status == 400
    assert f"{POSITIONS} positions" in err["error"]["message"]
    status, err, _ = call(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "echo " * 400}]})
    assert status == 400 and f"{POSITIONS} positions" in err["error"]["message"]


# ------------------------------------------------------------------------------------------ bad requests: 4xx


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"prompt": [1], "temperature": NaN}', "'temperature' must be finite"),
        (b'{"prompt": [1], "temperature": Infinity}', "'temperature' must be finite"),
        (b'{"prompt": [1], "temperature": -1}', "temperature >= 0"),
        (b'{"prompt": [1], "top_p": NaN}', "'top_p' must be finite"),
        (b'{"prompt": [1], "seed": 100000000000000000000000}', "'seed' must fit in 64 bits"),
        (b'{"prompt": [1], "stop_token_ids": [100000000000000000000000]}', "'stop_token_ids'"),
        (b'{"prompt": [1], "stop_token_ids": [-1]}', "'stop_token_ids'"),
        (b'{"prompt": [1], "logit_bias": {"1": 5}}', "'logit_bias' is not supported"),
        (b'{"prompt": [1], "presence_penalty": 1.5}', "'presence_penalty' is not supported"),
        (b'{"prompt": [1], "stop": ' + json.dumps(["x"] * 100).encode() + b"}", "at most"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe\x00", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"prompt": {"a": 1}}', "'prompt'"),
    ],
    ids=["nan-temperature", "inf-temperature", "negative-temperature", "nan-top-p", "huge-seed", "huge-stop-id",
         "negative-stop-id", "logit-bias", "presence-penalty", "many-stops", "not-json", "not-utf8",
         "deep-nesting", "not-an-object", "prompt-object"],
)
def test_bad_completion_requests_are_400(serve, raw: bytes, message: str) -> None:
    url, _ = serve
    status, err, _ = call(url, "/v1/completions", raw=raw)
    assert status == 400, err
    assert message in err["error"]["message"]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "text", "text": None}]}],
        [{"role": 3, "content": "x"}],
    ],
)
def test_bad_chat_messages_are_400(serve, messages) -> None:
    url, _ = serve
    status, err, _ = call(url, "/v1/chat/completions", {"messages": messages})
    assert status == 400 and "messages[0]" in err["error"]["message"]


def _raw_exchange(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(request)
        return s.recv(65536)


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n", 413),
        (b"PUT /v1/completions HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
        (b"DELETE /update_weights HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
    ],
)
def test_bad_http_framing_is_4xx_never_5xx(serve, head: bytes, status: int) -> None:
    url, _ = serve
    reply = _raw_exchange(url, head)
    assert reply.startswith(f"HTTP/1.1 {status} ".encode()), reply[:200]
    assert call(url, "/health")[0] == 200


def test_update_weights_refuses_a_version_that_goes_backwards(serve, tiny_model_dir) -> None:
    url, _ = serve
    assert call(url, "/update_weights", {"path": str(tiny_model_dir), "version": 7})[0] == 200
    status, err, _ = call(url, "/update_weights", {"path": str(tiny_model_dir), "version": 3})
    assert status == 409 and "older" in err["error"]["message"]
    assert call(url, "/health")[1]["version"] == 7
    assert call(url, "/update_weights", {"path": str(tiny_model_dir), "version": 7})[0] == 200  # same: fine


# ------------------------------------------------------------------------------------------ connections


def test_listen_backlog_is_at_least_128(serve) -> None:
    if shutil.which("ss") is None:
        pytest.skip("needs `ss` (iproute2) to read the listen backlog")
    port = serve[0].rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    backlog = int(out.split()[2])  # Send-Q of a listening socket is its backlog
    assert backlog >= 128


def test_50_concurrent_connections_are_all_answered(serve) -> None:
    url, _ = serve
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    barrier, replies = threading.Barrier(50), []

    def one() -> None:
        try:
            with socket.create_connection((host, int(port)), timeout=120) as s:
                barrier.wait(timeout=60)
                s.sendall(request)
                replies.append(s.recv(64)[:12])
        except OSError as e:  # a reset or refused connection
            replies.append(repr(e).encode())

    threads = [threading.Thread(target=one) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert replies == [b"HTTP/1.1 200"] * 50


def test_serve_on_a_port_in_use_is_one_line(serve, tiny_model_dir) -> None:
    port = serve[0].rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "-m", "albatross.cli", "serve", str(tiny_model_dir), "--port", port],
                       capture_output=True, text=True, timeout=180)
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("Loading")]
    assert "Traceback" not in r.stderr and r.returncode == 2, r.stderr[-2000:]
    assert lines[-1].startswith("albatross: error: serve: cannot listen") and len(lines) == 1, lines


@pytest.fixture
def gated(tiny_model_dir: Path):
    """An in-process server with max_concurrency=2 whose engine blocks before every forward pass until the
    returned event is set: (server, event)."""
    import torch

    from albatross.engine import BuiltinEngine
    from albatross.engine.server import EngineServer
    from albatross.engine.tokenizer import load_text_tokenizer

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = load_text_tokenizer(tiny_model_dir)
    engine = BuiltinEngine(str(tiny_model_dir), decode=tok.decode)
    gate = threading.Event()
    engine.scheduler.step_hook = lambda: gate.wait(timeout=60)
    server = EngineServer(engine, tok, "tiny", max_concurrency=2).start()
    yield server, gate
    gate.set()
    server.close()
    engine.close()
    torch.set_num_threads(before)


def test_above_the_concurrency_bound_requests_get_429_with_retry_after(gated) -> None:
    server, gate = gated
    body = {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True}
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(call(server.url, "/v1/completions", body)[0]))
               for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.in_flight < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # both requests are being served (the engine is blocked)
    status, err, headers = call(server.url, "/v1/completions", body)
    assert status == 429 and "busy" in err["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    assert call(server.url, "/health")[0] == 200  # GETs are not counted against the bound
    gate.set()
    for t in threads:
        t.join(timeout=60)
    assert results == [200, 200]
    assert call(server.url, "/v1/completions", body)[0] == 200  # slots are given back


def test_the_remote_client_retries_a_429_until_the_server_has_room(gated) -> None:
    from albatross.engine.base import SamplingParams
    from albatross.engine.remote import AlbatrossEngine

    server, gate = gated
    body = {"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True}
    blockers = [threading.Thread(target=call, args=(server.url, "/v1/completions", body)) for _ in range(2)]
    for t in blockers:
        t.start()
    deadline = time.monotonic() + 30
    while server.in_flight < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    client = AlbatrossEngine(server.url, connect_timeout=10)
    try:
        threading.Timer(0.3, gate.set).start()  # room appears while the client backs off
        out = client.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))[0]
    finally:
        client.close()
        for t in blockers:
            t.join(timeout=60)
    assert len(out.token_ids) == 2
    assert server.http_requests[("/v1/completions", 429)] >= 1  # it was refused first, then served
