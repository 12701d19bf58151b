"""The ``k3nn serve`` command: load a checkpoint (and a DSpark drafter), build the Engine, warm it up on the engine
thread while the port already answers ``/health`` with 503, then serve the OpenAI API with uvicorn until Ctrl-C or
SIGTERM (requests in flight get ``--shutdown-timeout`` seconds to finish, the rest are aborted; exit status 0).

:func:`add_parser` registers the subcommand on ``k3nn``'s parser; :func:`run` carries it out. Nothing here imports
the serving stack until the command runs, so ``k3nn --help`` works without the ``serve`` extra.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import socket
import threading
import time

__all__ = ["add_parser", "run", "parse_bytes"]

log = logging.getLogger("k3nn.serve")

_EXAMPLES = """examples:
  k3nn serve --model ~/.cache/k3nn/demo/model                       the demo model on 127.0.0.1:8000
  k3nn serve --model DIR --drafter DIR/../drafter --max-num-seqs 16  with DSpark speculative decoding
  k3nn serve --model moonshotai/Kimi-Linear-48B-A3B-Instruct --device cuda --cache-memory 40GiB --api-key KEY
then:
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'
"""


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"500MB"``, ``"1e9"`` or ``"1073741824"`` → bytes (K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of
    1024; a trailing B is optional)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not m:
        raise ValueError(f"--cache-memory must be a byte count such as 8GiB, 500MB or 1073741824; got {text!r}")
    unit = (m.group(2) or "").lower()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}[unit]
    n = int(float(m.group(1)) * scale)
    if n <= 0:
        raise ValueError(f"--cache-memory must be positive, got {text!r}")
    return n


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` to ``k3nn``'s subcommands; returns its parser."""
    from ..engine import EngineConfig

    d = EngineConfig()
    s = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server over the Engine (pip install 'k3nn[serve]')",
        description="Serve a checkpoint over HTTP with the OpenAI API: /v1/completions, /v1/chat/completions (the\n"
                    "checkpoint's chat template), /v1/models, /health, /metrics (Prometheus). Requests run in k3nn's\n"
                    "continuous-batching Engine (prefix caching, DSpark speculation with --drafter). Startup warms\n"
                    "the engine up (every step shape compiled and tuned); /health answers 200 once that finished.\n"
                    "Ctrl-C or SIGTERM: requests in flight get --shutdown-timeout seconds, then are aborted.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", required=True, help="checkpoint directory or hub repo id")
    from ..cli_args import add_threads_argument, directory_arg

    s.add_argument("--drafter", type=directory_arg,
                   help="DSpark drafter directory: speculative decoding inside the engine")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    s.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help=f"requests running at once, each holding a KDA state row (default {d.max_num_seqs})")
    cache = s.add_mutually_exclusive_group()
    cache.add_argument("--num-pages", type=int, default=None,
                       help=f"latent cache pages of 64 tokens (default {d.num_pages})")
    cache.add_argument("--cache-memory", default=None, metavar="BYTES",
                       help="size the cache by memory instead (e.g. 40GiB): split between latent pages and KDA "
                            "snapshot slots")
    s.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help=f"tokens scheduled per engine step (default {d.max_num_batched_tokens})")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens a request may hold (default: the model's max_position_embeddings, "
                        "capped by the cache)")
    s.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per verify window with --drafter (default: the drafter's block size); requests may "
                        "set num_speculative_tokens")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) requests use (default: --model as given); the first is reported")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template (file or text) instead of the checkpoint's")
    s.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: bf16 on GPU, fp32 on CPU)")
    s.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda when available)")
    s.add_argument("--backend", choices=["auto", "eager", "triton", "cuda"], default=None,
                   help="kernel backend (default auto)")
    s.add_argument("--revision", help="hub revision")
    s.add_argument("--offline", action="store_true", help="never touch the network (HF_HUB_OFFLINE=1)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight may take to finish after Ctrl-C / SIGTERM (default 30)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default info)")
    s.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    add_threads_argument(s)
    return s


