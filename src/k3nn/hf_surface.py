"""What transformers' pipelines, lm-eval's ``HFLM`` and PEFT read from a causal LM, on :class:`k3nn.KimiK3` itself.

Nothing here imports transformers: :class:`TransformersSurface` is a base class of ``KimiK3`` and costs nothing at
``import k3nn``. The pieces:

* the attributes those libraries probe (``can_generate()``, ``main_input_name``, ``generation_config``,
  ``get_input_embeddings()``, ``prepare_inputs_for_generation``, ``name_or_path``, ...);
* :func:`forward_kwargs`: transformers' ``forward`` keywords (``labels`` aside), each accepted at its "off" value
  and refused otherwise;
* :func:`causal_lm_loss`: transformers' causal-LM loss for ``forward(labels=...)``;
* :func:`loading_kwargs` / :func:`config_from_transformers`: what ``AutoModelForCausalLM.from_pretrained`` hands
  to ``KimiK3.from_pretrained`` (a transformers config, hub and placement keywords);
* :func:`check_adapters`: a PEFT adapter on a projection whose weight k3nn reads directly (MLA's ``kv_b_proj``,
  absorbed into the attention; packed decode weights) would be silently skipped, so it is refused.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["TransformersSurface", "causal_lm_loss", "forward_kwargs", "loading_kwargs", "config_from_transformers",
           "check_adapters", "has_adapters", "own_generation_config", "LORA_TARGET_MODULES"]

#: the projections a LoRA adapter may target: every one is called as a module on every path (so PEFT's wrapper
#: runs), unlike MLA's ``kv_b_proj`` (its weight is absorbed into the attention) and the routed experts (stacked
#: parameters, not modules)
LORA_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "f_a_proj", "f_b_proj", "g_proj", "g_a_proj", "g_b_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj", "down_proj", "lm_head")


class TransformersSurface:
    """The duck-typed surface of a transformers ``PreTrainedModel`` that pipelines, lm-eval and PEFT read.

    ``KimiK3`` keeps its own forward, cache and ``generate()`` (the fast decode loop); this adds the attributes and
    hooks those libraries probe, with transformers' names and meanings. See ``docs/architecture.md``
    ("transformers, PEFT and lm-eval").
    """

    #: the forward's first input (transformers' ``main_input_name``)
    main_input_name = "input_ids"
    #: the attribute holding the decoder stack (transformers' ``base_model_prefix``)
    base_model_prefix = "model"
    #: k3nn has no gradient checkpointing switch; PEFT reads this to decide whether embeddings must require grad
    is_gradient_checkpointing = False
    supports_gradient_checkpointing = False
    #: k3nn's cache is its own :class:`k3nn.cache.HybridCache`, not a transformers ``Cache``
    _supports_cache_class = False
    input_modalities = ("text",)
    output_modalities = ("text",)
    #: the path or hub id the weights were loaded from ("" for a model built in code); ``from_pretrained`` sets it
    name_or_path = ""

    @property
    def warnings_issued(self) -> dict:
        """transformers' per-model record of one-time warnings (its ``Trainer`` writes to it)."""
        return self.__dict__.setdefault("_k3nn_warnings_issued", {})

    @classmethod
    def can_generate(cls) -> bool:
        """True: ``generate()`` is k3nn's (see :meth:`k3nn.generation.GenerationMixin.generate`)."""
        return True

    # -- generation_config -----------------------------------------------------------------------------------
    @property
    def generation_config(self):
        """The model's default generation arguments (:class:`k3nn.GenerationConfig`): ``generation_config.json``
        when the checkpoint has one, else the special tokens of ``config`` (what ``generate()`` uses; derived again
        when ``config``'s token ids change, unless it was modified in place). Assign to replace it; ``del`` goes
        back to the derived one."""
        from .generation_config import GenerationConfig

        d = self.__dict__
        own = d.get("_k3nn_generation_config")
        if own is not None:
            return own
        tokens = tuple(repr(getattr(self.config, k, None)) for k in ("eos_token_id", "pad_token_id", "bos_token_id"))
        derived = d.get("_k3nn_derived_generation_config")
        if derived is not None:
            gc, seen, snapshot = derived
            if seen == tokens or gc.to_dict() != snapshot:  # config unchanged, or the object was edited: keep it
                return gc
        gc = GenerationConfig.from_model_config(self.config)
        d["_k3nn_derived_generation_config"] = (gc, tokens, gc.to_dict())
        return gc

    @generation_config.setter
    def generation_config(self, value) -> None:
        if value is not None:
            from .generation_config import GenerationConfig

            value = GenerationConfig.coerce(value, source="generation_config")
        self.__dict__["_k3nn_generation_config"] = value

    @generation_config.deleter
    def generation_config(self) -> None:
        self.__dict__.pop("_k3nn_generation_config", None)
        self.__dict__.pop("_k3nn_derived_generation_config", None)

    # -- embeddings --------------------------------------------------------------------------------------------
    def get_input_embeddings(self) -> torch.nn.Module:
        """The token embedding ``model.embed_tokens`` ([vocab, hidden])."""
        return self.model.embed_tokens

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        """Replace the token embedding (transformers' name; a tied lm_head follows it)."""
        self.model.embed_tokens = value
        self.tie_weights()

    def get_output_embeddings(self) -> torch.nn.Module:
        """The output projection ``lm_head`` ([vocab, hidden])."""
        return self.lm_head

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        """Replace the lm_head (transformers' name; re-tied to the embedding when the config ties them)."""
        self.lm_head = value
        self.tie_weights()

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      **kwargs: Any) -> dict:
        """transformers' per-step hook. k3nn's ``generate()`` drives its own cache and never calls it; PEFT reads it
        when wrapping the model. Returns the forward's keywords for ``input_ids`` [B, T] (no cache)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    @classmethod
    def _from_config(cls, config, **kwargs: Any):
        """``AutoModelForCausalLM.from_config``: a randomly initialised model of a transformers or k3nn config;
        ``dtype`` / ``torch_dtype`` as in transformers, ``device`` / ``backend`` / ``seed`` as in ``KimiK3``."""
        from .config import KimiK3Config

        dtype = kwargs.pop("dtype", None)
        torch_dtype = kwargs.pop("torch_dtype", None)
        for k in ("trust_remote_code", "_from_auto", "adapter_kwargs", "attn_implementation"):
            v = kwargs.pop(k, None)
            if k == "attn_implementation" and v is not None:
                raise ValueError(f"attn_implementation={v!r}: k3nn picks its kernels with backend= "
                                 f"('eager' | 'triton' | 'cuda' | 'auto'), not transformers' attention switch")
        if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
            raise ValueError(f"give dtype or its alias torch_dtype, not both ({dtype!r} vs {torch_dtype!r})")
        dtype = dtype if dtype is not None else torch_dtype
        if dtype is not None:
            from .utils import dtype_named

            dtype = dtype_named(dtype if dtype != "auto" else "float32")
        cfg = config if isinstance(config, KimiK3Config) else config_from_transformers(config)
        return cls(cfg, dtype=dtype, **kwargs)


def own_generation_config(model):
    """The generation config ``save_pretrained`` writes: one that was assigned (or loaded), or the derived one once
    edited in place; None when the model only has the defaults of its config."""
    own = model.__dict__.get("_k3nn_generation_config")
    if own is not None:
        return own
    derived = model.__dict__.get("_k3nn_derived_generation_config")
    if derived is not None and derived[0].to_dict() != derived[2]:
        return derived[0]
    if not isinstance(model, TransformersSurface):
        return getattr(model, "generation_config", None)
    return None


# -- forward ---------------------------------------------------------------------------------------------------
#: transformers forward keywords and the values at which they change nothing here
_FORWARD_OFF: dict[str, tuple[tuple, str]] = {
    "output_attentions": ((None, False), "k3nn's attention kernels never materialise attention weights"),
    "output_hidden_states": ((None, False), "ask for layer outputs with output_hidden_layers=[...] (k3nn's name)"),
    "return_dict": ((None, True), "KimiK3 always returns a KimiK3Output (.logits, .loss)"),
    "use_cache": ((None, False), "pass cache=model.new_cache(batch_size, max_length) to continue from a cache"),
    "past_key_values": ((None,), "k3nn's cache is cache=model.new_cache(batch_size, max_length)"),
    "position_ids": ((None,), "positions follow the attention_mask (left padding) and the cache"),
    "cache_position": ((None,), "positions follow the attention_mask (left padding) and the cache"),
    "token_type_ids": ((None,), "a causal LM has no token types"),
}


def forward_kwargs(kwargs: dict) -> int | torch.Tensor | None:
    """Check the transformers keywords of a ``KimiK3.forward`` call (what PEFT's ``PeftModelForCausalLM`` and
    transformers' ``Trainer`` pass): each must be at a value that changes nothing here, else a ValueError names it
    and the k3nn way; an unknown name is a TypeError. Returns ``num_items_in_batch`` (the loss denominator
    transformers' Trainer passes under gradient accumulation) or None."""
    num_items = kwargs.get("num_items_in_batch")
    for k, v in kwargs.items():
        if k == "num_items_in_batch":
            continue
        if k not in _FORWARD_OFF:
            raise TypeError(f"KimiK3.forward() got an unexpected keyword argument {k!r}")
        ok, why = _FORWARD_OFF[k]
        if not any(v is o for o in ok):
            raise ValueError(f"{k}={v!r} is not supported by KimiK3.forward: {why}")
    return num_items


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None,
                   ignore_index: int = -100) -> torch.Tensor:
    """transformers' causal-LM loss: the logits at position t [B, T, V] score ``labels[:, t + 1]`` [B, T] (labels are
    the input ids, not shifted by the caller); ``ignore_index`` (-100) positions do not count. Cross-entropy in
    fp32, averaged over the counted tokens, or summed and divided by ``num_items_in_batch`` when given (transformers'
    gradient-accumulation form). Returns a scalar fp32 tensor."""
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an int64/int32 tensor of token ids, got "
                        f"{labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__}")
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must have the shape of input_ids {tuple(logits.shape[:2])} (ids, -100 to ignore; "
                         f"unshifted), got {tuple(labels.shape)}")
    target = labels[:, 1:].to(logits.device).long()
    scores = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    loss = F.cross_entropy(scores, target.reshape(-1), ignore_index=ignore_index, reduction="sum")
    if num_items_in_batch is None:
        return loss / (target != ignore_index).sum()
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


