"""The ``k3nn`` command: ``info``, ``generate``, ``bench``, ``demo``.

Every error a user can cause is one line on stderr, ``k3nn <command>: error: <message>``, with exit status 2
(argparse's usage block is left out: ``--help`` prints it). :class:`ArgumentParser` and the ``*_arg`` types below
give every command that behaviour; a command reports its own errors by raising :class:`CommandError` (or a
``SystemExit`` with a message, or one of the library's argument errors).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
import time
import warnings
from pathlib import Path

__all__ = ["main", "ArgumentParser", "CommandError", "int_arg", "float_arg", "int_list_arg", "threads_arg",
           "dtype_arg", "nonempty_arg", "directory_arg", "add_threads_argument"]

from .cli_args import (EXIT_USAGE, ArgumentParser, CommandError, add_threads_argument, directory_arg,  # noqa: F401
                       dtype_arg, float_arg, int_arg, int_list_arg, nonempty_arg, threads_arg)
from .cli_args import configure_threads_arg as _configure_threads
from .cli_args import one_line as _one_line

# ---------------------------------------------------------------------------------------------------- info
def cmd_info(args: argparse.Namespace) -> int:
    import torch

    import k3nn
    from k3nn.kernels.registry import triton_interpreting

    try:
        import triton

        tv = triton.__version__
    except Exception as e:  # pragma: no cover
        tv = f"not importable ({e})"
    print(f"k3nn {k3nn.__version__}  torch {torch.__version__}  triton {tv}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"device: {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}")
    else:
        print("device: CPU only (no CUDA device): eager runs everywhere; Triton kernels need a GPU "
              "(or TRITON_INTERPRET=1 for slow CPU testing)")
    print(f"TRITON_INTERPRET: {'on' if triton_interpreting() else 'off'}   backend in force: {k3nn.current_backend()}")
    av = k3nn.available_backends()
    w = max(len(op) for op in av)
    print(f"\n{'op':<{w}}  eager  triton  cuda")
    for op, row in av.items():
        cells = ["ok" if row[b] == "ok" else "--" for b in ("eager", "triton", "cuda")]
        print(f"{op:<{w}}  {cells[0]:<5}  {cells[1]:<6}  {cells[2]}")
    reasons = {(b, row[b]) for row in av.values() for b in row if row[b] != "ok"}
    if reasons:
        print("\nwhy not:")
        for b, r in sorted(reasons):
            print(f"  {b}: {r}")
    print(f"\nMXFP4 decode GEMV inside the triton MoE backend: {_mx_gemv_line()}")
    print(f"MLA paged decode under auto: {_mla_decode_line()}")
    return 0


def _mla_decode_line() -> str:
    """Which MLA decode kernel ``auto`` takes here, and why."""
    from k3nn.kernels.mla import cuda_decode as cd

    why = cd.available()
    if why:
        return f"triton split-KV (the CUDA kernel does not run here: {why})"
    return ("cuda wgmma (built on first use), except triton split-KV for calls with Tq·H ≤ 64 and "
            f"B < {cd.MIN_ROW_CTAS}" + (" (one request)" if cd.MIN_ROW_CTAS == 2 else ""))


def _mx_gemv_line() -> str:
    """Which MXFP4 expert GEMV the fused MoE takes at decode sizes here (KernelTuning.moe_gemv), and why."""
    from k3nn.kernels.moe import cuda_mx_gemv as cm
    from k3nn.kernels.moe import triton_fused as tf
    from k3nn.kernels.registry import current_tuning

    impl = tf.gemv_impl()
    if impl == "triton":
        return "triton (KernelTuning.moe_gemv='triton')"
    why = cm.available()
    if why is None and tf._cuda_gemv_possible():
        return (f"cuda, built on first use (KernelTuning.moe_gemv={impl!r}; up to "
                f"{current_tuning().moe_cuda_gemv_pairs} token-expert pairs)")
    return (f"triton (KernelTuning.moe_gemv={impl!r}; the CUDA GEMV cannot run here: "
            f"{why or 'needs sm_89+ for its e4m3 decode'})")


# ------------------------------------------------------------------------------------------------ generate
DEFAULT_PROMPT = "def fibonacci(n):"
_SAMPLING_FLAGS = ("temperature", "top_k", "top_p")


def _check_generate_flags(args: argparse.Namespace) -> None:
    """Combinations argparse cannot express; a flag that would be ignored is an error."""
    if args.model is not None and args.preset is not None:
        raise CommandError("--preset builds a model with random weights; it cannot be combined with --model")
    if args.revision is not None and args.model is None:
        raise CommandError("--revision needs --model (a hub repo id)")
    if args.num_assistant_tokens is not None and args.drafter is None:
        raise CommandError("--num-assistant-tokens sets the speculative window of --drafter; pass --drafter DIR")


class _naming:
    """Context manager: a user error raised inside is re-raised as a CommandError that starts with the flag and
    its value (``--model DIR: <what went wrong>``)."""

    def __init__(self, flag: str, value):
        self.head = f"{flag} {value}: "

    def __enter__(self):
        return self

    def __exit__(self, tp, e, tb):
        if e is not None and isinstance(e, _user_errors()) and not isinstance(e, CommandError):
            raise CommandError(self.head + (str(e) or type(e).__name__)) from e
        return False


class _Echo:
    """stdout of a streamed generation: the prompt, then the new text; remembers whether a line is open, so an
    error printed to stderr starts on a line of its own."""

    def __init__(self):
        self.open_line = False

    def write(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.open_line = not text.endswith("\n")

    def close_line(self) -> None:
        if self.open_line:
            self.write("\n")


def cmd_generate(args: argparse.Namespace) -> int:
    _check_generate_flags(args)
    import torch

    from k3nn import KimiK3, KimiK3Config
    from k3nn.tokenizer import load_tokenizer
    from k3nn.utils import resolve_device

    threads = _configure_threads(args.threads)
    if args.device is not None:
        device = resolve_device(args.device, "--device")
        if device.type == "meta":
            raise CommandError("--device meta holds no data to generate with; use cpu or cuda")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    given = [f"--{k.replace('_', '-')}" for k in _SAMPLING_FLAGS if getattr(args, k) is not None]
    if given and not args.do_sample:
        print(f"k3nn generate: warning: {', '.join(given)} only apply when sampling; without --do-sample the "
              f"decoding is greedy and {'they are' if len(given) > 1 else 'it is'} ignored", file=sys.stderr)
    t0 = time.perf_counter()
    if args.model:
        from k3nn.checkpoint import resolve_checkpoint

        with _naming("--model", args.model):
            d = resolve_checkpoint(args.model, revision=args.revision, local_files_only=args.offline or None)
            model = KimiK3.from_pretrained(d, dtype=dtype, device=device, backend=args.backend)
        tok_dir = d
    else:
        name = args.preset or "small"
        print(f"[k3nn] no --model given: building KimiK3Config.{name}() with random weights "
              f"(output is noise; pass --model PATH|REPO for a trained checkpoint)", file=sys.stderr)
        model = KimiK3(getattr(KimiK3Config, name)(), device=device, dtype=dtype, backend=args.backend,
                       seed=args.seed or 0).eval()
        tok_dir = None
    vocab = model.config.vocab_size
    drafter = None
    if args.drafter:
        from k3nn.layers.dspark import DSparkDrafter

        with _naming("--drafter", args.drafter):
            drafter = DSparkDrafter.from_pretrained(args.drafter, target=model, device=device, dtype=dtype).eval()
    load_s = time.perf_counter() - t0
    tok = load_tokenizer(tok_dir, vocab)
    if args.input_ids is not None:
        ids = args.input_ids
        bad = [i for i in ids if i >= vocab]
        if bad:
            raise CommandError(f"--input-ids: token ids {bad} are outside [0, vocab_size={vocab})")
    else:
        ids = tok.encode(args.prompt if args.prompt is not None else DEFAULT_PROMPT)
        if not ids:
            raise CommandError(f"--prompt {args.prompt!r} encodes to no tokens")
    eos = args.eos_token_id
    if eos is not None and any(e >= vocab for e in eos):
        raise CommandError(f"--eos-token-id: ids {[e for e in eos if e >= vocab]} are outside "
                           f"[0, vocab_size={vocab})")
    limit = model.config.max_position_embeddings
    if len(ids) + args.max_new_tokens > limit:
        raise CommandError(f"--max-new-tokens {args.max_new_tokens}: the prompt's {len(ids)} tokens + "
                           f"{args.max_new_tokens} new ones exceed the model's max_position_embeddings = {limit}")
    input_ids = torch.tensor([ids], device=device)
    echo = _Echo()

    class _Stream:
        def __init__(self):
            self.first = True
            self.ids: list[int] = []
            self.printed = ""

        def put(self, v):
            if self.first:  # the prompt
                self.first = False
                return
            self.ids.append(int(v.reshape(-1)[0]))
            text = tok.decode(self.ids)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                echo.write(text[len(self.printed):])
                self.printed = text

        def end(self):
            echo.write("\n")

    sampling = {k: getattr(args, k) for k in _SAMPLING_FLAGS if args.do_sample and getattr(args, k) is not None}
    if drafter is not None:
        sampling["num_assistant_tokens"] = args.num_assistant_tokens or drafter.config.block_size
    from k3nn.kernels.registry import BackendUnavailableError

    try:
        echo.write(tok.decode(ids) if args.input_ids is None else "")
        t1 = time.perf_counter()
        out = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                             eos_token_id=eos, seed=args.seed, streamer=_Stream(), drafter=drafter, **sampling)
    except BaseException as e:
        echo.close_line()  # the error goes on a line of its own
        if isinstance(e, BackendUnavailableError) and args.backend not in (None, "auto"):
            raise CommandError(f"--backend {args.backend}: {e}") from None
        raise
    dt = time.perf_counter() - t1
    n = out.shape[1] - input_ids.shape[1]
    print(f"Prompt: {len(ids)} tokens | Generation: {n} tokens, {n / max(dt, 1e-9):.1f} tokens-per-sec | "
          f"load {load_s:.1f}s | device {device} | backend {args.backend or 'auto'}"
          + (f" | {threads} CPU thread(s)" if device.type == "cpu" else ""), file=sys.stderr)
    if drafter is not None and drafter.last_stats is not None:
        st = drafter.last_stats
        print(f"Speculative: acceptance length {st.acceptance_length:.2f} tokens per target forward, "
              f"acceptance rate {st.acceptance_rate:.2f} (γ={st.gamma})", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------- bench
_NO_CHECKOUT = ("the benchmark suites live in the bench/ folder of the k3nn repository, not in the installed "
                "package: clone the repository, install it editable from its root (bash scripts/setup.sh, or "
                "pip install -e '.[bench]'), then run 'k3nn bench SUITE' or 'python -m bench.SUITE' there")


def _checkout_root() -> Path:
    """The repository root when this k3nn runs from a checkout (``<root>/src/k3nn``, as the editable install of
    scripts/setup.sh or ``PYTHONPATH=src`` lays it out)."""
    return Path(__file__).resolve().parents[2]


def _bench_package():
    """The checkout's ``bench`` package (``<root>/bench``), imported as ``bench``; None outside a checkout."""
    init = _checkout_root() / "bench" / "__init__.py"
    if not init.is_file():
        return None
    mod = sys.modules.get("bench")
    if mod is not None:
        if Path(mod.__file__ or "").resolve() != init:
            raise CommandError(f"a different module named 'bench' is already imported ({mod.__file__})")
        return mod
    spec = importlib.util.spec_from_file_location("bench", init, submodule_search_locations=[str(init.parent)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def _suites_help(pkg) -> str:
    if pkg is None:
        return f"No suites here: {_NO_CHECKOUT}."
    w = max(map(len, pkg.SUITES))
    return "suites:\n" + "\n".join(f"  {name:<{w}}  {what}" for name, what in pkg.SUITES.items())


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    pkg = _bench_package()
    if args.suite is None:
        if rest:
            raise CommandError(f"unrecognized arguments before SUITE: {' '.join(rest)}")
        args.parser.epilog = _suites_help(pkg)
        if args.help:
            args.parser.print_help()
            return 0
        raise CommandError("a SUITE is required; 'k3nn bench --help' lists them")
    if pkg is None:
        raise CommandError(f"{_NO_CHECKOUT}.")
    if args.suite not in pkg.SUITES:
        raise CommandError(f"unknown suite {args.suite!r}; suites: {', '.join(pkg.SUITES)}")
    name = f"bench.{args.suite.replace('-', '_')}"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:  # a listed suite without its module: a broken checkout, not a missing extra
            raise
        raise CommandError(f"suite {args.suite!r} needs {e.name!r}: pip install 'k3nn[bench]'") from None
    if args.help or any(a in ("-h", "--help") for a in rest):  # the suite's own options
        mod.main(["--help"])
        return 0
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        raise CommandError(f"no CUDA device here. The suites time GPU kernels against their anchors (CPU timings "
                           "are not results); run on a GPU machine with k3nn installed (pip install -e '.[bench]'), "
                           "or pass --allow-cpu for a smoke run of the code path. Committed H200 results are in "
                           "bench/results/ and the README's table.")
    mod.main(rest)
    return 0


# ----------------------------------------------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace, rest: list[str]) -> int:
    from k3nn import demo

    return demo.main(rest)


# ---------------------------------------------------------------------------------------------------- serve
def cmd_serve(args: argparse.Namespace) -> int:
    from k3nn.serve import cli as serve_cli

    return serve_cli.run(args)


# ----------------------------------------------------------------------------------------------------- main
def build_parser() -> tuple[ArgumentParser, dict[str, ArgumentParser]]:
    """The ``k3nn`` parser and its subcommand parsers by name."""
    p = ArgumentParser(
        prog="k3nn", description="Kimi K3 family models and kernels in PyTorch.",
        epilog="examples:\n"
               "  k3nn demo                                   train a small K3 on CPU, then generate (minutes)\n"
               "  k3nn generate --model DIR --prompt 'def f(x):'\n"
               "  k3nn info                                   which kernel backends run here\n"
               "  k3nn bench kda-prefill                      GPU benchmark (results in bench/results/)\n"
               "'k3nn COMMAND --help' describes each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (backend choices, loading) and "
                   "tracebacks for errors")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    subs: dict[str, ArgumentParser] = {}

    subs["info"] = sub.add_parser(
        "info", help="versions, device, and which backends run each op here (and why not)",
        description="Print the versions (k3nn, torch, triton, CUDA), the device, whether the Triton "
                    "interpreter is on, and a table of ops x backends (eager / triton / cuda) with the "
                    "reason each unavailable backend is refused on this machine.")

    g = subs["generate"] = sub.add_parser(
        "generate", help="generate text from a checkpoint directory or hub repo id",
        description="Stream a completion of --prompt from a checkpoint (a local directory, or a hub repo id "
                    "read through the Hugging Face cache). The tokenizer is the checkpoint's tokenizer.json or "
                    "tiktoken.model. Statistics go to stderr.",
        epilog="examples:\n"
               "  k3nn generate --model ~/.cache/k3nn/demo/model --offline --prompt 'import os'\n"
               "  k3nn generate --model ~/.cache/k3nn/demo/model --drafter ~/.cache/k3nn/demo/drafter\n"
               "  k3nn generate --model moonshotai/Kimi-Linear-48B-A3B-Instruct --device cuda --do-sample --top-p 0.9",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--model", type=nonempty_arg, help="checkpoint directory or hub repo id (default: a random "
                   "--preset model)")
    g.add_argument("--preset", choices=["tiny", "small"], default=None,
                   help="without --model: build this preset with random weights (default small)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", type=nonempty_arg, default=None, help=f"prompt text (default {DEFAULT_PROMPT!r})")
    src.add_argument("--input-ids", type=int_list_arg(0), metavar="IDS", help="comma-separated token ids instead "
                     "of --prompt")
    g.add_argument("--max-new-tokens", type=int_arg(1), default=64, metavar="N", help="tokens to generate "
                   "(default 64)")
    g.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float_arg(0, lo_open=True), default=None,
                   help="sampling temperature, > 0 (default 1.0; needs --do-sample)")
    g.add_argument("--top-k", type=int_arg(0), default=None, metavar="K",
                   help="sample among the k most likely tokens (default: the model's generation config, else 50 as "
                        "in transformers; 0: off; needs --do-sample)")
    g.add_argument("--top-p", type=float_arg(0, 1, lo_open=True), default=None, metavar="P",
                   help="nucleus sampling mass in (0, 1] (default 1.0: off; needs --do-sample)")
    g.add_argument("--seed", type=int_arg(0, 2**64 - 1), default=None,
                   help="seed for sampling (and random --preset weights)")
    g.add_argument("--eos-token-id", type=int_list_arg(0), metavar="IDS", help="comma-separated stop ids")
    g.add_argument("--dtype", type=dtype_arg, help="float32 | bfloat16 | float16 (default: bf16 on GPU, fp32 on CPU)")
    g.add_argument("--device", type=nonempty_arg, help="cpu | cuda | cuda:N | mps (default: cuda when available)")
    g.add_argument("--backend", choices=["auto", "eager", "triton", "cuda"], default=None,
                   help="kernel backend (default auto: the fastest that runs here; see k3nn info)")
    g.add_argument("--drafter", type=directory_arg, help="DSpark drafter directory: speculative decoding "
                   "(k3nn demo trains one)")
    g.add_argument("--num-assistant-tokens", type=int_arg(1), default=None, metavar="N",
                   help="tokens drafted per step with --drafter, >= 1 (default: the drafter's block size)")
    g.add_argument("--revision", type=nonempty_arg, help="hub revision (branch, tag or commit) of --model")
    g.add_argument("--offline", action="store_true", help="never touch the network (HF_HUB_OFFLINE=1)")
    add_threads_argument(g)

    b = subs["bench"] = sub.add_parser(
        "bench", help="run a GPU benchmark suite of the repository's bench/ folder; extra args go to the suite",
        description="Time k3nn's kernels against their anchors side by side on a CUDA GPU and write\n"
                    "bench/results/<suite>-<date>.json (schema in docs/perf.md). The suites are the bench/ package\n"
                    "of a k3nn checkout: 'k3nn bench SUITE ARGS' runs what 'python -m bench.SUITE ARGS' runs from\n"
                    "its root. They need a GPU and the bench extra (pip install -e '.[bench]': fla-core,\n"
                    "matplotlib). 'k3nn bench SUITE --help' lists a suite's options; 'python scripts/make_readme.py'\n"
                    "turns the committed results into the README table.",
        formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    b.add_argument("suite", metavar="SUITE", nargs="?", help="a suite name (listed below)")
    b.add_argument("--allow-cpu", action="store_true",
                   help="run without a GPU anyway: a smoke test of the code path, the timings mean nothing")
    b.add_argument("-h", "--help", action="store_true", help="this help, or with SUITE the suite's options")
    b.set_defaults(parser=b)

    subs["demo"] = sub.add_parser(
        "demo", help="train a small K3 on Python source, then generate with and without speculation", add_help=False)
    from k3nn.serve import cli as serve_cli

    subs["serve"] = serve_cli.add_parser(sub)
    return p, subs


# commands that take the rest of the command line themselves (their own parser)
_PASSTHROUGH = {"bench": cmd_bench, "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    """Run the ``k3nn`` command line (``argv``: the arguments after ``k3nn``; default ``sys.argv[1:]``) and return
    its exit status: 0 on success, 2 for a user error (printed as one line, see the module docstring), 130 when
    interrupted. ``-v`` shows tracebacks instead.

    Example::

        from k3nn.cli import main
        main(["generate", "--preset", "tiny", "--input-ids", "1,2,3", "--max-new-tokens", "4"])
    """
    p, subs = build_parser()
    args, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="[%(name)s] %(message)s")
    cmd = args.cmd
    if cmd not in _PASSTHROUGH and rest:
        subs[cmd].error(f"unrecognized arguments: {' '.join(rest)}")

    def show(message, category, filename, lineno, file=None, line=None):  # a warning is one line too
        print(f"k3nn {cmd}: warning: {_one_line(str(message))}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = show
            if cmd in _PASSTHROUGH:
                return _PASSTHROUGH[cmd](args, rest)
            return {"info": cmd_info, "generate": cmd_generate, "serve": cmd_serve}[cmd](args)
    except SystemExit as e:
        if not isinstance(e.code, str):  # argparse's exit (help, or an error it already printed)
            raise
        if args.verbose:
            raise
        _error(cmd, e.code)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"k3nn {cmd}: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:  # a message, not a traceback (-v shows the traceback)
        if args.verbose:
            raise
        msg = str(e) or type(e).__name__
        if isinstance(e, ImportError) and e.name and "pip install" not in msg:
            msg += " (pip install -e '.[demo,bench]' installs k3nn's optional dependencies)"
        _error(cmd, msg)
        return EXIT_USAGE


def _error(cmd: str, message: str) -> None:
    sys.stdout.flush()
    prefix = f"k3nn {cmd}: "
    message = _one_line(message)
    if message.startswith(prefix):  # a message that already names the command
        message = message[len(prefix):]
    if not message.startswith("error: "):
        message = "error: " + message
    print(prefix + message, file=sys.stderr)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message tells a user what to do (bad arguments, ids, files, configs, devices, memory): printed
    as one line without a traceback (``-v`` shows it)."""
    import torch

    from k3nn.checkpoint.io import CheckpointError
    from k3nn.kernels.registry import BackendUnavailableError

    return (CommandError, CheckpointError, BackendUnavailableError, OSError, ImportError, ValueError, TypeError,
            NotImplementedError, FloatingPointError, torch.OutOfMemoryError)


if __name__ == "__main__":
    sys.exit(main())
