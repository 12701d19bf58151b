"""Argument types and the parser of the ``k3nn`` commands (``k3nn.cli``, the demo, ``k3nn serve``): every error a
user can cause is one line on stderr, ``k3nn <command>: error: <message>``, with exit status 2 (argparse's usage
block is left out: ``--help`` prints it). A command reports its own errors by raising :class:`CommandError`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

__all__ = ["EXIT_USAGE", "ArgumentParser", "CommandError", "int_arg", "float_arg", "int_list_arg", "threads_arg",
           "dtype_arg", "nonempty_arg", "directory_arg", "add_threads_argument", "configure_threads_arg",
           "one_line"]

EXIT_USAGE = 2  # argparse's status for a usage error; every user error here uses it


class CommandError(Exception):
    """A user error a command reports as ``k3nn <command>: error: <message>`` (exit status 2)."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line: ``<prog>: error: <message>`` on stderr, exit 2.

    Subparsers made with ``add_subparsers().add_parser`` inherit the class."""

    def error(self, message: str):
        """Print ``<prog>: error: <message> (see '<prog> --help')`` on one line to stderr and exit with status 2."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see '{self.prog} --help')\n")


def one_line(message: str) -> str:
    """A (possibly multi-line) message as one line: lines joined with '; ' (or a space after a colon)."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    out = lines[0] if lines else ""
    for ln in lines[1:]:
        out += (" " if out.endswith(":") else "; ") + ln
    return out


# ------------------------------------------------------------------------------------- argument types
def int_arg(lo: int | None = None, hi: int | None = None):
    """An argparse ``type``: an integer in [lo, hi] (either bound optional)."""
    def parse(s: str) -> int:
        try:
            v = int(s.strip())
        except ValueError:
            v = None
        if v is None or (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = (f" in [{lo}, {hi}]" if lo is not None and hi is not None else f" >= {lo}" if lo is not None
                   else f" <= {hi}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"expected an integer{rng}, got {s!r}")
        return v

    parse.__name__ = "int"
    return parse


def float_arg(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False):
    """An argparse ``type``: a finite number in the interval given by ``lo`` / ``hi`` (open ends optional)."""
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            v = math.nan
        ok = math.isfinite(v) and (lo is None or (v > lo if lo_open else v >= lo)) and \
            (hi is None or (v < hi if hi_open else v <= hi))
        if not ok:
            if lo is not None and hi is not None:
                rng = f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
            elif lo is not None:
                rng = f" {'>' if lo_open else '>='} {lo:g}"
            elif hi is not None:
                rng = f" {'<' if hi_open else '<='} {hi:g}"
            else:
                rng = ""
            raise argparse.ArgumentTypeError(f"expected a finite number{rng}, got {s!r}")
        return v

    parse.__name__ = "float"
    return parse


def int_list_arg(lo: int = 0):
    """An argparse ``type``: comma-separated integers >= ``lo`` (at least one)."""
    def parse(s: str) -> list[int]:
        parts = [p.strip() for p in s.split(",")]
        try:
            vals = [int(p) for p in parts]
        except ValueError:
            vals = None
        if not vals or any(v < lo for v in vals):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {lo} (e.g. 1,2,3), got {s!r}")
        return vals

    parse.__name__ = "int list"
    return parse


def threads_arg(s: str):
    """An argparse ``type``: ``auto`` or a positive integer (see :func:`k3nn.utils.configure_threads`)."""
    from k3nn.utils import parse_threads

    try:
        return parse_threads(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {s!r}") from None


_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "fp16": "float16"}


def dtype_arg(s: str) -> str:
    """An argparse ``type``: float32 | bfloat16 | float16 (or fp32 / bf16 / fp16) → the long name."""
    try:
        return _DTYPE_NAMES[s.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected one of float32, bfloat16, float16 (or fp32, bf16, fp16), "
                                         f"got {s!r}") from None


def nonempty_arg(s: str) -> str:
    """An argparse ``type``: any non-empty string."""
    if not s:
        raise argparse.ArgumentTypeError("expected a non-empty string, got ''")
    return s


def directory_arg(s: str) -> Path:
    """An argparse ``type``: an existing directory."""
    p = Path(s).expanduser()
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"{s!r} is not a directory" if p.exists() else f"no such directory: {s!r}")
    return p


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads auto|N`` as every k3nn command spells it (apply it with :func:`k3nn.utils.configure_threads`)."""
    parser.add_argument("--threads", type=threads_arg, default="auto", metavar="auto|N",
                        help="torch CPU threads: a number, or auto (default): $OMP_NUM_THREADS when set, else the "
                             "cores other processes leave idle, at most 4 (intra-op threads spin-wait, so on a "
                             "busy machine fewer threads decode faster)")


def configure_threads_arg(value) -> int:
    """Apply a ``--threads`` value (:func:`k3nn.utils.configure_threads`); a bad environment value is a
    :class:`CommandError`."""
    from k3nn.utils import configure_threads

    try:
        return configure_threads(value)
    except ValueError as e:  # a malformed OMP_NUM_THREADS
        raise CommandError(str(e)) from None
