"""The ``k3nn`` command: ``info``, ``generate``, ``bench``, ``demo``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

__all__ = ["main"]

def _torch_dtype(name: str):
    import torch

    try:
        return {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                "fp16": torch.float16, "float16": torch.float16}[name]
    except KeyError:
        raise SystemExit(f"--dtype must be one of float32, bfloat16, float16; got {name!r}") from None


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
def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from k3nn import KimiK3, KimiK3Config
    from k3nn.tokenizer import load_tokenizer

    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _torch_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
    t0 = time.perf_counter()
    if args.model:
        from k3nn.checkpoint import resolve_checkpoint

        d = resolve_checkpoint(args.model, revision=args.revision, local_files_only=args.offline or None)
        model = KimiK3.from_pretrained(d, dtype=dtype, device=device, backend=args.backend)
        tok_dir = d
    else:
        preset = getattr(KimiK3Config, args.preset)
        print(f"[k3nn] no --model given: building KimiK3Config.{args.preset}() with random weights "
              f"(output is noise; pass --model PATH|REPO for a trained checkpoint)", file=sys.stderr)
        model = KimiK3(preset(), device=device, dtype=dtype, backend=args.backend, seed=args.seed or 0).eval()
        tok_dir = None
    drafter = None
    if args.drafter:
        from k3nn.layers.dspark import DSparkDrafter

        drafter = DSparkDrafter.from_pretrained(args.drafter, target=model, device=device, dtype=dtype).eval()
    load_s = time.perf_counter() - t0
    tok = load_tokenizer(tok_dir, model.config.vocab_size)
    if args.input_ids:
        try:
            ids = [int(x) for x in args.input_ids.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--input-ids must be comma-separated integers, got {args.input_ids!r}") from None
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        raise SystemExit("the prompt is empty: pass --prompt TEXT or --input-ids 1,2,3")
    input_ids = torch.tensor([ids], device=device)

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
                sys.stdout.write(text[len(self.printed):])
                sys.stdout.flush()
                self.printed = text

        def end(self):
            sys.stdout.write("\n")
            sys.stdout.flush()

    eos = [int(x) for x in args.eos_token_id.split(",")] if args.eos_token_id else None
    sys.stdout.write(tok.decode(ids) if not args.input_ids else "")
    t1 = time.perf_counter()
    out = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=eos,
                         seed=args.seed, streamer=_Stream(), drafter=drafter,
                         **({"num_assistant_tokens": args.num_assistant_tokens or drafter.config.block_size}
                            if drafter is not None else {}))
    dt = time.perf_counter() - t1
    n = out.shape[1] - input_ids.shape[1]
    print(f"Prompt: {len(ids)} tokens | Generation: {n} tokens, {n / max(dt, 1e-9):.1f} tokens-per-sec | "
          f"load {load_s:.1f}s | device {device} | backend {args.backend or 'auto'}", file=sys.stderr)
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
            raise SystemExit(f"k3nn bench: a different module named 'bench' is already imported ({mod.__file__})")
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
        args.parser.epilog = _suites_help(pkg)
        args.parser.print_help()
        return 0 if args.help else 2
    if pkg is None:
        raise SystemExit(f"k3nn bench: {_NO_CHECKOUT}.")
    if args.suite not in pkg.SUITES:
        raise SystemExit(f"unknown suite {args.suite!r}; suites: {', '.join(pkg.SUITES)}")
    name = f"bench.{args.suite.replace('-', '_')}"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:  # a listed suite without its module: a broken checkout, not a missing extra
            raise
        raise SystemExit(f"suite {args.suite!r} needs {e.name!r}: pip install 'k3nn[bench]'") from None
    if args.help or any(a in ("-h", "--help") for a in rest):  # the suite's own options
        mod.main(["--help"])
        return 0
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit(f"k3nn bench {args.suite}: no CUDA device here. The suites time GPU kernels against their "
                         "anchors (CPU timings are not results); run on a GPU machine with k3nn installed "
                         "(pip install -e '.[bench]'), or pass --allow-cpu for a smoke run of the code path. "
                         "Committed H200 results are in bench/results/ and the README's table.")
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="k3nn", description="Kimi K3 family models and kernels in PyTorch.",
        epilog="examples:\n"
               "  k3nn demo                                   train a small K3 on CPU, then generate (minutes)\n"
               "  k3nn generate --model DIR --prompt 'def f(x):'\n"
               "  k3nn info                                   which kernel backends run here\n"
               "  k3nn bench kda-prefill                      GPU benchmark (results in bench/results/)\n"
               "'k3nn COMMAND --help' describes each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (backend choices, loading)")
    sub = p.add_subparsers(dest="cmd", required=True)

    sub.add_parser("info", help="versions, device, and which backends run each op here (and why not)",
                   description="Print the versions (k3nn, torch, triton, CUDA), the device, whether the Triton "
                               "interpreter is on, and a table of ops x backends (eager / triton / cuda) with the "
                               "reason each unavailable backend is refused on this machine.")

    g = sub.add_parser(
        "generate", help="generate text from a checkpoint directory or hub repo id",
        description="Stream a completion of --prompt from a checkpoint (a local directory, or a hub repo id "
                    "read through the Hugging Face cache). The tokenizer is the checkpoint's tokenizer.json or "
                    "tiktoken.model. Statistics go to stderr.",
        epilog="examples:\n"
               "  k3nn generate --model ~/.cache/k3nn/demo/model --offline --prompt 'import os'\n"
               "  k3nn generate --model ~/.cache/k3nn/demo/model --drafter ~/.cache/k3nn/demo/drafter\n"
               "  k3nn generate --model moonshotai/Kimi-Linear-48B-A3B-Instruct --device cuda --do-sample --top-p 0.9",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--model", help="checkpoint directory or hub repo id (default: a random --preset model)")
    g.add_argument("--preset", default="small", choices=["tiny", "small"], help="model built when --model is absent")
    g.add_argument("--prompt", default="def fibonacci(n):", help="prompt text")
    g.add_argument("--input-ids", help="comma-separated token ids instead of --prompt")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    g.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely tokens (default: the model's generation config, else 50 as "
                        "in transformers; 0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (and random --preset weights)")
    g.add_argument("--eos-token-id", help="comma-separated stop ids")
    g.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: bf16 on GPU, fp32 on CPU)")
    g.add_argument("--device", help="cpu | cuda (default: cuda when available)")
    g.add_argument("--backend", choices=["auto", "eager", "triton", "cuda"], default=None,
                   help="kernel backend (default auto: the fastest that runs here; see k3nn info)")
    g.add_argument("--drafter", help="DSpark drafter directory: speculative decoding (k3nn demo trains one)")
    g.add_argument("--num-assistant-tokens", type=int, default=None,
                   help="tokens drafted per step with --drafter (default: the drafter's block size)")
    g.add_argument("--revision", help="hub revision")
    g.add_argument("--offline", action="store_true", help="never touch the network (HF_HUB_OFFLINE=1)")

    b = sub.add_parser(
        "bench", help="run a GPU benchmark suite of the repository's bench/ folder; extra args go to the suite",
        description="Time k3nn's kernels against their anchors side by side on a CUDA GPU and write\n"
                    "bench/results/<suite>-<date>.json (schema in PERF.md). The suites are the bench/ package of a\n"
                    "k3nn checkout: 'k3nn bench SUITE ARGS' runs what 'python -m bench.SUITE ARGS' runs from its root.\n"
                    "They need a GPU and the bench extra (pip install -e '.[bench]': fla-core, matplotlib).\n"
                    "'k3nn bench SUITE --help' lists a suite's options; 'python scripts/make_readme.py' turns the\n"
                    "committed results into the README table.",
        formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    b.add_argument("suite", metavar="SUITE", nargs="?", help="a suite name (listed below)")
    b.add_argument("--allow-cpu", action="store_true",
                   help="run without a GPU anyway: a smoke test of the code path, the timings mean nothing")
    b.add_argument("-h", "--help", action="store_true", help="this help, or with SUITE the suite's options")
    b.set_defaults(parser=b)

    sub.add_parser("demo", help="train a small K3 on Python source, then generate with and without speculation",
                   add_help=False)
    from k3nn.serve import cli as serve_cli

    serve_cli.add_parser(sub)

    args, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="[%(name)s] %(message)s")
    if args.cmd not in ("bench", "demo") and rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.cmd == "bench":
            return cmd_bench(args, rest)
        if args.cmd == "demo":
            return cmd_demo(args, rest)
        return {"info": cmd_info, "generate": cmd_generate, "serve": cmd_serve}[args.cmd](args)
    except _user_errors() as e:  # a message, not a traceback (-v shows the traceback)
        if args.verbose:
            raise
        msg = str(e) or type(e).__name__
        if isinstance(e, ImportError) and e.name and "pip install" not in msg:
            msg += " (pip install -e '.[demo,bench]' installs k3nn's optional dependencies)"
        print(f"k3nn {args.cmd}: error: {msg}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message tells a user what to do (bad arguments, ids, files, configs): printed as one line
    without a traceback (``-v`` shows it)."""
    from k3nn.checkpoint.io import CheckpointError
    from k3nn.kernels.registry import BackendUnavailableError

    return (CheckpointError, BackendUnavailableError, FileNotFoundError, ImportError, ValueError, TypeError)


if __name__ == "__main__":
    sys.exit(main())
