"""OpenAI-compatible HTTP server for an engine (stdlib ``ThreadingHTTPServer``, one thread per connection).

Routes: ``POST /v1/completions`` (prompt as text or token ids), ``POST /v1/chat/completions`` (the model's chat
template), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), ``POST /update_weights``
(``{"path": DIR, "version": N}``). Responses carry the exact ``token_ids``, per-token log-probs and, as an
extension, the policy ``versions`` of every token. Concurrent requests share the engine's running batch.
A malformed request gets a 4xx with an OpenAI-style error body naming the field; the server keeps serving.

Limits (docs/engines.md, "Server limits"): a prompt must leave room for one token in the model's positions (400
naming the limit); ``max_tokens`` beyond the room left is clamped (``finish_reason`` "length"); sampling
parameters must be finite and in range; at most ``max_concurrency`` generation requests are in flight, the next
gets 429 with ``Retry-After``; the listen backlog is ``LISTEN_BACKLOG``; ``/update_weights`` refuses a version
lower than the current one (409).
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from albatross.engine.base import Completion, Engine, EngineError, SamplingParams
from albatross.engine.tokenizer import TextTokenizer

MAX_BODY = 16 * 1024 * 1024
LISTEN_BACKLOG = 1024
"""Pending connections the kernel queues before ``accept`` (``request_queue_size``; Python's default is 5)."""
DEFAULT_MAX_CONCURRENCY = 256
"""Generation and weight-update requests in flight at once; the next one is answered 429."""
SOCKET_TIMEOUT_S = 120.0
"""A connection that sends nothing for this long is closed (it would hold a thread forever)."""
MAX_STOPS = 64
INT64 = 2**63
# Fields whose non-neutral values would change the output and that this server does not implement.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0),
    "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
}


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# ------------------------------------------------------------------------------------------ request parsing


def _field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if kind in (float, (float,)) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise BadRequest(f"'{key}' must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"'{key}' must be finite, got {value}")
    return value


def _unsupported(body: dict[str, Any]) -> None:
    """400 for a field this server would otherwise ignore although it changes the output."""
    for key, neutral in UNSUPPORTED.items():
        if key in body and not any(body[key] == v and type(body[key]) is type(v) for v in neutral):
            raise BadRequest(f"'{key}' is not supported by this server")


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"'stop' has {len(stops)} strings; at most {MAX_STOPS}")
    return stops


