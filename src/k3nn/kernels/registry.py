"""Backend registry: every op has an eager reference and optional Triton / CUDA implementations.

Each implementation states, as data, what it can run (``available()`` for the machine, ``supports(*args)``
for a given call); both return ``None`` when fine or a short reason string when not. Dispatch picks:

* an explicit backend (``k3nn.backend("triton")``, ``KimiK3(cfg, backend=...)``, env ``K3NN_BACKEND``):
  that implementation or a :class:`BackendUnavailableError` listing why it was refused;
* ``"auto"`` (default): the first of cuda → triton → eager that can run the call and does not step aside
  for it (``auto_skip``: a kernel that runs the call but is known to be slower there than the next one). Auto
  never picks an interpreted Triton kernel (``TRITON_INTERPRET=1`` is for tests) and never picks an
  implementation marked ``exact=False`` (one whose numerics differ from the reference beyond rounding).

Kernel parameters that are not a backend (autotuning, the thresholds of per-shape heuristics, pinned tiles) live
in one typed object, :class:`KernelTuning`, read per call by the kernels: ``with tuning(autotune=False): ...``.
The environment holds only ``K3NN_BACKEND`` here (see ``docs/architecture.md`` for every variable k3nn reads).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

BACKENDS = ("eager", "triton", "cuda")
_CHOICES = BACKENDS + ("auto",)
AUTO_ORDER = ("cuda", "triton", "eager")

__all__ = ["BACKENDS", "BackendUnavailableError", "KernelTuning", "register", "dispatch", "backend",
           "current_backend", "current_tuning", "tuning", "uncaptured_step", "available_backends", "get_op", "ops",
           "resolve", "triton_interpreting"]


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run this call; the message lists every reason."""


def _check_name(name: str, what: str = "backend") -> str:
    if not isinstance(name, str) or name.lower() not in _CHOICES:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(_CHOICES)}")
    return name.lower()


_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("k3nn_backend", default=None)


def current_backend() -> str:
    """The backend in force: innermost ``k3nn.backend(...)``, else ``$K3NN_BACKEND``, else ``"auto"``."""
    v = _current.get()
    if v is not None:
        return v
    env = os.environ.get("K3NN_BACKEND")
    return _check_name(env, "K3NN_BACKEND value") if env else "auto"


@contextlib.contextmanager
def backend(name: str | None) -> Iterator[str]:
    """Context manager that selects the kernel backend for ops called inside it (restores on exit).

    ``None`` leaves the current choice unchanged (handy for optional per-model settings).
    """
    if name is None:
        yield current_backend()
        return
    tok = _current.set(_check_name(name))
    try:
        yield _current.get()  # type: ignore[misc]
    finally:
        _current.reset(tok)


