"""save_pretrained / from_pretrained: sharded safetensors, hub resolution, strict shard-by-shard loading.

Loading builds the model on the meta device, materialises it once on the target device, then streams one
shard at a time into it (peak memory ≈ model + one tensor, never 2×). Every native tensor must be written
exactly once (stacked experts: every expert index); missing, unexpected and mis-shaped tensors raise a
:class:`CheckpointError` naming them. Only safetensors are read (never pickle).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import DEEPSEEK_TYPES, KimiK3Config
from ..generation_config import GenerationConfig
from ..utils import DTYPE_NAMES, dtype_named
from .formats import FORMATS, detect
from .rope_layout import deinterleave_rope_, interleave_rope, text_config_of

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "resolve_checkpoint", "save_pretrained", "from_pretrained", "load_weights",
           "checkpoint_keys"]

#: parameters kept in fp32 whatever the model dtype (routing and decay gates are precision-sensitive)
FP32_SUFFIXES = ("gate.weight", "gate.e_score_correction_bias", "self_attn.A_log", "self_attn.dt_bias")


class CheckpointError(ValueError):
    """A checkpoint does not match the model: missing / unexpected / mis-shaped tensors, or unreadable files."""


def _progress_disabled() -> bool | None:
    return True if os.environ.get("K3NN_DISABLE_PROGRESS_BARS") else None


def resolve_checkpoint(path_or_repo_id: str | os.PathLike, revision: str | None = None, cache_dir: str | None = None,
                       local_files_only: bool | None = None, token: str | bool | None = None) -> Path:
    """A local directory as is; otherwise a hub repo id through huggingface_hub (cache, revision,
    ``local_files_only`` and ``HF_HUB_OFFLINE`` honoured)."""
    p = Path(path_or_repo_id)
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"{p} is a file; from_pretrained takes a checkpoint directory or a hub repo id")
    name = str(path_or_repo_id)
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise CheckpointError(f"{name!r} is neither a local directory nor a hub repo id ('owner/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    env_offline = os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() not in ("", "0", "false", "no", "off")
    offline = [w for w, on in (("HF_HUB_OFFLINE=1", env_offline), ("local_files_only=True", bool(local_files_only)))
               if on]
    where = f"the local hub cache ({cache_dir or 'default HF cache'})"
    try:
        d = snapshot_download(name, revision=revision, cache_dir=cache_dir, token=token, local_files_only=bool(offline),
                              allow_patterns=["*.json", "*.safetensors", "tiktoken.model", "tokenizer*"])
    except LocalEntryNotFoundError as e:
        if offline:
            raise CheckpointError(
                f"{name!r} is not a local directory, nor in {where}, and downloads are off ({' and '.join(offline)}). "
                f"Download it where the network is reachable (`hf download {name}`) or pass a local directory.") from e
        cause = e.__cause__ or e.__context__
        why = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).splitlines()[0]
        raise CheckpointError(
            f"{name!r} is not a local directory, nor in {where}, and the Hugging Face Hub could not be reached to "
            f"download it ({why}). Check the network (or HF_ENDPOINT / proxy settings), or pass a local "
            f"directory.") from e
    except GatedRepoError as e:
        raise CheckpointError(f"{name!r} is a gated repository on the Hugging Face Hub: accept its terms on the hub "
                              f"and log in (`hf auth login`) or pass token=") from e
    except RepositoryNotFoundError as e:
        raise CheckpointError(f"{name!r} is not a local directory and no such repository was found on the Hugging "
                              f"Face Hub (or it is private: log in with `hf auth login` or pass token=)") from e
    except RevisionNotFoundError as e:
        raise CheckpointError(f"{name!r} has no revision {revision!r} on the Hugging Face Hub") from e
    except HfHubHTTPError as e:
        raise CheckpointError(f"could not fetch {name!r} from the hub: {e}") from e
    d = Path(d)
    if not (d / "config.json").exists():
        raise CheckpointError(f"{name!r} resolved to {d}, which has no config.json")
    return d


def _shards(d: Path) -> list[Path]:
    idx = d / "model.safetensors.index.json"
    if idx.exists():
        try:
            wm = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{idx} is not a valid safetensors index: {e}") from None
        files = sorted(set(wm.values()))
        missing = [f for f in files if not (d / f).exists()]
        if missing:
            raise CheckpointError(f"{d}: shards listed in the index are missing: {missing}")
        return [d / f for f in files]
    single = d / "model.safetensors"
    if single.exists():
        return [single]
    if list(d.glob("*.bin")) or list(d.glob("*.pt")):
        raise CheckpointError(f"{d} has only pickle weights (.bin/.pt); k3nn loads safetensors only")
    raise CheckpointError(f"{d} has no model.safetensors or model.safetensors.index.json")


def _open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError on truncated / corrupt headers
        raise CheckpointError(f"cannot read {path.name}: corrupt or truncated safetensors file ({e})") from None


def checkpoint_keys(directory: str | os.PathLike) -> set[str]:
    """Every tensor name of the checkpoint in ``directory`` (headers only)."""
    return {k for p in _shards(Path(directory)) for k in _open(p).keys()}


def _tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are another (earlier) parameter: tied weights are loaded once."""
    seen, alias = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            alias.add(name)
        seen.add(id(p))
    return alias