def _token_list(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise BadRequest(f"'{key}' must be a list of integers")
    if value and not (0 <= min(value) and max(value) < INT64):
        raise BadRequest(f"'{key}' must hold token ids >= 0")
    return value


def _seed(body: dict[str, Any]) -> int | None:
    seed: int | None = _field(body, "seed", int, None)
    if seed is not None and not -INT64 <= seed < 2 * INT64:
        raise BadRequest(f"'seed' must fit in 64 bits, got {seed}")
    return seed


def sampling_params(body: dict[str, Any], default_stop_ids: list[int], max_tokens: int = 16) -> SamplingParams:
    """``SamplingParams`` from an OpenAI request body; ``BadRequest`` names the first bad field."""
    top_k = _field(body, "top_k", int, 0)
    stop_ids = _token_list(body.get("stop_token_ids") or [], "stop_token_ids")
    if not _field(body, "ignore_eos", bool, False):
        stop_ids = stop_ids + [i for i in default_stop_ids if i not in stop_ids]
    n_tokens = _field(body, "max_completion_tokens", int, None)
    params = SamplingParams(
        temperature=_field(body, "temperature", float, 1.0),
        top_p=_field(body, "top_p", float, 1.0),
        top_k=0 if top_k < 0 else top_k,  # vLLM uses -1 for "off"
        max_tokens=n_tokens if n_tokens is not None else _field(body, "max_tokens", int, max_tokens),
        stop_token_ids=stop_ids,
        seed=_seed(body),
        stop=_stops(body),
    )
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.max_tokens < 0:
        raise BadRequest("need temperature >= 0, 0 < top_p <= 1 and max_tokens >= 0")
    _unsupported(body)
    if _field(body, "n", int, 1) != 1:
        raise BadRequest("'n' must be 1 (send several requests instead)")
    if _field(body, "stream", bool, False):
        raise BadRequest("'stream' is not supported by this server")
    return params


def completion_prompts(body: dict[str, Any], tok: TextTokenizer) -> list[list[int]]:
    """The prompts of a /v1/completions body: text, token ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tok.encode(p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [_token_list(p, "prompt") for p in prompt]
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of either")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``messages`` of a chat body, checked: each a ``{role, content}`` object with text content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        content = m.get("content", "")
        parts = content if isinstance(content, list) else [{"text": content}]
        if not isinstance(m.get("role"), str) or not all(
                isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in parts):
            raise BadRequest(f"'messages[{i}]' needs a string 'role' and string (or text parts) 'content'")
    return messages


# ------------------------------------------------------------------------------------------ responses


def _text(tok: TextTokenizer, c: Completion) -> str:
    text = tok.decode(c.token_ids)
    if isinstance(c.stop_reason, str) and c.stop_reason in text:
        text = text[: text.index(c.stop_reason)]  # OpenAI: the stop string is not part of the text
    return text


def _usage(prompts: list[list[int]], outs: list[Completion]) -> dict[str, Any]:
    p, c = sum(len(x) for x in prompts), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)}}


def completion_response(model: str, tok: TextTokenizer, prompts: list[list[int]], outs: list[Completion],
                        with_logprobs: bool) -> dict[str, Any]:
    choices = []
    for i, (p, c) in enumerate(zip(prompts, outs, strict=True)):
        logprobs = None
        if with_logprobs:
            pieces = [tok.decode([t]) for t in c.token_ids]
            offsets = [sum(len(x) for x in pieces[:j]) for j in range(len(pieces))]
            logprobs = {"tokens": pieces, "token_logprobs": c.logprobs, "top_logprobs": None,
                        "text_offset": offsets}
        choices.append({"index": i, "text": _text(tok, c), "logprobs": logprobs, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason, "token_ids": c.token_ids, "prompt_token_ids": p,
                        "versions": c.versions})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(prompts, outs)}


def chat_response(model: str, tok: TextTokenizer, prompt: list[int], out: Completion,
                  with_logprobs: bool) -> dict[str, Any]:
    logprobs: dict[str, Any] | None = None
    if with_logprobs:
        logprobs = {"content": [{"token": tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                                for t, lp in zip(out.token_ids, out.logprobs, strict=True)]}
    text = _text(tok, out)
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
              "finish_reason": out.finish_reason, "stop_reason": out.stop_reason, "token_ids": out.token_ids,
              "prompt_token_ids": prompt, "versions": out.versions}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage([prompt], [out])}


# ------------------------------------------------------------------------------------------ server


class EngineServer:
    """Serves ``engine`` (``generate`` / ``update_weights`` / ``version``) with tokenizer ``tok`` over HTTP."""

    def __init__(self, engine: Engine, tok: TextTokenizer, model_name: str, host: str = "127.0.0.1",
                 port: int = 0, max_concurrency: int = DEFAULT_MAX_CONCURRENCY) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.engine, self.tok, self.model_name = engine, tok, model_name
        self.stop_ids: list[int] = list(tok.stop_ids)
        self.positions = engine.metrics().positions
        """The model's positions when the engine runs a model in this process, else None."""
        self.max_concurrency = max_concurrency
        self.http_requests: Counter[tuple[str, int]] = Counter()
        self._lock = threading.Lock()
        self.in_flight = 0
        """POST requests being served now (at most ``max_concurrency``)."""
        self.httpd = _HTTPServer((host, port), _handler_class(self))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host.decode() if isinstance(host, bytes) else host}:{port}"

    def start(self) -> EngineServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="albatross-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def count(self, path: str, status: int) -> None:
        with self._lock:
            self.http_requests[(path, status)] += 1

    def handle(self, method: str, path: str, raw: bytes) -> tuple[int, Any]:
        """Route one request (body ``raw``); a POST takes one of ``max_concurrency`` slots or is answered 429."""
        route = self.route(method, path)
        body = _json_body(raw, method)
        if method != "POST":
            return route(body)
        with self._lock:
            if self.in_flight >= self.max_concurrency:
                raise BadRequest(f"server busy: {self.max_concurrency} requests in flight; retry later",
                                 HTTPStatus.TOO_MANY_REQUESTS)
            self.in_flight += 1
        try:
            return route(body)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _check_length(self, prompts: list[list[int]]) -> None:
        """400 for a prompt that leaves no room in the model's positions for a generated token."""
        longest = max(len(p) for p in prompts)
        if self.positions is not None and longest >= self.positions:
            raise BadRequest(f"prompt has {longest} tokens; this model has {self.positions} positions, so a "
                             f"prompt may have at most {self.positions - 1} tokens")

    # -------------------------------------------------------------------------------------- routes

    def route(self, method: str, path: str) -> Callable[[dict[str, Any]], tuple[int, Any]]:
        routes: dict[tuple[str, str], Callable[[dict[str, Any]], tuple[int, Any]]] = {
            ("GET", "/health"): self.health, ("GET", "/v1/models"): self.models,
            ("GET", "/metrics"): self.metrics, ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat, ("POST", "/update_weights"): self.update_weights,
        }
        if (method, path) in routes:
            return routes[(method, path)]
        if any(p == path for _, p in routes):
            raise BadRequest(f"method {method} not allowed on {path}", HTTPStatus.METHOD_NOT_ALLOWED)
        raise BadRequest(f"no route {path}", HTTPStatus.NOT_FOUND)

    def health(self, _: dict[str, Any]) -> tuple[int, Any]:
        closed, busy = self.engine.metrics().closed, self.engine.busy_seconds
        status = HTTPStatus.SERVICE_UNAVAILABLE if closed else HTTPStatus.OK
        return status, {"status": "closed" if closed else "ok", "version": self.engine.version,
                        "busy_s": 0.0 if busy is None else float(busy)}

    def models(self, _: dict[str, Any]) -> tuple[int, Any]:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "albatross",
                "version": self.engine.version}
        return HTTPStatus.OK, {"object": "list", "data": [card]}

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {model!r} does not exist; this server has {self.model_name!r}",
                             HTTPStatus.NOT_FOUND)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self._check_length(prompts)
        try:
            return self.engine.generate(prompts, params)
        except ValueError as e:  # the engine's own validation: bad ids, bad parameters
            raise BadRequest(str(e)) from e
        except EngineError as e:  # closed (shutting down) or unreachable: 503 (any other error: a 500)
            raise BadRequest(str(e), HTTPStatus.SERVICE_UNAVAILABLE) from e

    def completions(self, body: dict[str, Any]) -> tuple[int, Any]:
        self._check_model(body)
        prompts = completion_prompts(body, self.tok)
        params = sampling_params(body, [self.tok.eos_id] if self.tok.eos_id is not None else [])
        if _field(body, "echo", bool, False):
            raise BadRequest("'echo' is not supported by this server")
        want_logprobs = _field(body, "logprobs", int, None) is not None
        outs = self._generate(prompts, params)
        return HTTPStatus.OK, completion_response(self.model_name, self.tok, prompts, outs, want_logprobs)

    def chat(self, body: dict[str, Any]) -> tuple[int, Any]:
        self._check_model(body)
        messages = chat_messages(body)
        try:
            prompt = self.tok.chat(messages)
        except ValueError as e:
            raise BadRequest(str(e)) from e
        params = sampling_params(body, self.stop_ids)
        out = self._generate([prompt], params)[0]
        want = _field(body, "logprobs", bool, False)
        return HTTPStatus.OK, chat_response(self.model_name, self.tok, prompt, out, want)

    def update_weights(self, body: dict[str, Any]) -> tuple[int, Any]:
        path, version = body.get("path"), body.get("version")
        if not isinstance(path, str) or not path:
            raise BadRequest("'path' must be the checkpoint directory (a string)")
        if not isinstance(version, int) or isinstance(version, bool):
            raise BadRequest("'version' must be an integer")
        if version < self.engine.version:
            raise BadRequest(f"'version' {version} is older than the served version {self.engine.version}; "
                             "versions never go backwards", HTTPStatus.CONFLICT)
        try:
            start = time.perf_counter()
            self.engine.update_weights(path, version)
        except FileNotFoundError as e:
            raise BadRequest(str(e), HTTPStatus.NOT_FOUND) from e
        except ValueError as e:
            raise BadRequest(str(e)) from e
        return HTTPStatus.OK, {"version": self.engine.version, "seconds": time.perf_counter() - start}

    def metrics(self, _: dict[str, Any]) -> tuple[int, Any]:
        return HTTPStatus.OK, prometheus_text(self)


