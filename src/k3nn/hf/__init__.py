"""k3nn in the Hugging Face ecosystem: transformers' Auto classes and pipelines, PEFT, lm-eval. No remote code.

After ``import k3nn`` (in either order with transformers)::

    AutoConfig.from_pretrained(k3_dir)             # KimiK3PretrainedConfig (model_type "kimi_k3")
    AutoModelForCausalLM.from_pretrained(k3_dir)   # k3nn.KimiK3: k3nn's forward, cache and generate()
    pipeline("text-generation", model=k3_dir)      # streaming with TextStreamer / TextIteratorStreamer
    get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"]))

A Kimi Linear checkpoint (``"model_type": "kimi_linear"``) is transformers' own model type: the Auto classes keep
returning transformers' ``KimiLinearForCausalLM`` for it unless :func:`register_transformers` is called with
``kimi_linear=True`` (then they return :class:`k3nn.KimiK3`, for every later load in the process).
``KimiK3.from_pretrained(kimi_linear_dir)`` always gives k3nn's model, and that model works in pipelines, PEFT and
lm-eval like any other. lm-eval's command line: ``k3nn-lm-eval`` (see :mod:`k3nn.hf.lm_eval`).

Registration is lazy: ``import k3nn`` never imports transformers (that would add seconds to every start). When
``transformers.models.auto`` is already imported, ``import k3nn`` registers at once; otherwise a finder on
``sys.meta_path`` waits for that module's first import, registers right after it (calling transformers' public
``AutoConfig.register`` / ``AutoModelForCausalLM.register``) and removes itself.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings

from ..hf_surface import LORA_TARGET_MODULES, TransformersSurface

__all__ = ["register_transformers", "KimiK3PretrainedConfig", "TransformersSurface", "LORA_TARGET_MODULES"]

_AUTO = "transformers.models.auto"
_lock = threading.RLock()
_registered: set[str] = set()


def register_transformers(*, kimi_linear: bool = False) -> None:
    """Register k3nn with transformers' Auto classes (idempotent; ``import k3nn`` already arranges the default).

    ``AutoConfig`` maps ``"kimi_k3"`` to :class:`KimiK3PretrainedConfig` and ``AutoModelForCausalLM`` maps that
    config to :class:`k3nn.KimiK3`. ``kimi_linear=True`` also maps transformers' own ``KimiLinearConfig`` to
    :class:`k3nn.KimiK3` (``exist_ok``: it replaces transformers' ``KimiLinearForCausalLM`` for Auto loads in this
    process; transformers has no way to undo it). Needs transformers (ImportError otherwise)."""
    with _lock:
        from transformers.models.auto.configuration_auto import AutoConfig
        from transformers.models.auto.modeling_auto import AutoModelForCausalLM

        from ..model import KimiK3
        from .config import KimiK3PretrainedConfig

        if "kimi_k3" not in _registered:
            AutoConfig.register("kimi_k3", KimiK3PretrainedConfig, exist_ok=True)
            AutoModelForCausalLM.register(KimiK3PretrainedConfig, KimiK3, exist_ok=True)
            _registered.add("kimi_k3")
        if kimi_linear and "kimi_linear" not in _registered:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            AutoModelForCausalLM.register(CONFIG_MAPPING["kimi_linear"], KimiK3, exist_ok=True)
            _registered.add("kimi_linear")


def _register_after_import() -> None:
    try:
        register_transformers()
    except Exception as e:  # never break the user's `import transformers`
        warnings.warn(f"k3nn could not register with transformers' Auto classes ({type(e).__name__}: {e}); "
                      f"call k3nn.register_transformers() to see the full error", RuntimeWarning, stacklevel=2)


class _RunAfterExec(importlib.abc.Loader):
    """Wraps a module's loader: runs the real ``exec_module``, puts the real loader back on the module, then the
    callback. Every other loader attribute (``get_resource_reader``, ``get_filename``, ...) is the real loader's."""

    def __init__(self, loader, finder: "_AfterImport"):
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        for m in (module, sys.modules.get(module.__name__)):
            spec = getattr(m, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
            if getattr(m, "__loader__", None) is self:
                m.__loader__ = self._loader
        self._finder.fired()

    def __getattr__(self, name):
        if name in ("_loader", "_finder"):  # not set yet (copy / pickle protocols)
            raise AttributeError(name)
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """A one-shot post-import hook for one module name: finds the module's spec with the other finders, wraps its
    loader (:class:`_RunAfterExec`), and once the module has executed removes itself and runs ``callback``."""

    def __init__(self, name: str, callback):
        self.name, self.callback, self._busy = name, callback, False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RunAfterExec(spec.loader, self)
        return spec

    def fired(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.callback()


def _install() -> None:
    """What ``import k3nn`` does: register now if transformers' Auto classes are imported, else wait for them."""
    if _AUTO in sys.modules:
        _register_after_import()
    elif not any(isinstance(f, _AfterImport) and f.name == _AUTO for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_AUTO, _register_after_import))


def __getattr__(name: str):
    if name == "KimiK3PretrainedConfig":
        from .config import KimiK3PretrainedConfig

        return KimiK3PretrainedConfig
    raise AttributeError(f"module 'k3nn.hf' has no attribute {name!r}")