def load_weights(model: torch.nn.Module, directory: str | os.PathLike, format=None) -> str:
    """Stream every shard of ``directory`` into ``model`` (already materialised). ``format``: a name of
    :data:`~k3nn.checkpoint.formats.FORMATS`, a key-map object with ``to_native`` (e.g. a multimodal layout), or
    None (detected). Returns the format's name."""
    d = Path(directory)
    shards = _shards(d)
    handles = [(p, _open(p)) for p in shards]
    all_keys = {k for _, f in handles for k in f.keys()}
    if format is None or isinstance(format, str):
        fmt = format or detect(all_keys)
        if fmt not in FORMATS:
            raise CheckpointError(f"unknown checkpoint format {fmt!r}; known: {sorted(FORMATS)}")
        conv = FORMATS[fmt]
    else:
        conv, fmt = format, getattr(format, "NAME", type(format).__name__)
    targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
    targets = {k: (v.data if isinstance(v, torch.nn.Parameter) else v) for k, v in targets.items()}
    if getattr(model.config, "tie_word_embeddings", False):
        targets.pop("lm_head.weight", None)
    for k in _tied_aliases(model):
        targets.pop(k, None)
    written: dict[str, set[int] | bool] = {}
    unexpected, misshaped = [], []
    model_keys = set(targets)
    for path, f in tqdm(handles, desc="loading shards", unit="shard", disable=_progress_disabled(),
                        leave=False):
        for key in f.keys():
            try:
                items = conv.to_native(key, lambda key=key: f.get_tensor(key), model_keys)
            except Exception as e:
                raise CheckpointError(f"{path.name}: cannot read tensor {key!r} ({e})") from None
            for nkey, j, t in items:
                dst = targets.get(nkey)
                if dst is None:
                    unexpected.append(key)
                    continue
                if isinstance(j, slice):  # a block of rows (e.g. q, k, v of a fused qkv weight)
                    rows = range(*j.indices(dst.shape[0]))
                    view = dst[j] if j.stop is None or j.stop <= dst.shape[0] else None
                else:
                    view = dst if j is None else (dst[j] if 0 <= j < dst.shape[0] else None)
                if view is None or tuple(view.shape) != tuple(t.shape):
                    want = (tuple(dst.shape) if j is None else
                            (len(rows), *dst.shape[1:]) if isinstance(j, slice) else tuple(dst.shape[1:]))
                    misshaped.append(f"{key}: checkpoint {tuple(t.shape)}, model expects {want}")
                    continue
                if t.dtype == torch.uint8 and view.dtype != torch.uint8:
                    misshaped.append(f"{key}: checkpoint uint8 (MXFP4?) but the model expects {view.dtype}")
                    continue
                with torch.no_grad():
                    view.copy_(t)
                if j is None:
                    written[nkey] = True
                else:
                    s = written.setdefault(nkey, set())
                    if isinstance(s, set):
                        s.update(rows if isinstance(j, slice) else (j,))
    missing = []
    for k, v in targets.items():
        w = written.get(k)
        if w is None:
            missing.append(k)
        elif isinstance(w, set) and len(w) != v.shape[0]:
            missing.append(f"{k} (experts {sorted(set(range(v.shape[0])) - w)[:8]}...)")
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing[:20]}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected[:20]}")
    if misshaped:
        problems.append(f"mis-shaped tensors ({len(misshaped)}): {misshaped[:20]}")
    if problems:
        raise CheckpointError(f"checkpoint {d} (format {fmt!r}) does not match the model:\n  " + "\n  ".join(problems))
    if getattr(text_config_of(model), "rope_interleave", False):
        deinterleave_rope_(model)
    return fmt


