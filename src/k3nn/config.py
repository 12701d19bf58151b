"""KimiK3Config: every architectural switch of the Kimi K3 family, with presets.

Layer indices are 0-based in memory (``kda_layers``, ``mla_layers``). In ``config.json`` they are written the
way Kimi Linear and Kimi K3 write them: 1-based lists under ``linear_attn_config``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

GateKind = Literal["softplus", "lower_bound"]
MoEKind = Literal["standard", "latent"]
Activation = Literal["silu", "situ"]

__all__ = ["KimiK3Config"]

#: text model types with the DeepSeek-V3 architecture (Kimi K2, the text model of Kimi K2.5)
DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2")

#: transformers' ``DeepseekV3Config`` defaults, for keys a DeepSeek-V3 config.json leaves out
_DEEPSEEK_DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_interleave": True, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1,
}


def _is_float_type(tp) -> bool:
    return tp is float or (typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None))
                           and float in typing.get_args(tp))


def _type_ok(v, tp) -> tuple[bool, str]:
    """(whether v is of the annotated type tp, a description of tp for the error)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True, "anything"
    if origin is Literal:
        return v in args, f"one of {list(args)}"
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        results = [_type_ok(v, a) for a in args]
        return any(ok for ok, _ in results), " or ".join(w for _, w in results)
    if origin is list:
        (inner,) = args or (Any,)
        return isinstance(v, list) and all(_type_ok(x, inner)[0] for x in v), f"a list of {_type_ok(0, inner)[1]}"
    if origin is dict:
        return isinstance(v, dict), "a dict"
    if tp is type(None):
        return v is None, "null"
    if tp is bool:
        return isinstance(v, bool), "true or false"
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool), "an integer"
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
    if tp is str:
        return isinstance(v, str), "a string"
    return isinstance(v, tp), tp.__name__