def prometheus_text(server: EngineServer) -> str:
    engine = server.engine
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP albatross_{name} {help_}", f"# TYPE albatross_{name} {kind}"])
        lines.extend(f"albatross_{name}{labels} {value}" for labels, value in samples)

    measured = engine.metrics()
    stats = measured.stats
    if stats is not None:
        for name, value, help_ in (
                ("requests", stats.requests, "Requests admitted"),
                ("prompt_tokens", stats.prompt_tokens, "Prompt tokens"),
                ("cached_prompt_tokens", stats.cached_prompt_tokens, "Prompt tokens served from the prefix cache"),
                ("generated_tokens", stats.generated_tokens, "Generated tokens"),
                ("forward_passes", stats.forward_passes, "Model forward passes"),
                ("draft_tokens", stats.draft_tokens, "Speculative draft tokens proposed"),
                ("accepted_draft_tokens", stats.accepted_draft_tokens, "Speculative draft tokens accepted")):
            metric(f"{name}_total", "counter", help_, [("", value)])
    gauges = (("running_requests", measured.running_requests, "Requests in the running batch"),
              ("waiting_requests", measured.waiting_requests, "Requests waiting to join"),
              ("prefix_cache_tokens", measured.prefix_cache_tokens, "Tokens held by the prefix cache"))
    for name, gauge, help_ in gauges:
        if gauge is not None:
            metric(name, "gauge", help_, [("", gauge)])
    metric("weight_version", "gauge", "Policy version of the weights in use", [("", engine.version)])
    with server._lock:
        counts, in_flight = sorted(server.http_requests.items()), server.in_flight
    metric("http_in_flight_requests", "gauge", "POST requests being served", [("", in_flight)])
    metric("http_requests_total", "counter", "HTTP requests by path and status",
           [(f'{{path="{p}",code="{c}"}}', n) for (p, c), n in counts])
    return "\n".join(lines) + "\n"