def _keep_fp32(model: torch.nn.Module) -> None:
    """Routing and decay-gate parameters stay in at least fp32 (fp64 models keep them in fp64)."""
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith(FP32_SUFFIXES) and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()


def resolve_dtype(dtype, checkpoint: Path | None = None) -> torch.dtype:
    """A torch dtype from a dtype, its name (``"bfloat16"``, ``"torch.float16"``) or ``"auto"`` (the checkpoint's:
    config.json ``dtype`` / ``torch_dtype``, else its first floating-point tensor; fp32 if none)."""
    if isinstance(dtype, str) and dtype.replace("torch.", "") == "auto":
        if checkpoint is None:
            return torch.float32
        raw = json.loads((checkpoint / "config.json").read_text())
        name = raw.get("dtype") or raw.get("torch_dtype")
        if name is None:
            for shard in _shards(checkpoint)[:1]:
                with _open(shard) as f:
                    for key in f.keys():
                        t = f.get_slice(key).get_dtype()
                        if t in ("F32", "BF16", "F16", "F64"):
                            return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                                    "F64": torch.float64}[t]
            return torch.float32
        return resolve_dtype(str(name))
    if isinstance(dtype, torch.dtype):
        return dtype_named(dtype)
    try:
        return dtype_named(dtype)
    except ValueError:
        raise ValueError(f"dtype must be a torch dtype, one of {sorted(DTYPE_NAMES)} or 'auto', got {dtype!r}") \
            from None


def resolve_device_map(device_map, device) -> torch.device:
    """The one device of a ``from_pretrained`` call: ``device`` when ``device_map`` is None, else transformers'
    ``device_map`` for one device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, an int, a torch.device, ``"auto"`` (the
    first GPU if there is one) or ``{"": device}``. A map over several devices is refused; a device that does not
    exist or is not available here is a ValueError naming the argument (:func:`k3nn.utils.resolve_device`)."""
    from ..utils import resolve_device

    if device_map is None:
        return resolve_device(device, "device")
    if isinstance(device_map, dict):
        devs = {str(torch.device(v) if not isinstance(v, int) else torch.device("cuda", v))
                for v in device_map.values()}
        if len(devs) != 1:
            raise ValueError(f"device_map spreads the model over {sorted(devs)}: k3nn places a model on one device; "
                             f"shard it over GPUs with k3nn.parallel.tp.apply_tensor_parallel (torchrun) instead")
        (device_map,) = devs
    if device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return resolve_device(device_map, "device_map")
    try:
        torch.device(device_map)
    except (RuntimeError, TypeError):
        raise ValueError(f"device_map must be a device ('cpu', 'cuda', 'cuda:0', an int), 'auto' or a one-device "
                         f"dict, got {device_map!r}") from None
    return resolve_device(device_map, "device_map")


def _text_only_format(d: Path, language_model_only: bool):
    """None for a text checkpoint; for a multimodal one the key map of its language model when
    ``language_model_only``, else a CheckpointError saying how to load it."""
    from .formats.multimodal import LanguageModelOnly, is_multimodal, is_vision_key

    keys = checkpoint_keys(d)
    if not is_multimodal(keys):
        return None
    vision = sorted(k for k in keys if is_vision_key(k))
    if not language_model_only:
        raise CheckpointError(
            f"{d} is a multimodal checkpoint ({len(vision)} vision tower / projector tensors, e.g. "
            f"{vision[:2]}, beside its language model): load it with k3nn.KimiK3ForConditionalGeneration"
            f".from_pretrained, or pass language_model_only=True to KimiK3.from_pretrained to load only the "
            f"language model and skip the vision weights")
    return LanguageModelOnly.for_checkpoint(keys)