# -- loading ---------------------------------------------------------------------------------------------------
#: transformers ``from_pretrained`` keywords accepted only at these values (an identity test for None / bools)
_LOADING_OFF: dict[str, tuple[tuple, str]] = {
    "proxies": ((None,), "set HTTPS_PROXY / HTTP_PROXY for huggingface_hub"),
    "force_download": ((None, False), "delete the cached snapshot (`hf cache delete`) to download again"),
    "use_safetensors": ((None, True), "k3nn loads only safetensors (never pickle)"),
    "quantization_config": ((None,), "k3nn reads MXFP4 experts from the checkpoint itself (mxfp4_experts)"),
    "gguf_file": ((None,), "k3nn reads safetensors checkpoints only"),
    "max_memory": ((None,), "k3nn places the model on one device (device_map / device)"),
    "offload_folder": ((None,), "k3nn places the model on one device (no offloading)"),
    "offload_state_dict": ((None, False), "k3nn places the model on one device (no offloading)"),
    "tp_plan": ((None,), "shard with k3nn.parallel.tp.apply_tensor_parallel under torchrun"),
    "state_dict": ((None,), "load the weights from a directory (model.load_state_dict afterwards)"),
    "output_loading_info": ((None, False), "k3nn's loading is strict: a mismatch is an error, not a report"),
    "ignore_mismatched_sizes": ((None, False), "k3nn's loading is strict: a mismatch is an error"),
    "key_mapping": ((None,), "k3nn maps checkpoint layouts itself (k3nn.checkpoint.formats)"),
    "variant": ((None,), "k3nn reads model.safetensors[.index.json] only"),
    "attn_implementation": ((None,), "k3nn picks its kernels with backend= ('eager' | 'triton' | 'cuda' | 'auto')"),
    "experts_implementation": ((None,), "k3nn picks its kernels with backend= ('eager' | 'triton' | 'cuda' | 'auto')"),
    "use_kernels": ((None, False), "k3nn picks its kernels with backend= ('eager' | 'triton' | 'cuda' | 'auto')"),
}
#: bookkeeping keywords transformers' Auto classes and pipelines add; they change nothing here
_LOADING_IGNORED = frozenset({"_from_auto", "_from_pipeline", "trust_remote_code", "code_revision", "_commit_hash",
                              "low_cpu_mem_usage"})


