"""Small shared helpers."""

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (fp64 stays fp64, so eager paths can be checked in double precision)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd is recording and one of ``tensors`` requires grad (a forward-only kernel cannot run)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _why_unavailable(dev: torch.device) -> str | None:
    """None when ``dev`` can hold tensors in this process, else the reason it cannot."""
    t = dev.type
    if t in ("cpu", "meta"):
        return None
    if t == "cuda":
        if not torch.cuda.is_available():
            if torch.version.cuda is None and torch.version.hip is None:
                return f"this torch ({torch.__version__}) was built without CUDA"
            return ("torch was built with CUDA but sees no CUDA device (no GPU, no driver, or CUDA_VISIBLE_DEVICES "
                    "hides them)")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            return f"it does not exist: {n} CUDA device(s) visible ({', '.join(f'cuda:{i}' for i in range(n))})"
        return None
    if t == "mps":
        return None if torch.backends.mps.is_available() else "MPS (Apple GPU) is not available on this machine"
    mod = getattr(torch, t, None)
    is_available = getattr(mod, "is_available", None)
    if callable(is_available) and is_available():
        count = getattr(mod, "device_count", None)
        n = count() if callable(count) else None
        if dev.index is not None and n is not None and dev.index >= n:
            return f"it does not exist: {n} {t} device(s) visible"
        return None
    return f"no {t} device is available to this torch build"


def resolve_device(device: "torch.device | str | int", name: str = "device") -> torch.device:
    """``device`` as a :class:`torch.device` that exists and is usable here, else a ValueError naming ``name``.

    Accepts what torch and transformers accept: a torch.device, a string (``"cpu"``, ``"cuda"``, ``"cuda:1"``,
    ``"mps"``, ``"meta"``, ...) or an int (a CUDA device index). Used by every entry that takes a device
    (``KimiK3.from_pretrained(device=...)``, ``device_map``, ``k3nn generate --device``) so that an unknown or
    absent device is one clear error instead of an error deep inside torch.

    Raises:
        ValueError: not a device (``"tpu"``, ``"cuda:x"``), a device type this machine does not have (``"cuda"``
            on a CPU-only torch, ``"mps"`` off a Mac), or an index past the last device (``"cuda:3"`` with 2 GPUs).
        TypeError: ``device`` is neither a torch.device, a str nor an int.

    Example::

        resolve_device("cuda:0")   # torch.device('cuda:0') on a GPU machine; ValueError on a CPU-only one
    """
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"{name} must be a torch.device, a device string such as 'cpu' or 'cuda:0', or an int "
                        f"(a CUDA index), got {type(device).__name__}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{name} must be a device index >= 0, got {device}")
        dev = torch.device("cuda", device)
    else:
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"{name} must be a device such as 'cpu', 'cuda', 'cuda:1' or 'mps', got {device!r}") \
                from None
    why = _why_unavailable(dev)
    if why is not None:
        shown = repr(str(device)) if isinstance(device, torch.device) else repr(device)
        raise ValueError(f"{name}={shown} is not available here: {why}")
    return dev


def _usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports one, else all of them)."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def auto_threads(max_threads: int = 4) -> int:
    """The thread count ``"auto"`` means: ``OMP_NUM_THREADS`` when it is set; otherwise the cores this process may
    use minus the 1-minute load average of the machine (other processes' work), between 1 and ``max_threads``.

    Why not every core: torch's intra-op threads spin-wait for each other, so on a machine that other processes keep
    busy a 2-thread decode of a small model can run several times slower than a 1-thread one; and the models an
    entry point runs on CPU (the demo's, ``tiny()``) gain little beyond 4 threads.

    Raises:
        ValueError: ``OMP_NUM_THREADS`` is set to something other than a positive integer.
    """
    import os

    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {env!r}")
        return int(env)
    cores = _usable_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this OS
        load = 0.0
    return max(1, min(max_threads, cores, int(cores - load + 0.5)))


def parse_threads(value: "int | str", name: str = "threads") -> "int | str":
    """``value`` as a thread request: a positive int, or ``"auto"``. Accepts digit strings (command-line values);
    ``name`` is the argument named in the error.

    Raises:
        ValueError: anything else, with the value in the message.
    """
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return "auto"
        if v.isdigit() and int(v) >= 1:
            return int(v)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"{name} must be a positive integer or 'auto', got {value!r}")


def configure_threads(threads: "int | str" = "auto") -> int:
    """Set torch's intra-op CPU thread count for a program's entry point and return the count set.

    For entry points only (``k3nn generate`` / ``serve`` / ``demo``, the examples, your own script's ``main``):
    the library itself never changes torch's global thread settings.

    Args:
        threads: a positive int (or digit string), or ``"auto"`` (see :func:`auto_threads`: ``OMP_NUM_THREADS``
            when set, else the idle cores, at most 4).

    Returns:
        ``torch.get_num_threads()`` after the call.

    Raises:
        ValueError: ``threads`` is neither a positive integer nor ``"auto"``, or ``OMP_NUM_THREADS`` is malformed.

    Example::

        from k3nn.utils import configure_threads
        configure_threads("auto")   # 1 on a 2-core machine another process keeps busy
    """
    req = parse_threads(threads)
    n = auto_threads() if req == "auto" else req
    torch.set_num_threads(n)
    return torch.get_num_threads()


#: dtype names ``from_pretrained`` and the CLI accept (transformers' spellings included)
DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
               "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
               "float64": torch.float64, "double": torch.float64}


def dtype_named(dtype) -> torch.dtype:
    """A floating-point torch dtype from a dtype or its name (``"bfloat16"``, ``"torch.float16"``); ValueError
    otherwise (``"auto"`` is the checkpoint's: :func:`k3nn.checkpoint.io.resolve_dtype`)."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.replace("torch.", "") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.replace("torch.", "")]
    raise ValueError(f"dtype must be a torch dtype or one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