def resolve_loading(path_or_repo_id, dtype, torch_dtype, device, device_map, revision=None, cache_dir=None,
                    local_files_only=None, token=None) -> tuple[Path, torch.device, object]:
    """The checkpoint directory, the one device and the dtype argument (``torch_dtype`` folded in) of a
    ``from_pretrained`` call, with transformers' spellings accepted (see :func:`resolve_device_map`)."""
    if torch_dtype is not None:
        if dtype is not None and dtype != torch_dtype:
            raise ValueError(f"give dtype or its alias torch_dtype, not both ({dtype!r} vs {torch_dtype!r})")
        dtype = torch_dtype
    dev = resolve_device_map(device_map, device)  # a bad device fails before any download
    d = resolve_checkpoint(path_or_repo_id, revision, cache_dir, local_files_only, token)
    return d, dev, dtype


def from_pretrained(cls, path_or_repo_id, *, dtype=None, device="cpu", backend=None, revision=None, cache_dir=None,
                    local_files_only=None, token=None, config: KimiK3Config | None = None, torch_dtype=None,
                    device_map=None, language_model_only: bool = False, **hf_kwargs):
    """Load a checkpoint into ``cls`` (``KimiK3.from_pretrained`` and ``KimiK3ForConditionalGeneration``'s text
    path call this): a local directory or a hub repo id (:func:`resolve_checkpoint`), any layout of
    :mod:`k3nn.checkpoint.formats` (detected from the tensor names), sharded safetensors loaded one shard at a time
    into a meta-initialised model materialised once on ``device``.

    ``dtype``: a torch dtype, its name, or "auto" / None (the checkpoint's); ``torch_dtype`` is its transformers
    alias. ``device`` or a one-device ``device_map`` (a device that does not exist or is not available is a
    ValueError naming the argument, raised before any download). ``config``: use this instead of config.json.
    ``language_model_only``: load the text model of a multimodal checkpoint (with a warning naming what was
    skipped). Missing, unexpected or mis-shaped tensors raise :class:`CheckpointError` naming them; a
    ``generation_config.json`` becomes ``model.generation_config``."""
    if hf_kwargs or (config is not None and not isinstance(config, KimiK3Config)):
        from ..hf_surface import config_from_transformers, loading_kwargs

        loading_kwargs(hf_kwargs)  # transformers' keywords (AutoModelForCausalLM, pipelines, lm-eval)
        config = None if config is None else config_from_transformers(config)
    d, device, dtype = resolve_loading(path_or_repo_id, dtype, torch_dtype, device, device_map, revision, cache_dir,
                                       local_files_only, token)
    if config is None:
        config = KimiK3Config.from_json_file(d / "config.json")
    dtype = resolve_dtype("auto" if dtype is None else dtype, d)
    text_only = _text_only_format(d, language_model_only)
    model = cls(config, device="meta", backend=backend)
    model.to_empty(device=device)
    model.tie_weights()
    model.to(dtype)
    _keep_fp32(model)
    model.load_format = load_weights(model, d, text_only)
    if text_only is not None:
        model.load_format = text_only.text.NAME
        log.warning("%s: loaded the language model of a multimodal checkpoint and skipped its %d vision tower / "
                    "projector tensors (language_model_only=True)", d, len(text_only.skipped))
    gen_cfg = d / "generation_config.json"
    if gen_cfg.exists():
        model.generation_config = GenerationConfig.from_pretrained(d)
    model.name_or_path = str(path_or_repo_id)  # transformers' name: PEFT records it as the adapter's base model
    model.eval()
    return model


