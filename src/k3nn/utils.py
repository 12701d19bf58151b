"""Small shared helpers."""

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (fp64 stays fp64, so eager paths can be checked in double precision)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd is recording and one of ``tensors`` requires grad (a forward-only kernel cannot run)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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