@dataclass(frozen=True)
class KernelTuning:
    """Kernel parameters below the choice of backend; every field's default is what the kernels do untuned.

    Fields:
        autotune: Triton kernels with several candidate configs (the KDA chunk forward and backward, the MoE
            grouped GEMMs) and the Triton MLA decode plan time their candidates on the first call per shape.
            False: the first config / the heuristic plan, no timing (quick GPU tests). A shape keeps the choice
            made on its first call.
        kda_decode_head_min: B·H from which the Triton fused KDA decode takes its ``head`` kernel (one program
            per request-head); smaller calls take ``split`` (column blocks of a head in parallel). 1 sends every
            call to ``head``, a huge value every call to ``split``.
        mla_decode_tile: pins the Triton MLA decode tile, ``(bh, bn, warps, stages[, lazy, sv, ahead, opaque,
            tma])`` (see :func:`k3nn.kernels.mla.triton_decode.pinned_tile`); the split count stays per shape.
            None: the tuned (or heuristic) plan.
        mla_cluster: CTAs per thread-block cluster of the CUDA (wgmma) MLA decode kernel's split merge, 1 to 8
            (1: no cluster, a combine kernel merges the splits). None: the kernel's plan decides per shape.
        moe_gemv: the MXFP4 expert GEMV of the fused MoE at decode sizes: ``"auto"`` the CUDA kernel where it
            builds and takes the inputs, else the Triton one; ``"cuda"`` the same but one warning when the CUDA
            kernel cannot run; ``"triton"`` the Triton one always.
        moe_gemv_pairs: MXFP4 experts with at most this many (token, slot) pairs take the Triton weight-streaming
            GEMV instead of the grouped GEMMs (0: never).
        moe_cuda_gemv_pairs: the same limit where the CUDA GEMV runs (0: never; the default is where it stops
            beating the grouped GEMMs at K3's expert shape, ``docs/perf.md``).
        moe_cuda_pdl: the CUDA GEMV launches its down kernel as a programmatic dependent of the up kernel
            (sm_90+ only; False: plain stream order).
        pdl: programmatic dependent launch for the Triton decode kernels (sm_90+ only; :mod:`k3nn.kernels.pdl`):
            the skinny GEMM launches as a dependent of the kernel before it and prefetches its first weight tiles
            into L2 before waiting for it; the short kernels in front of it release it early. False: plain
            stream order.
        skinny_linear: the Triton skinny GEMM of ``ops.linear`` (at most 16 rows) under ``auto``: ``"auto"`` where
            the measured rule of :mod:`k3nn.kernels.linear.tuned` says it beats torch's GEMM; ``"always"`` wherever
            it runs; ``"never"``: torch's GEMM (an explicit ``backend("triton")`` still runs the kernel).
    """

    autotune: bool = True
    kda_decode_head_min: int = 256
    mla_decode_tile: tuple[int, ...] | None = None
    mla_cluster: int | None = None
    moe_gemv: str = "auto"
    moe_gemv_pairs: int = 64
    moe_cuda_gemv_pairs: int = 1024
    moe_cuda_pdl: bool = True
    pdl: bool = True
    skinny_linear: str = "auto"
    uncaptured: bool = False

    def __post_init__(self):
        if not isinstance(self.autotune, bool):
            raise TypeError(f"KernelTuning.autotune must be a bool, got {self.autotune!r}")
        if isinstance(self.kda_decode_head_min, bool) or not isinstance(self.kda_decode_head_min, int) \
                or self.kda_decode_head_min < 0:
            raise ValueError(f"KernelTuning.kda_decode_head_min must be an int >= 0, got {self.kda_decode_head_min!r}")
        t = self.mla_decode_tile
        if t is not None:
            if not isinstance(t, tuple) or not 4 <= len(t) <= 9 or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in t):
                raise ValueError("KernelTuning.mla_decode_tile must be None or a tuple of 4 to 9 ints "
                                 f"(bh, bn, warps, stages[, lazy, sv, ahead, opaque, tma]), got {t!r}")
        c = self.mla_cluster
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 8):
            raise ValueError(f"KernelTuning.mla_cluster must be None or an int in 1..8, got {c!r}")
        if self.moe_gemv not in ("auto", "cuda", "triton"):
            raise ValueError(f"KernelTuning.moe_gemv must be 'auto', 'cuda' or 'triton', got {self.moe_gemv!r}")
        for name in ("moe_gemv_pairs", "moe_cuda_gemv_pairs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"KernelTuning.{name} must be an int >= 0, got {v!r}")
        for name in ("moe_cuda_pdl", "pdl", "uncaptured"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"KernelTuning.{name} must be a bool, got {getattr(self, name)!r}")
        if self.skinny_linear not in ("auto", "always", "never"):
            raise ValueError("KernelTuning.skinny_linear must be 'auto', 'always' or 'never', got "
                             f"{self.skinny_linear!r}")


_tuning: contextvars.ContextVar[KernelTuning] = contextvars.ContextVar("k3nn_tuning", default=KernelTuning())


def current_tuning() -> KernelTuning:
    """The :class:`KernelTuning` in force: the innermost ``tuning(...)``, else the defaults."""
    return _tuning.get()


@contextlib.contextmanager
def tuning(config: KernelTuning | None = None, /, **changes: Any) -> Iterator[KernelTuning]:
    """Context manager that sets kernel tuning for calls inside it (restores on exit): a whole
    :class:`KernelTuning`, and/or field changes on top of the current one (``tuning(autotune=False)``)."""
    names = {f.name for f in fields(KernelTuning)}
    bad = sorted(set(changes) - names)
    if bad:
        raise TypeError(f"tuning(): unknown field(s) {', '.join(bad)}; KernelTuning has {', '.join(sorted(names))}")
    if config is not None and not isinstance(config, KernelTuning):
        raise TypeError(f"tuning(): expected a KernelTuning, got {type(config).__name__}")
    tok = _tuning.set(replace(config if config is not None else _tuning.get(), **changes))
    try:
        yield _tuning.get()
    finally:
        _tuning.reset(tok)


def uncaptured_step() -> contextlib.AbstractContextManager[KernelTuning]:
    """Context of a step that runs without a CUDA graph for good: ``tuning(uncaptured=True)``
    (:attr:`KernelTuning.uncaptured`)."""
    return tuning(uncaptured=True)


def autotune_prune(configs: list, named_args: dict, **kwargs: Any) -> list:
    """``early_config_prune`` for ``triton.autotune``: every candidate, or only the first one when
    :attr:`KernelTuning.autotune` is off (the autotuner then times nothing)."""
    return configs if current_tuning().autotune else configs[:1]


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None


def triton_interpreting() -> bool:
    """``TRITON_INTERPRET`` is set (Triton kernels then run on CPU tensors, slowly: for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_ready(*tensors: Any) -> str | None:
    """Shared availability rule for Triton kernels: CUDA tensors, or CPU tensors under the interpreter."""
    err = _triton_import_error()
    if err:
        return err
    devs = {t.device.type for t in tensors if hasattr(t, "device")}
    if devs <= {"cuda"} and devs:
        return None
    if devs <= {"cpu"} and triton_interpreting():
        return None
    if "cpu" in devs:
        return "inputs are on the CPU and TRITON_INTERPRET=1 is not set"
    return f"inputs are on {sorted(devs)}; Triton kernels need CUDA tensors"


@dataclass
class Impl:
    op: str
    backend: str
    fn: Callable[..., Any]
    supports: Callable[..., str | None] | None = None  # per-call check; None = supports everything
    available: Callable[[], str | None] | None = None  # machine check
    exact: bool = True  # same numerics as the reference up to rounding; auto only picks exact impls
    auto_skip: Callable[..., str | None] | None = None  # per call: why auto passes over it (runnable but slower)

    def why_not(self, args: tuple, kwargs: dict) -> str | None:
        if self.available is not None:
            r = self.available()
            if r:
                return r
        if self.supports is not None:
            try:
                return self.supports(*args, **kwargs)
            except Exception as e:  # a supports() bug must not hide the real error path
                return f"supports() check failed: {type(e).__name__}: {e}"
        return None


@dataclass
class Op:
    name: str
    impls: dict[str, Impl] = field(default_factory=dict)
    doc: str = ""


_OPS: dict[str, Op] = {}
_logged: set[tuple[str, str]] = set()


def register(op: str, backend: str, *, supports: Callable[..., str | None] | None = None,
             available: Callable[[], str | None] | None = None, exact: bool = True,
             auto_skip: Callable[..., str | None] | None = None):
    """Decorator: register ``fn`` as the ``backend`` implementation of ``op``. ``auto_skip(*args, **kwargs)``:
    None, or why ``auto`` should take the next backend for this call although this one can run it (an
    explicit ``backend(...)`` still runs it)."""
    backend = _check_name(backend)
    if backend == "auto":
        raise ValueError("register(): 'auto' is not a backend")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        o = _OPS.setdefault(op, Op(op))
        o.impls[backend] = Impl(op, backend, fn, supports, available, exact, auto_skip)
        return fn

    return deco


def get_op(name: str) -> Op:
    """The registered op ``name`` (its implementations per backend); KeyError listing the registered ops."""
    if name not in _OPS:
        _load_all()
    if name not in _OPS:
        raise KeyError(f"unknown op {name!r}; registered: {sorted(_OPS)}")
    return _OPS[name]


def ops() -> dict[str, Op]:
    """Every registered op by name (importing the kernel packages that register them)."""
    _load_all()
    return dict(_OPS)


def resolve(op: str, args: tuple = (), kwargs: dict | None = None, backend_name: str | None = None) -> Impl:
    """Choose the implementation of ``op`` for this call (see module docstring)."""
    kwargs = kwargs or {}
    o = get_op(op)
    want = _check_name(backend_name) if backend_name else current_backend()
    if want != "auto":
        impl = o.impls.get(want)
        if impl is None:
            raise BackendUnavailableError(
                f"{op}: backend {want!r} is not implemented for this op\n{_reasons(o, args, kwargs)}")
        why = impl.why_not(args, kwargs)
        if why:
            others = _reasons(o, args, kwargs)
            raise BackendUnavailableError(f"{op}: backend {want!r} cannot run this call: {why}\n{others}")
        return impl
    for name in AUTO_ORDER:
        impl = o.impls.get(name)
        if impl is None or not impl.exact:
            continue
        if name == "triton" and triton_interpreting():
            continue
        # auto_skip first: a kernel auto passes over for this call is not probed (nor built) for it
        if _skip_reason(impl, args, kwargs) is None and impl.why_not(args, kwargs) is None:
            if (op, name) not in _logged:
                _logged.add((op, name))
                log.debug("%s: auto picked %s", op, name)
            return impl
    raise BackendUnavailableError(f"{op}: no backend can run this call\n{_reasons(o, args, kwargs)}")


def _skip_reason(impl: Impl, args: tuple, kwargs: dict) -> str | None:
    if impl.auto_skip is None:
        return None
    try:
        return impl.auto_skip(*args, **kwargs)
    except Exception as e:  # like supports(): a bug here must not hide the real error path
        return f"auto_skip() check failed: {type(e).__name__}: {e}"


def _reasons(o: Op, args: tuple, kwargs: dict) -> str:
    lines = []
    for name in BACKENDS:
        impl = o.impls.get(name)
        if impl is None:
            lines.append(f"  {name}: not implemented")
        else:
            why = impl.why_not(args, kwargs)
            skip = None if why else _skip_reason(impl, args, kwargs)
            lines.append(f"  {name}: {why or (f'auto passes over it: {skip}' if skip else 'ok')}")
    return "\n".join(lines)


def dispatch(op: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``op`` on the implementation :func:`resolve` picks for these arguments under the backend in force.

    Example::

        y = dispatch("rms_norm", x, weight, 1e-6)   # what k3nn.ops.rms_norm does after validating
    """
    return resolve(op, args, kwargs).fn(*args, **kwargs)


def available_backends() -> dict[str, dict[str, str]]:
    """Per op: each backend's status on this machine (``"ok"`` or the reason it cannot run)."""
    out: dict[str, dict[str, str]] = {}
    for name, o in sorted(ops().items()):
        row = {}
        for b in BACKENDS:
            impl = o.impls.get(b)
            if impl is None:
                row[b] = "not implemented"
            else:
                r = impl.available() if impl.available else None
                if not r and b in ("triton", "cuda"):
                    r = _gpu_missing(b)
                row[b] = r or "ok"
        out[name] = row
    return out


def _gpu_missing(b: str) -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    if b == "triton" and triton_interpreting():
        return None
    return ("no CUDA device (Triton kernels run on NVIDIA GPUs; TRITON_INTERPRET=1 runs them slowly on CPU "
            "for testing)") if b == "triton" else "no CUDA device"


_KERNEL_PACKAGES = ("kda", "mla", "moe", "attnres", "mxfp4", "norm", "glu", "linear")


def _load_all() -> None:
    """Import every kernel package so that its registrations run (import is cheap: no GPU work)."""
    import importlib

    for pkg in _KERNEL_PACKAGES:
        try:
            importlib.import_module(f"k3nn.kernels.{pkg}")
        except ModuleNotFoundError as e:
            if e.name != f"k3nn.kernels.{pkg}":
                raise