def default_format(config: KimiK3Config) -> str:
    """``"transformers"`` for a Kimi Linear model transformers can run (what ``KimiLinearForCausalLM`` loads),
    else ``"k3nn"``."""
    return "transformers" if config.transformers_incompatibility() is None else "k3nn"


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor safetensors writes: contiguous, and copied when it is a view of a larger buffer (packed
    decode weights, :mod:`k3nn.layers.packed`), which a writer may refuse to store as a shared tensor."""
    t = t.contiguous()
    return t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t


def write_safetensors(sd: dict[str, torch.Tensor], save_directory, max_shard_size: int | str,
                      metadata: dict[str, str]) -> None:
    """``sd`` as ``model.safetensors`` or as shards plus ``model.safetensors.index.json``, in huggingface_hub's
    layout (its :func:`~huggingface_hub.split_torch_state_dict_into_shards` picks the shards and names), written
    one shard at a time: a view of a larger buffer (a prepared model's packed decode weights) is copied while its
    shard is written, so saving holds at most one shard of copies, not one of every packed projection. Shard and
    index files of an earlier save in the directory are removed first. ``metadata`` goes into the single file, or
    into the index of a sharded save, beside ``"format": "pt"``."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(sd, max_shard_size=max_shard_size)
    earlier = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
    for name in os.listdir(save_directory):
        if earlier.fullmatch(name):
            os.remove(os.path.join(save_directory, name))
    metadata = {"format": "pt", **metadata}
    per_file = {"format": "pt"} if split.is_sharded else metadata
    for filename, names in split.filename_to_tensors.items():
        save_file({n: _own_storage(sd[n]) for n in names}, os.path.join(save_directory, filename), per_file)
    if split.is_sharded:
        index = {"metadata": {**split.metadata, **metadata}, "weight_map": split.tensor_to_filename}
        with open(os.path.join(save_directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def save_pretrained(model, save_directory, max_shard_size: int | str = "5GB", format: str | None = None, *,
                    tokenizer=None, chat_template: str | None = None) -> None:
    """config.json + sharded safetensors + model.safetensors.index.json (huggingface_hub serialisation).
    ``format``: a key layout of :mod:`k3nn.checkpoint.formats`; default :func:`default_format`. ``"transformers"``
    is refused for a model transformers' ``KimiLinearForCausalLM`` cannot represent (the error names what).
    ``tokenizer``: written beside the weights by :func:`k3nn.tokenizer.save_tokenizer` (with ``chat_template``;
    the model config's eos / bos / pad ids name its special tokens when the tokenizer does not)."""
    if format is None:
        format = default_format(model.config)
    if format not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {format!r}")
    if format == "transformers":  # transformers' runtime layout: its KimiLinear or DeepseekV3 classes load it
        c = model.config
        why = (None if c.model_type in DEEPSEEK_TYPES and c.deepseek_incompatibility() is None
               else c.transformers_incompatibility())
        if why is not None:
            raise ValueError(
                f"format='transformers' writes transformers' layout, and transformers has no class for this model "
                f"(KimiLinearForCausalLM: {why}): save it with format='k3nn' (k3nn's layout; transformers loads it "
                f"through k3nn's AutoModelForCausalLM registration) or format='moonshot' (the original Kimi layout)")
    if tokenizer is None and chat_template is not None:
        raise ValueError("chat_template is written with the tokenizer: pass tokenizer= too")
    if model.device.type == "meta":
        raise RuntimeError("cannot save a model whose weights are on the meta device")
    os.makedirs(save_directory, exist_ok=True)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if model.config.rope_interleave:
        sd = interleave_rope(model, sd)
    sd = FORMATS[format].from_native(sd)
    write_safetensors(sd, save_directory, max_shard_size, {"k3nn_format": format})
    cfg = model.config.to_dict()
    cfg["dtype"] = str(model.dtype).replace("torch.", "")
    if format == "k3nn":  # stacked experts: name the layout, so no loader takes it for transformers' own
        cfg["architectures"] = ["KimiK3ForCausalLM"]
        cfg["k3nn_layout"] = "k3nn"
    with open(os.path.join(save_directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    from ..hf_surface import own_generation_config

    gc = own_generation_config(model)
    if gc is not None:
        gc.save_pretrained(save_directory)
    if tokenizer is not None:
        from ..tokenizer import save_tokenizer

        c = model.config
        save_tokenizer(tokenizer, save_directory, chat_template=chat_template, vocab_size=c.vocab_size,
                       eos_token=c.eos_token_id, bos_token=c.bos_token_id, pad_token=c.pad_token_id,
                       defaults_only=True)