def check_field_types(obj) -> None:
    """Every field of the dataclass ``obj`` holds its annotated type (ints as ints, not "64"; bools as bools, not
    "no"), else a TypeError naming the class and field; ints given for float fields become floats."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        ok, want = _type_ok(v, hints[f.name])
        if not ok:
            raise TypeError(f"{type(obj).__name__}: {f.name} must be {want}, got {v!r} ({type(v).__name__})")
        if isinstance(v, int) and not isinstance(v, bool) and _is_float_type(hints[f.name]):
            setattr(obj, f.name, float(v))


#: config.json keys that transformers or Moonshot write and k3nn has no use for (read, dropped without a warning)
_IGNORED_KEYS = frozenset({
    "architectures", "auto_map", "num_key_value_heads", "pretraining_tp", "attention_bias", "attention_dropout",
    "output_router_logits", "router_aux_loss_coef", "use_cache", "transformers_version", "dtype", "torch_dtype",
    "_name_or_path", "_attn_implementation", "layer_types", "qk_head_dim", "head_dim", "rope_scaling",
    "rope_parameters", "moe_layer_freq_type", "use_grouped_topk", "topk_method", "scoring_func", "seq_aux",
    "aux_loss_alpha", "ep_size", "num_nextn_predict_layers", "quantization_config", "k3nn_layout",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "is_encoder_decoder",
    "chunk_size_feed_forward", "tie_encoder_decoder", "problem_type", "id2label", "label2id",
    "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "bad_words_ids", "max_length", "min_length", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "num_beams", "generation_config", "mlp_bias", "use_qk_norm",
})


@dataclass
class KimiK3Config:
    """Every switch of a Kimi K3-family model: the trunk, the layer pattern, KDA, MLA, AttnRes, MLP / MoE.

    Fields are grouped as in the source; each is checked for type and range on construction (a ValueError or
    TypeError naming the field). Layer indices are 0-based here (``mla_layers``; the rest are KDA layers), while
    config.json's ``linear_attn_config.kda_layers / full_attn_layers`` are 1-based: :meth:`from_dict` and
    :meth:`to_dict` translate. The presets (:meth:`tiny`, :meth:`small`, :meth:`kimi_linear_48b`, :meth:`k3`,
    :meth:`k3_slice`) take field overrides as keyword arguments.

    Main switches: ``kda_gate`` ("softplus": Kimi Linear's ``g = -exp(A_log)·softplus(f + dt_bias)``;
    "lower_bound": K3's ``g = gate_lower_bound·sigmoid(exp(A_log)·(f + dt_bias))``), ``use_full_rank_gate``
    (KDA output gate), ``mla_use_nope`` / ``mla_use_output_gate`` / ``q_lora_rank`` (MLA), ``use_attn_res`` and
    ``attn_res_block_size`` (Block Attention Residuals), ``moe_kind`` ("standard" DeepSeek / Kimi Linear MoE or
    "latent" Stable LatentMoE with ``routed_expert_hidden_size``), ``hidden_act`` ("silu" or "situ" with
    ``activation_situ_beta`` / ``activation_situ_linear_beta``), ``mxfp4_experts``. ``extra`` keeps config.json keys
    k3nn does not use, for round trips.

    Example::

        cfg = KimiK3Config.tiny()                          # < 1M parameters, every K3 feature on
        cfg = KimiK3Config.small(num_hidden_layers=8)      # a preset with an override
        big = KimiK3Config.k3()                            # Kimi K3: 93 layers, 896 experts top-16, MXFP4 experts
        cfg.kda_layers, cfg.mla_layers                     # ([0, 2], [1, 3]) for tiny()
    """

    # --- trunk ---------------------------------------------------------------------------------------
    vocab_size: int = 163840
    hidden_size: int = 2304
    num_hidden_layers: int = 27
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    # --- layer pattern (0-based); layers not listed in mla_layers are KDA ---------------------------
    mla_layers: list[int] = field(default_factory=list)
    # --- KDA --------------------------------------------------------------------------------------------
    kda_num_heads: int = 32
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    kda_gate: GateKind = "softplus"  # Kimi Linear: -exp(A_log)*softplus(f+dt_bias); K3: lower-bounded sigmoid
    gate_lower_bound: float = -5.0
    use_full_rank_gate: bool = False  # output gate: low-rank (g_a, g_b) or full-rank g_proj
    # --- MLA --------------------------------------------------------------------------------------------
    num_attention_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True  # no rotary embedding on the rope part (Kimi Linear, K3)
    mla_use_output_gate: bool = False  # K3: sigmoid(g_proj x) between W_UV and o_proj
    rope_theta: float = 10000.0
    #: the checkpoint stores each head's rope dims as interleaved pairs (DeepSeek-V3 / Kimi K2.5, transformers'
    #: ``rope_interleave``); k3nn rotates halves (NeoX), so the loader permutes those rows of q and k_r (exact: the
    #: same permutation on both sides of every dot product) and ``save_pretrained`` permutes them back
    rope_interleave: bool = False
    # --- Attention Residuals (K3) ---------------------------------------------------------------------
    use_attn_res: bool = False
    attn_res_block_size: int = 12
    # --- MLP / MoE ------------------------------------------------------------------------------------
    intermediate_size: int = 9216  # dense MLP width (layers < first_k_dense_replace)
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_kind: MoEKind = "standard"
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 1024
    routed_scaling_factor: float = 2.446
    moe_renormalize: bool = True
    moe_router_activation_func: Literal["sigmoid", "softmax"] = "sigmoid"
    num_expert_group: int = 1
    topk_group: int = 1
    routed_expert_hidden_size: int | None = None  # latent width of Stable LatentMoE
    latent_moe_use_norm: bool = True
    hidden_act: Activation = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    mxfp4_experts: bool = False
    # --- bookkeeping ------------------------------------------------------------------------------------
    model_type: str = "kimi_k3"
    extra: dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, kept for round trips

    def __post_init__(self) -> None:
        self._check_types()
        self.validate()

    def _check_types(self) -> None:
        check_field_types(self)

    # ------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the ranges and the consistency of the fields (run on construction; call it again after changing
        a field in place). Raises a ValueError starting ``KimiK3Config:`` that names the field."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"KimiK3Config: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim",
                     "num_attention_heads", "kv_lora_rank", "v_head_dim", "intermediate_size",
                     "short_conv_kernel_size", "attn_res_block_size"):
            need(int(getattr(self, name)) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(self.qk_nope_head_dim + self.qk_rope_head_dim > 0, "qk_nope_head_dim + qk_rope_head_dim must be > 0")
        need(self.kda_gate in ("softplus", "lower_bound"), f"kda_gate must be 'softplus' or 'lower_bound', got {self.kda_gate!r}")
        need(self.moe_kind in ("standard", "latent"), f"moe_kind must be 'standard' or 'latent', got {self.moe_kind!r}")
        need(self.hidden_act in ("silu", "situ"), f"hidden_act must be 'silu' or 'situ', got {self.hidden_act!r}")
        need(self.gate_lower_bound < 0, f"gate_lower_bound must be negative, got {self.gate_lower_bound}")
        need(1 <= self.num_experts_per_token <= self.num_experts,
             f"num_experts_per_token must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_token}")
        need(self.num_experts % max(self.num_expert_group, 1) == 0, "num_experts must be divisible by num_expert_group")
        if self.num_expert_group > 1:
            per = self.num_experts // self.num_expert_group * self.topk_group
            need(self.num_experts_per_token <= per,
                 f"num_experts_per_token ({self.num_experts_per_token}) exceeds the experts of the topk_group "
                 f"kept groups ({per})")
        need(self.kda_head_dim <= 256, f"kda_head_dim must be <= 256, got {self.kda_head_dim}")
        bad = [i for i in self.mla_layers if not 0 <= i < self.num_hidden_layers]
        need(not bad, f"mla_layers has indices outside [0, {self.num_hidden_layers}): {bad}")
        need(len(set(self.mla_layers)) == len(self.mla_layers), "mla_layers has duplicates")
        self.mla_layers = sorted(int(i) for i in self.mla_layers)
        if self.model_type in DEEPSEEK_TYPES:
            bad = self.deepseek_incompatibility()
            need(bad is None, f"model_type {self.model_type!r} is the DeepSeek-V3 architecture, but {bad}")
        if self.moe_kind == "latent":
            need(self.routed_expert_hidden_size is not None and self.routed_expert_hidden_size > 0,
                 "moe_kind='latent' needs routed_expert_hidden_size")
        if self.mxfp4_experts:
            d_in = self.routed_expert_hidden_size if self.moe_kind == "latent" else self.hidden_size
            need(d_in % 32 == 0 and self.moe_intermediate_size % 32 == 0,
                 "mxfp4_experts needs expert input and intermediate widths divisible by 32")

    # --- derived ------------------------------------------------------------------------------------
    @property
    def kda_layers(self) -> list[int]:
        """The 0-based indices of the KDA layers: every layer not in ``mla_layers``."""
        mla = set(self.mla_layers)
        return [i for i in range(self.num_hidden_layers) if i not in mla]

    def is_mla_layer(self, i: int) -> bool:
        """Layer ``i`` (0-based) is an MLA layer (else KDA)."""
        return i in set(self.mla_layers)

    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i`` (0-based) has a MoE block (else the dense MLP): from ``first_k_dense_replace`` on, every
        ``moe_layer_freq``-th layer."""
        return i >= self.first_k_dense_replace and (i - self.first_k_dense_replace) % self.moe_layer_freq == 0

    @property
    def qk_head_dim(self) -> int:
        """MLA query / key head width: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_input_size(self) -> int:
        """The width routed experts read: ``routed_expert_hidden_size`` (the latent) for Stable LatentMoE, else
        ``hidden_size``."""
        return self.routed_expert_hidden_size if self.moe_kind == "latent" else self.hidden_size

    @property
    def shared_expert_intermediate_size(self) -> int:
        """Width of the shared expert MLP: ``num_shared_experts · moe_intermediate_size``."""
        return self.num_shared_experts * self.moe_intermediate_size

    def transformers_incompatibility(self) -> str | None:
        """None when transformers' ``KimiLinearForCausalLM`` implements this model exactly, else why not."""
        checks = [
            (self.model_type == "kimi_linear", f"model_type is {self.model_type!r}, not 'kimi_linear'"),
            (not self.use_attn_res, "AttnRes is on"),
            (self.moe_kind == "standard", f"moe_kind is {self.moe_kind!r}"),
            (not self.mxfp4_experts, "MXFP4 experts"),
            (self.kda_gate == "softplus", f"kda_gate is {self.kda_gate!r}"),
            (not self.mla_use_output_gate, "MLA output gate"),
            (self.mla_use_nope, "MLA with rotary positions"),
            (self.hidden_act == "silu", f"hidden_act is {self.hidden_act!r}"),
            (not self.use_full_rank_gate, "full-rank KDA output gate"),
            (self.moe_layer_freq == 1, f"moe_layer_freq is {self.moe_layer_freq}"),
        ]
        bad = [why for ok, why in checks if not ok]
        return "; ".join(bad) if bad else None

    def deepseek_incompatibility(self) -> str | None:
        """None when this is a DeepSeek-V3 model (the text model of Kimi K2 / K2.5: every layer MLA with RoPE,
        standard MoE, SiLU), else why not."""
        checks = [
            (self.mla_layers == list(range(self.num_hidden_layers)), "not every layer is MLA"),
            (not self.use_attn_res, "AttnRes is on"),
            (self.moe_kind == "standard", f"moe_kind is {self.moe_kind!r}"),
            (self.hidden_act == "silu", f"hidden_act is {self.hidden_act!r}"),
            (not self.mla_use_output_gate, "MLA output gate"),
            (not self.mla_use_nope, "MLA without rotary positions"),
            (not self.mxfp4_experts, "MXFP4 experts"),
            (self.moe_router_activation_func == "sigmoid", "softmax router"),
        ]
        bad = [why for ok, why in checks if not ok]
        return "; ".join(bad) if bad else None

    def replace(self, **changes: Any) -> "KimiK3Config":
        """A copy with ``changes`` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    # --- presets --------------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> "KimiK3Config":
        """< 1M parameters, every K3 feature on: for CPU tests."""
        base = dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, mla_layers=[1, 3],
            kda_num_heads=2, kda_head_dim=16, kda_gate="lower_bound", use_full_rank_gate=True,
            num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, mla_use_nope=True, mla_use_output_gate=True,
            use_attn_res=True, attn_res_block_size=2,
            intermediate_size=128, first_k_dense_replace=1, moe_kind="latent", num_experts=8,
            num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
            routed_expert_hidden_size=32, routed_scaling_factor=1.0, hidden_act="situ",
            max_position_embeddings=4096, eos_token_id=None,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def small(cls, **overrides: Any) -> "KimiK3Config":
        """~100M parameters with K3's structure (KDA:MLA 3:1, AttnRes, Stable LatentMoE, SiTU)."""
        base = dict(
            vocab_size=4096, hidden_size=512, num_hidden_layers=8, mla_layers=[3, 7],
            kda_num_heads=8, kda_head_dim=64, kda_gate="lower_bound", use_full_rank_gate=True,
            num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
            v_head_dim=64, mla_use_nope=True, mla_use_output_gate=True,
            use_attn_res=True, attn_res_block_size=4,
            intermediate_size=2048, first_k_dense_replace=1, moe_kind="latent", num_experts=32,
            num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=512,
            routed_expert_hidden_size=256, routed_scaling_factor=1.0, hidden_act="situ",
            max_position_embeddings=65536,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def kimi_linear_48b(cls, **overrides: Any) -> "KimiK3Config":
        """The public Kimi-Linear-48B-A3B dims (model_type kimi_linear)."""
        base = dict(
            vocab_size=163840, hidden_size=2304, num_hidden_layers=27,
            mla_layers=[3, 7, 11, 15, 19, 23, 26],
            kda_num_heads=32, kda_head_dim=128, kda_gate="softplus", use_full_rank_gate=False,
            num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, mla_use_output_gate=False,
            use_attn_res=False, intermediate_size=9216, first_k_dense_replace=1, moe_kind="standard",
            num_experts=256, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=1024,
            routed_scaling_factor=2.446, hidden_act="silu", bos_token_id=163584, eos_token_id=163586,
            model_type="kimi_linear",
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def k3(cls, **overrides: Any) -> "KimiK3Config":
        """Kimi K3: 93 layers (69 KDA + 24 gated MLA), AttnRes, Stable LatentMoE with MXFP4 experts."""
        mla = [i - 1 for i in list(range(4, 93, 4)) + [93]]
        base = dict(
            vocab_size=163840, hidden_size=7168, num_hidden_layers=93, mla_layers=mla,
            kda_num_heads=96, kda_head_dim=128, kda_gate="lower_bound", gate_lower_bound=-5.0,
            use_full_rank_gate=True,
            num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True,
            use_attn_res=True, attn_res_block_size=12,
            intermediate_size=33792, first_k_dense_replace=1, moe_kind="latent", num_experts=896,
            num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
            routed_expert_hidden_size=3584, latent_moe_use_norm=True, routed_scaling_factor=1.0,
            hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
            mxfp4_experts=True, model_type="kimi_k3",
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def k3_slice(cls, **overrides: Any) -> "KimiK3Config":
        """K3's real layer dims with 8 layers (KDA ×6, gated MLA at 3 and 7: K3's every-4th + last pattern) and
        128 MXFP4 experts top-16; AttnRes block 4 so the slice has two blocks. About 31 GB of weights (15 GB bf16
        dense, 16 GB MXFP4 experts), so it runs on one GPU: the end-to-end decode benchmarks use it."""
        base = dict(num_hidden_layers=8, mla_layers=[3, 7], num_experts=128, num_experts_per_token=16,
                    attn_res_block_size=4)
        base.update(overrides)
        return cls.k3(**base)

    # --- (de)serialisation ----------------------------------------------------------------------------
    def to_dict(self, form: str = "moonshot") -> dict[str, Any]:
        """A config.json dict in the Kimi Linear / K3 layout (1-based layer lists); a DeepSeek-V3 model type
        (Kimi K2 / K2.5 text) in DeepSeek's keys, ``form`` ``"moonshot"`` (``rope_theta`` / ``rope_scaling``) or
        ``"transformers"`` (``rope_parameters``, model_type ``deepseek_v3``)."""
        if self.model_type in DEEPSEEK_TYPES:
            return self._to_deepseek_dict(form)
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra",)}
        mla = d.pop("mla_layers")
        d["linear_attn_config"] = {
            "kda_layers": [i + 1 for i in self.kda_layers],
            "full_attn_layers": [i + 1 for i in mla],
            "num_heads": d.pop("kda_num_heads"),
            "head_dim": d.pop("kda_head_dim"),
            "short_conv_kernel_size": d.pop("short_conv_kernel_size"),
            "gate_lower_bound": d.pop("gate_lower_bound") if self.kda_gate == "lower_bound" else None,
            "use_full_rank_gate": d.pop("use_full_rank_gate"),
        }
        d.pop("kda_gate")
        d.pop("gate_lower_bound", None)
        d["num_key_value_heads"] = self.num_attention_heads
        d["architectures"] = ["KimiLinearForCausalLM"] if self.model_type == "kimi_linear" else ["KimiK3ForCausalLM"]
        out = dict(self.extra)
        out.update(d)
        return out

    def _to_deepseek_dict(self, form: str) -> dict[str, Any]:
        if form not in ("moonshot", "transformers"):
            raise ValueError(f"form must be 'moonshot' or 'transformers', got {form!r}")
        d = {k: getattr(self, k) for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "intermediate_size", "first_k_dense_replace", "moe_layer_freq", "moe_intermediate_size",
            "routed_scaling_factor", "topk_group", "rope_interleave")}
        d.update(n_routed_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_token,
                 n_shared_experts=self.num_shared_experts, norm_topk_prob=self.moe_renormalize,
                 n_group=self.num_expert_group, hidden_act="silu", num_key_value_heads=self.num_attention_heads,
                 scoring_func="sigmoid", topk_method="noaux_tc", attention_bias=False)
        if form == "transformers":
            d.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                     rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"})
        else:
            d.update(model_type=self.model_type, architectures=["DeepseekV3ForCausalLM"], rope_theta=self.rope_theta,
                     rope_scaling=None)
        out = dict(self.extra)
        out.update(d)
        return out

    @classmethod
    def _deepseek_kwargs(cls, d: dict[str, Any]) -> dict[str, Any]:
        """The k3nn fields of a DeepSeek-V3 (Kimi K2 / K2.5 text) config.json; consumes the keys it reads."""
        for k, v in _DEEPSEEK_DEFAULTS.items():
            d.setdefault(k, v)
        rope = d.pop("rope_parameters", None) or {}
        scaling = d.pop("rope_scaling", None) or {}
        kind = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type") or "default"
        if kind != "default":
            raise ValueError(f"rope scaling {kind!r} (rope_scaling / rope_parameters) is not implemented by k3nn's "
                             f"MLA, which rotates by rope_theta alone: positions would be wrong")
        if d.pop("attention_bias", False):
            raise ValueError("attention_bias = true: k3nn's MLA projections have no bias")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r}: the DeepSeek-V3 MoE of k3nn uses silu")
        if d.pop("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError("scoring_func must be 'sigmoid' (DeepSeek-V3's noaux_tc router)")
        n = int(d.get("num_hidden_layers"))
        kw = dict(mla_layers=list(range(n)), mla_use_nope=False, mla_use_output_gate=False, use_attn_res=False,
                  moe_kind="standard", hidden_act="silu", mxfp4_experts=False)
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        return kw

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KimiK3Config":
        """Read a k3nn, Kimi Linear (remote code or transformers ``kimi_linear``), K3 or DeepSeek-V3 (Kimi K2 /
        K2.5 text) config.json dict; a multimodal wrapper gives its ``text_config``."""
        if not isinstance(d, dict):
            raise TypeError(f"config must be a dict, got {type(d).__name__}")
        d = dict(d)
        if "text_config" in d and isinstance(d["text_config"], dict):  # K3 / K2.5 ship a multimodal wrapper
            top, d = d, {**d["text_config"]}
            for k in ("bos_token_id", "eos_token_id", "pad_token_id"):  # Moonshot writes them at the top
                if top.get(k) is not None and d.get(k) is None:
                    d[k] = top[k]
            if "tie_word_embeddings" in top:  # transformers ties by the wrapper's flag
                d["tie_word_embeddings"] = top["tie_word_embeddings"]
            elif top.get("model_type") == "kimi_k25":
                d["tie_word_embeddings"] = True  # Kimi_K25Config's default
        deepseek = d.get("model_type") in DEEPSEEK_TYPES
        pre = cls._deepseek_kwargs(d) if deepseek else {}
        known = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        lac = d.pop("linear_attn_config", None) or {}
        n_layers = int(d.get("num_hidden_layers", cls.num_hidden_layers))
        if lac:
            full = lac.get("full_attn_layers")
            kda = lac.get("kda_layers")
            if full is not None:
                kw["mla_layers"] = [int(i) - 1 for i in full]
            elif kda is not None:
                kw["mla_layers"] = [i for i in range(n_layers) if i + 1 not in set(kda)]
            if full is not None and kda is not None:
                both = sorted(set(full) & set(kda))
                cover = set(full) | set(kda)
                if both or cover != set(range(1, n_layers + 1)):
                    raise ValueError(
                        "linear_attn_config: kda_layers and full_attn_layers (1-based) must partition "
                        f"1..{n_layers}; overlap {both}, missing {sorted(set(range(1, n_layers + 1)) - cover)}")
            for src, dst in (("num_heads", "kda_num_heads"), ("head_dim", "kda_head_dim"),
                             ("short_conv_kernel_size", "short_conv_kernel_size"),
                             ("use_full_rank_gate", "use_full_rank_gate")):
                if lac.get(src) is not None:
                    kw[dst] = lac[src]
            if lac.get("gate_lower_bound") is not None:
                kw["kda_gate"] = "lower_bound"
                kw["gate_lower_bound"] = float(lac["gate_lower_bound"])
            elif "kda_gate" not in d:
                kw["kda_gate"] = "softplus"
        if not lac and isinstance(d.get("layer_types"), list):  # transformers' per-layer list
            kw["mla_layers"] = [i for i, t in enumerate(d["layer_types"]) if t == "full_attention"]
        mlp_types = d.pop("mlp_layer_types", None)
        if isinstance(mlp_types, list) and "first_k_dense_replace" not in d:
            dense = [i for i, t in enumerate(mlp_types) if t == "dense"]
            if dense != list(range(len(dense))):
                raise ValueError(f"mlp_layer_types: dense layers must come first, got {mlp_types}")
            kw["first_k_dense_replace"] = len(dense)
        for src, dst in (("linear_num_heads", "kda_num_heads"), ("linear_head_dim", "kda_head_dim"),
                         ("linear_conv_kernel_dim", "short_conv_kernel_size")):  # transformers 5.x flat keys
            if d.get(src) is not None:
                kw.setdefault(dst, d[src])
        for derived in ("layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
                        "qk_head_dim", "head_dim", "dtype", "torch_dtype", "transformers_version", "use_cache"):
            d.pop(derived, None)
        aliases = {  # DeepSeek / transformers spellings
            "n_routed_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
            "n_shared_experts": "num_shared_experts", "norm_topk_prob": "moe_renormalize",
            "n_group": "num_expert_group", "num_local_experts": "num_experts",
            "model_max_length": "max_position_embeddings",
        }
        extra: dict[str, Any] = {}
        unknown = []
        for k, v in d.items():
            k2 = aliases.get(k, k)
            if k2 in known and k2 not in ("extra",):
                kw.setdefault(k2, v)
            elif k not in _IGNORED_KEYS:
                extra[k] = v
                unknown.append(k)
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, sorted(known | set(aliases)), n=1, cutoff=0.8)
                hints.append(f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k))
            warnings.warn(f"config: unknown key(s) {', '.join(hints)} are kept in config.extra but not used by "
                          f"the model", UserWarning, stacklevel=2)
        kw.update(pre)
        if "mla_layers" in kw:
            kw["mla_layers"] = list(kw["mla_layers"])
        kw["extra"] = extra
        if kw.get("model_type") not in (None, "kimi_k3", "kimi_linear", "kimi_k3_text", *DEEPSEEK_TYPES):
            raise ValueError(f"config.json: model_type {kw['model_type']!r} is not a Kimi Linear / K3 / Kimi K2 "
                             f"(DeepSeek-V3) model")
        return cls(**kw)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``directory/config.json`` (:meth:`to_dict`; the directory is created if needed)."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, *, revision: str | None = None,
                        cache_dir: str | None = None, local_files_only: bool | None = None,
                        token: str | bool | None = None) -> "KimiK3Config":
        """The config.json of a checkpoint directory, or of a hub repo (only that file is fetched, through
        huggingface_hub: cache, revision, ``local_files_only`` and ``HF_HUB_OFFLINE`` honoured). transformers'
        name: PEFT calls it on ``type(model.config)``."""
        p = os.fspath(path_or_repo_id)
        if os.path.isdir(p):
            return cls.from_json_file(os.path.join(p, "config.json"))
        from huggingface_hub import hf_hub_download

        return cls.from_json_file(hf_hub_download(p, "config.json", revision=revision, cache_dir=cache_dir,
                                                  local_files_only=bool(local_files_only), token=token))

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "KimiK3Config":
        """Read a config.json; every error names the file."""
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"config.json at {path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(d)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{path}: {e}") from None