def loading_kwargs(kwargs: dict) -> None:
    """Check the transformers keywords of a ``KimiK3.from_pretrained`` call beyond k3nn's own (what
    ``AutoModelForCausalLM.from_pretrained``, pipelines and lm-eval pass). ``trust_remote_code`` /
    ``code_revision`` do nothing (k3nn runs no remote code), nor does ``low_cpu_mem_usage`` (k3nn always streams
    shard by shard); ``subfolder`` must be empty; ``adapter_kwargs`` naming an adapter (a PEFT adapter directory
    was given) is refused with the PEFT call to make; every other keyword must be at its "off" value (a ValueError
    names it and the k3nn way) or is unknown (TypeError)."""
    for k, v in kwargs.items():
        if k in _LOADING_IGNORED:
            continue
        if k == "subfolder":
            if v not in (None, ""):
                raise ValueError(f"subfolder={v!r}: pass the checkpoint's own directory (or hub id) to from_pretrained")
            continue
        if k == "adapter_kwargs":
            path = (v or {}).get("_adapter_model_path")
            if path is not None:
                raise ValueError(f"{path} is a PEFT adapter: load its base model, then the adapter with "
                                 f"peft.PeftModel.from_pretrained(model, {str(path)!r})")
            continue
        if k not in _LOADING_OFF:
            raise TypeError(f"KimiK3.from_pretrained() got an unexpected keyword argument {k!r}")
        ok, why = _LOADING_OFF[k]
        if not any(v is o for o in ok):
            raise ValueError(f"{k}={v!r} is not supported by KimiK3.from_pretrained: {why}")