class _HTTPServer(ThreadingHTTPServer):
    """One thread per connection, a deep listen backlog, no join of handler threads at shutdown."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True


def _content_length(headers: Message) -> int:
    if headers.get("Transfer-Encoding"):
        raise BadRequest("chunked request bodies are not supported: send Content-Length", HTTPStatus.LENGTH_REQUIRED)
    raw = headers.get("Content-Length") or "0"
    if not raw.strip().isdigit():
        raise BadRequest(f"bad Content-Length {raw!r}")
    length = int(raw)
    if length > MAX_BODY:
        raise BadRequest(f"request body over {MAX_BODY} bytes", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    return length


def _json_body(raw: bytes, method: str) -> dict[str, Any]:
    if method == "GET":
        return {}
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _handler_class(server: EngineServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = SOCKET_TIMEOUT_S

        def log_message(self, format: str, *args: Any) -> None:  # quiet: /metrics counts requests
            pass

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def do_OTHER(self) -> None:  # PUT, DELETE, ...: 405 on a known path, 404 elsewhere (not stdlib's 501)
            self._handle(self.command)

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = do_OTHER

        def _read(self) -> bytes:
            try:
                length = _content_length(self.headers)
            except BadRequest:
                self.close_connection = True  # the body was not read: the stream is out of step
                raise
            return self.rfile.read(length) if length else b""

        def _handle(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            try:
                status, payload = server.handle(method, path, self._read())
            except BadRequest as e:
                status, payload = e.status, _error(str(e), e.status)
            except Exception as e:  # an engine failure is the server's error, and it keeps serving
                status, payload = HTTPStatus.INTERNAL_SERVER_ERROR, _error(f"{type(e).__name__}: {e}", 500)
            server.count(path, int(status))
            self._send(int(status), payload)

        def _send(self, status: int, payload: Any) -> None:
            text = isinstance(payload, str)
            data = payload.encode() if text else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == HTTPStatus.TOO_MANY_REQUESTS:
                self.send_header("Retry-After", "1")
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


def _error(message: str, status: int) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}