def _check(args: argparse.Namespace) -> None:
    for name in ("max_num_seqs", "num_pages", "max_num_batched_tokens", "max_model_len"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 0:
        raise ValueError(f"--num-speculative-tokens must be >= 0, got {args.num_speculative_tokens}")
    if args.num_speculative_tokens is not None and not args.drafter:
        raise ValueError("--num-speculative-tokens needs --drafter")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    if args.served_model_name is not None and not all(args.served_model_name):
        raise ValueError("--served-model-name must not be empty")


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (checked before the model loads, so a busy port fails at once)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} is not an address this machine can listen on ({e})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    """Carry out ``k3nn serve`` (errors a user can fix raise ValueError / ImportError / FileNotFoundError)."""
    try:
        import fastapi  # noqa: F401
        import jinja2  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"k3nn serve needs {e.name!r}: pip install 'k3nn[serve]'", name=e.name) from None
    import os

    import torch

    from .. import KimiK3
    from ..checkpoint import resolve_checkpoint
    from ..engine import Engine, EngineConfig
    from ..tokenizer import load_tokenizer
    from .app import OpenAIServer, run_server
    from .async_engine import AsyncEngine
    from .chat import load_chat_template

    _check(args)
    from ..utils import configure_threads, resolve_device

    configure_threads(args.threads)
    if args.device is not None:
        args.device = str(resolve_device(args.device, "--device"))
    cache_bytes = parse_bytes(args.cache_memory) if args.cache_memory is not None else None
    logging.getLogger("k3nn.serve").setLevel(getattr(logging, args.log_level.upper()))
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
              "float16": torch.float16, "fp16": torch.float16}
    if args.dtype is not None and args.dtype not in dtypes:
        raise ValueError(f"--dtype must be one of float32, bfloat16, float16; got {args.dtype!r}")
    dtype = dtypes[args.dtype] if args.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    sock = _bind(args.host, args.port)
    try:
        t0 = time.perf_counter()
        path = resolve_checkpoint(args.model, revision=args.revision, local_files_only=args.offline or None)
        model = KimiK3.from_pretrained(path, dtype=dtype, device=device, backend=args.backend).eval()
        drafter = None
        if args.drafter:
            from ..layers.dspark import DSparkDrafter

            drafter = DSparkDrafter.from_pretrained(args.drafter, target=model, device=device, dtype=dtype).eval()
        tok = load_tokenizer(path, model.config.vocab_size)
        template = load_chat_template(path, args.chat_template)
        log.info("loaded %s (%s, %s, %.2fM parameters%s) in %.1f s; tokenizer %s; %s", args.model, device,
                 str(dtype).removeprefix("torch."), model.num_parameters() / 1e6,
                 f", drafter {args.drafter}" if drafter is not None else "", time.perf_counter() - t0,
                 type(tok).__name__.lstrip("_"),
                 f"chat template from {template.origin}" if template is not None
                 else "no chat template: /v1/chat/completions answers 400 (pass --chat-template)")
        cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           num_speculative_tokens=args.num_speculative_tokens,
                           **({"num_pages": None, "cache_memory_bytes": cache_bytes} if cache_bytes is not None
                              else {"num_pages": args.num_pages} if args.num_pages is not None else {}))
        engine = Engine(model, cfg, drafter=drafter, tokenizer=tok)
        capacity = engine.pools.allocator.num_blocks * engine.pools.block_size
        limit = min(model.config.max_position_embeddings, capacity)
        if args.max_model_len is not None and args.max_model_len > limit:
            raise ValueError(f"--max-model-len {args.max_model_len} exceeds what this engine can hold ({limit} "
                             f"tokens: max_position_embeddings {model.config.max_position_embeddings}, cache "
                             f"{capacity}); give more --num-pages / --cache-memory or a smaller --max-model-len")
        max_model_len = args.max_model_len or limit
        names = args.served_model_name or [args.model]
        server = OpenAIServer(AsyncEngine(engine), tok, served_model_names=names, max_model_len=max_model_len,
                              chat_template=template, api_key=args.api_key, root=str(path),
                              shutdown_timeout=max(60.0, args.shutdown_timeout))
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    log.info("serving %s at http://%s:%d/v1 (max_num_seqs %d, %d cache pages, max_model_len %d); warming up "
             "first: GET /health answers 200 when ready", names[0], host, port, args.max_num_seqs,
             engine.pools.allocator.num_blocks, max_model_len)
    # uvicorn handles Ctrl-C / SIGTERM while it runs, then re-raises the signal against the handler it found:
    # a quiet one here, so a graceful shutdown ends with exit status 0 rather than a KeyboardInterrupt.
    quiet = {}
    if threading.current_thread() is threading.main_thread():
        quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = run_server(server, sock=sock, log_level=args.log_level, access_log=not args.no_access_log,
                        shutdown_timeout=args.shutdown_timeout)
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)
        sock.close()
    log.info("k3nn serve stopped")
    return rc