def config_from_transformers(config):
    """A :class:`k3nn.KimiK3Config` from a transformers config object: k3nn's ``KimiK3PretrainedConfig``
    (model_type ``kimi_k3``) or transformers' ``KimiLinearConfig`` (any object with ``to_dict()`` giving a
    config.json dict). The keys every transformers config carries (``return_dict``, ``id2label``, ...) are dropped."""
    from .config import KimiK3Config

    if isinstance(config, KimiK3Config):
        return config
    check_transformers_config(config)
    to_k3nn = getattr(config, "to_k3nn", None)
    if callable(to_k3nn):
        return to_k3nn()
    if not callable(getattr(config, "to_dict", None)):
        raise TypeError(f"config must be a k3nn KimiK3Config or a transformers config, got {type(config).__name__}")
    return KimiK3Config.from_dict(_own_keys(config.to_dict()))


def check_transformers_config(config) -> None:
    """Refuse what a transformers config may carry and k3nn cannot honour: ``attn_implementation`` /
    ``experts_implementation`` (``AutoConfig`` keeps them on the config, not in the loading keywords)."""
    for name in ("attn_implementation", "experts_implementation"):
        v = getattr(config, f"_{name}_internal", None)
        if v is not None:
            raise ValueError(f"{name}={v!r} is not supported by KimiK3.from_pretrained: {_LOADING_OFF[name][1]}")


def _own_keys(d: dict) -> dict:
    """A transformers config dict without the keys of transformers' base config class that k3nn has no field for."""
    from transformers import PretrainedConfig

    from .config import KimiK3Config

    known = {f.name for f in dataclasses.fields(KimiK3Config)}
    base = set(PretrainedConfig().to_dict()) - known - {"model_type"}
    return {k: v for k, v in d.items() if k not in base}


# -- PEFT ------------------------------------------------------------------------------------------------------
def _wrapped(mod) -> bool:
    """An adapter layer (PEFT's tuner layers hold the original module as ``base_layer``)."""
    return isinstance(getattr(mod, "base_layer", None), torch.nn.Module)


def has_adapters(model) -> bool:
    """``model`` holds a PEFT adapter layer anywhere (only looked for once PEFT is imported)."""
    return "peft" in sys.modules and any(_wrapped(m) for m in model.modules())


def check_adapters(model) -> None:
    """Refuse adapters k3nn would skip: ``model`` is a KimiK3. Runs only once PEFT is imported (a dictionary lookup
    otherwise). A wrapped MLA ``kv_b_proj`` is read as a weight (absorbed into the attention); after
    ``prepare_decode()`` the packed projections run as one GEMM on the packed weight (an adapter on them would be
    bypassed)."""
    if "peft" not in sys.modules:
        return
    for i in model.config.mla_layers:
        if _wrapped(model.model.layers[i].self_attn.kv_b_proj):
            raise ValueError(
                f"an adapter on model.layers.{i}.self_attn.kv_b_proj would be ignored: k3nn's MLA absorbs that "
                f"weight into the attention instead of calling the module; target other projections "
                f"(k3nn.hf.LORA_TARGET_MODULES) or merge the adapter first (merge_and_unload())")
    if model.decode_prepared and has_adapters(model):
        raise ValueError("the model has adapters and packed decode weights (prepare_decode()): the packed GEMMs "
                         "bypass the adapters; call model.prepare_decode(False), or merge the adapter first "
                         "(merge_and_unload()) and prepare again")
