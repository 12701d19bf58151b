"""KimiK3: embedding → decoder layers (KDA or MLA mixer; dense MLP or MoE) → final norm → lm_head.

Residual stream: plain pre-norm residuals, or K3's Block Attention Residuals (``use_attn_res``): the layer
threads a running partial sum and a stack of completed blocks; every sublayer input is a softmax-over-depth
mix of them (see :mod:`k3nn.layers.attnres`).

Parameter names follow the Moonshot checkpoint layout (``model.layers.{i}.self_attn.q_proj.weight``,
``model.layers.{i}.block_sparse_moe.experts.w1`` stacked over experts, ...); see :mod:`k3nn.checkpoint`.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from . import ops
from .cache.hybrid import HybridCache
from .config import KimiK3Config
from .generation import GenerationMixin
from .hf_surface import TransformersSurface, causal_lm_loss, check_adapters, forward_kwargs
from .kernels.registry import backend as use_backend
from .layers.kda import KimiDeltaAttention
from .layers.linear import Linear
from .layers.mla import MultiHeadLatentAttention
from .layers.mlp import MLP
from .layers.moe import MoE, Experts, Router
from .layers.norm import GatedRMSNorm, RMSNorm

log = logging.getLogger(__name__)

__all__ = ["KimiK3", "KimiK3Model", "DecoderLayer", "KimiK3Output"]


@dataclass
class KimiK3Output:
    """What :meth:`KimiK3.forward` returns: ``logits`` [B, T, V] in the lm_head's dtype (only the last
    ``logits_to_keep`` positions when that is > 0); ``hidden_states``: one [B, T, d] per
    layer in ``output_hidden_layers`` (the DSpark drafter's context), else None; ``last_hidden_state`` [B, T, d]: the
    final-norm output; ``cache``: the cache the call used (None without one). Other fields are described where
    :meth:`KimiK3.forward` sets them."""

    logits: torch.Tensor
    hidden_states: list[torch.Tensor] | None = None  # per requested layer output (DSpark context)
    last_hidden_state: torch.Tensor | None = None
    cache: HybridCache | None = None
    loss: torch.Tensor | None = None  # forward(labels=...): transformers' causal-LM loss (fp32 scalar)


@dataclass
class ResidualState:
    """What flows between decoder layers: the running (partial) sum, and AttnRes' completed blocks."""

    partial: torch.Tensor | None
    blocks: list[torch.Tensor] = field(default_factory=list)


class DecoderLayer(nn.Module):
    """Decoder layer ``layer_idx``: a token mixer (:class:`~k3nn.layers.mla.MultiHeadLatentAttention` when
    ``config.is_mla_layer(layer_idx)``, else :class:`~k3nn.layers.kda.KimiDeltaAttention`) and a feed-forward block
    (:class:`~k3nn.layers.moe.MoE` when ``config.is_moe_layer(layer_idx)``, else the dense
    :class:`~k3nn.layers.mlp.MLP`), each after an RMSNorm, joined by plain residuals or, with ``use_attn_res``, by
    Block Attention Residuals (two pseudo-queries: before the mixer and before the feed-forward block)."""

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_mla = config.is_mla_layer(layer_idx)
        self.self_attn = (MultiHeadLatentAttention(config, layer_idx) if self.is_mla
                          else KimiDeltaAttention(config, layer_idx))
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = MoE(config)
        else:
            self.mlp = MLP(d, config.intermediate_size, config.hidden_act, config.activation_situ_beta,
                           config.activation_situ_linear_beta)
        self.attn_res = config.use_attn_res
        self.block_size = config.attn_res_block_size
        if self.attn_res:
            self.self_attention_res_norm = RMSNorm(d, eps)
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)

    @property
    def ffn(self) -> nn.Module:
        """The feed-forward block: the MoE (``block_sparse_moe``) or the dense MLP (``mlp``)."""
        return self.block_sparse_moe if self.is_moe else self.mlp

    def mix(self, which: str, sources: list[torch.Tensor]) -> torch.Tensor:
        """The AttnRes depth mix of ``sources`` ([..., d] each) with the ``which`` pseudo-query
        (``"self_attention"`` or ``"mlp"``)."""
        norm, proj = getattr(self, f"{which}_res_norm"), getattr(self, f"{which}_res_proj")
        return ops.attnres_mix(sources, proj.weight[0], norm.weight, norm.eps)

    def mixer(self, h: torch.Tensor, state, attention_mask, positions, start, checkpoint_positions,
              residual: torch.Tensor | None = None):
        """The token mixer's output [B, T, d] for the residual stream h [B, T, d] (input RMSNorm first), plus
        ``residual`` when given (added inside the output projection's GEMM)."""
        return self.attention(self.input_layernorm(h), state, attention_mask, positions, start, checkpoint_positions,
                              residual)

    def attention(self, x: torch.Tensor, state, attention_mask, positions, start, checkpoint_positions,
                  residual: torch.Tensor | None = None):
        """The token mixer on an already normalised input."""
        if self.is_mla:
            return self.self_attn(x, state, attention_mask, positions, start, residual=residual)
        return self.self_attn(x, state, attention_mask, checkpoint_positions=checkpoint_positions, residual=residual)

    def forward(self, rs: ResidualState, state=None, attention_mask=None, positions=None, start: int = 0,
                checkpoint_positions=None) -> ResidualState:
        """One layer over the residual state (the running sum, and with AttnRes the completed blocks); ``state``:
        this layer's cache entry (None without a cache); ``positions`` [B, T] and ``start``: where the new tokens
        sit (MLA), ``checkpoint_positions``: KDA states to export in the same pass."""
        if not self.attn_res:  # the residual adds inside the output GEMMs (an MLP's; MoE adds after)
            h = self.mixer(rs.partial, state, attention_mask, positions, start, checkpoint_positions, rs.partial)
            x = self.post_attention_layernorm(h)
            h = self.ffn(x, add_to=h) if isinstance(self.ffn, MLP) else h + self.ffn(x)
            return ResidualState(h)
        blocks, partial = list(rs.blocks), rs.partial
        h = self.mix("self_attention", blocks + [partial]) if blocks else partial
        if self.layer_idx % self.block_size == 0:  # mix before push: the sources are the same
            blocks.append(partial)
            partial = None
        a = self.mixer(h, state, attention_mask, positions, start, checkpoint_positions)
        partial = a if partial is None else partial + a
        m = self.mix("mlp", blocks + [partial])
        partial = partial + self.ffn(self.post_attention_layernorm(m))
        return ResidualState(partial, blocks)


class KimiK3Model(nn.Module):
    """The decoder stack without the lm_head: ``embed_tokens`` → ``layers`` → (the output AttnRes mix) → ``norm``.
    At inference with AttnRes it runs the exact two-phase form (one batched phase per block of layers, an
    online-softmax merge per sublayer)."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.use_attn_res:
            self.output_attn_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)

    #: inference with AttnRes uses the two-phase form (one batched phase 1 per block of layers, then an
    #: online-softmax merge per sublayer fused with the residual add and the next RMSNorm); same function,
    #: different rounding order. Training (grad enabled) and fp64 keep the per-sublayer mix.
    attn_res_two_phase: bool = True

    def _use_two_phase(self, h: torch.Tensor) -> bool:
        return (self.config.use_attn_res and self.attn_res_two_phase and not torch.is_grad_enabled()
                and h.dtype in (torch.float32, torch.float16, torch.bfloat16))

    def _block_queries(self, s: int, e: int):
        """Stacked pseudo-queries of layers [s, e) in call order (+ the output query after the last layer)."""
        projs, norms = [], []
        for i in range(s, e):
            lay = self.layers[i]
            projs += [lay.self_attention_res_proj, lay.mlp_res_proj]
            norms += [lay.self_attention_res_norm, lay.mlp_res_norm]
        if e == len(self.layers):
            projs.append(self.output_attn_res_proj)
            norms.append(self.output_attn_res_norm)
        return torch.stack([p.weight[0] for p in projs]), torch.stack([n.weight for n in norms]), norms[0].eps

    def _two_phase(self, h, cache, attention_mask, positions, start, output_layers, checkpoint_positions):
        """Block AttnRes, two-phase (paper Algorithm 1): the stored blocks change only at block starts, so all
        queries of a block are scored against them once; each sublayer then merges the intra-block partial."""
        bs, L = self.config.attn_res_block_size, len(self.layers)
        blocks: list[torch.Tensor] = []
        partial, pending = h, None
        captured = []
        for s in range(0, L, bs):
            e = min(s + bs, L)
            if pending is not None:
                partial, pending = partial + pending, None
            blocks.append(partial)  # mix before push: the attention query of layer s sees exactly these
            partial = None
            W, G, eps = self._block_queries(s, e)
            o, m, l = ops.attnres_phase1(blocks, W, G, eps)
            k = 0
            for i in range(s, e):
                lay = self.layers[i]
                state = cache.layers[i] if cache is not None else None
                r = ops.attnres_phase2(o[k], m[k], l[k], partial, W[k], G[k], eps, update=pending,
                                       post_norm_weight=lay.input_layernorm.weight,
                                       post_norm_eps=lay.input_layernorm.eps, dtype=h.dtype)
                partial = r.partial
                pending = lay.attention(r.normed, state, attention_mask, positions, start, checkpoint_positions)
                r = ops.attnres_phase2(o[k + 1], m[k + 1], l[k + 1], partial, W[k + 1], G[k + 1], eps,
                                       update=pending, post_norm_weight=lay.post_attention_layernorm.weight,
                                       post_norm_eps=lay.post_attention_layernorm.eps, dtype=h.dtype)
                partial = r.partial
                pending = lay.ffn(r.normed)
                k += 2
                if output_layers is not None and i in output_layers:
                    captured.append(partial + pending)
        r = ops.attnres_phase2(o[k], m[k], l[k], partial, W[k], G[k], eps, update=pending,
                               post_norm_weight=self.norm.weight, post_norm_eps=self.norm.eps, dtype=h.dtype)
        return r.normed, captured

    def forward(self, input_ids=None, inputs_embeds=None, cache: HybridCache | None = None, attention_mask=None,
                output_layers: list[int] | None = None, checkpoint_positions=None):
        """input_ids [B, T] (or ``inputs_embeds`` [B, T, d]) → (final-norm hidden states [B, T, d], the outputs of
        the layers in ``output_layers``, one [B, T, d] each). With ``cache`` the tokens continue the cached ones and
        the cache is committed; ``attention_mask`` [B, T] marks left padding."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = h.shape[:2]
        if cache is not None:
            start, positions = cache.begin(T, attention_mask)
        else:
            start = 0
            positions = (torch.arange(T, device=h.device).expand(B, T) if attention_mask is None
                         else (attention_mask.long().cumsum(1) - 1).clamp_min(0))
        if self._use_two_phase(h):
            out, captured = self._two_phase(h, cache, attention_mask, positions, start, output_layers,
                                            checkpoint_positions)
            if cache is not None:
                cache.commit(T, attention_mask)
            return out, captured
        rs = ResidualState(h)
        captured = []
        for i, layer in enumerate(self.layers):
            state = cache.layers[i] if cache is not None else None
            rs = layer(rs, state, attention_mask, positions, start, checkpoint_positions)
            if output_layers is not None and i in output_layers:
                captured.append(rs.partial)
        if cache is not None:
            cache.commit(T, attention_mask)
        if self.config.use_attn_res:
            n, p = self.output_attn_res_norm, self.output_attn_res_proj
            h = ops.attnres_mix(rs.blocks + [rs.partial], p.weight[0], n.weight, n.eps)
        else:
            h = rs.partial
        return self.norm(h), captured


def _refuse_images(pixel_values, image_grid_thw) -> None:
    if pixel_values is not None or image_grid_thw is not None:
        name = "pixel_values" if pixel_values is not None else "image_grid_thw"
        raise ValueError(f"{name}: KimiK3 is a text-only model and takes no images; a multimodal checkpoint loads "
                         f"with k3nn.KimiK3ForConditionalGeneration.from_pretrained")


class KimiK3(GenerationMixin, TransformersSurface, nn.Module):
    """The Kimi K3 family causal LM.

    ``KimiK3(config)`` builds on the meta device, then materialises and initialises the weights on ``device``
    (CPU by default) unless they would not fit (``K3NN_MAX_INIT_BYTES``, default 16 GiB): then the model stays on
    the meta device (parameter counting, sharding plans, ``from_pretrained``). Pass ``device="meta"`` to never
    allocate. ``backend`` selects the kernel backend for every forward of this model (None: the ambient choice).
    """

    def __init__(self, config: KimiK3Config, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, backend: str | None = None, seed: int | None = None):
        super().__init__()
        if not isinstance(config, KimiK3Config):
            raise TypeError(f"config must be a KimiK3Config, got {type(config).__name__}")
        if backend is not None:
            from .kernels.registry import _check_name

            _check_name(backend)
        self.config, self.backend = config, backend
        self.decode_prepared = False  # prepare_decode() packed the decode weights
        with torch.device("meta"):
            self.model = KimiK3Model(config)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if device is not None and torch.device(device).type == "meta":
            return
        nbytes = self.num_parameters(logical=False) * (torch.finfo(dtype or torch.float32).bits // 8)
        limit = int(os.environ.get("K3NN_MAX_INIT_BYTES", 16 << 30))
        if device is None and nbytes > limit:
            log.warning("KimiK3: %.1f GB of weights exceed K3NN_MAX_INIT_BYTES; the model stays on the meta "
                        "device (use from_pretrained or pass device=)", nbytes / 1e9)
            return
        self.to_empty(device=device or "cpu")
        self.tie_weights()
        if dtype is not None:
            self.to(dtype)
        self.init_weights(seed)

    def tie_weights(self) -> None:
        """lm_head shares the embedding when ``tie_word_embeddings`` (again after ``to_empty``, which gives every
        parameter its own storage)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- weights -------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the weights live (the lm_head's device)."""
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (the lm_head's; routing and decay-gate parameters stay fp32)."""
        return self.lm_head.weight.dtype

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Random init (normal(0, initializer_range) for projections, fla's gate init, zero AttnRes queries)."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0 if seed is None else seed)
        std = self.config.initializer_range

        def normal_(t: torch.Tensor, s: float = std) -> None:
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).mul_(s).to(t.dtype))

        for name, mod in self.named_modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                if name.endswith("_res_proj"):
                    mod.weight.zero_()
                else:
                    normal_(mod.weight)
            elif isinstance(mod, nn.Conv1d):
                normal_(mod.weight, 1.0 / math.sqrt(mod.weight.shape[-1]))
            elif isinstance(mod, (RMSNorm, GatedRMSNorm)):
                mod.weight.fill_(1.0)
            elif isinstance(mod, Router):
                normal_(mod.weight)
                mod.e_score_correction_bias.zero_()
            elif isinstance(mod, Experts):
                if mod.mxfp4:
                    from .quant.mxfp4 import mxfp4_quantize

                    for w in ("w1", "w3", "w2"):
                        packed = getattr(mod, f"{w}_packed")
                        shape = (*packed.shape[:-1], packed.shape[-1] * 2)
                        q = mxfp4_quantize(torch.randn(shape, generator=gen) * std)
                        packed.copy_(q.packed)
                        getattr(mod, f"{w}_scale").copy_(q.scale)
                else:
                    for w in ("w1", "w3", "w2"):
                        normal_(getattr(mod, w))
            elif isinstance(mod, KimiDeltaAttention):
                mod.reset_gate_parameters(gen)

    def prepare_decode(self, on: bool = True) -> "KimiK3":
        """Decode weight preparation: in every layer, the projections a token meets one after another on the same
        input become one GEMM (KDA's q|k|v|gate|f|β, MLA's q|kv_a|gate, the dense and shared MLPs' gate|up with one
        activation kernel and the shared experts' add inside the down projection). Every forward without autograd
        uses them, prompts as well as decode steps. Packing holds no second copy: the projections' parameters become
        views of the packed buffer (``on=False`` gives them their own storage again); a parameter replaced later
        is packed again at its next use. Packings that exist are kept (CUDA graphs captured over them stay valid).
        ``generate(decode_backend="latency_specialized")`` and the Engine call this."""
        for mod in self.modules():
            if mod is not self and hasattr(mod, "prepare_decode"):
                mod.prepare_decode(on)
        self.decode_prepared = bool(on)
        return self

    def num_parameters(self, active: bool = False, logical: bool = True) -> int:
        """Parameter count. ``logical`` counts MXFP4 experts by their logical weights (not packed bytes);
        ``active`` counts only the routed experts a token uses (top-k of E) plus everything else."""
        total = 0
        for mod in self.modules():
            if isinstance(mod, Experts):
                n = mod.logical_numel() if logical or not mod.mxfp4 else sum(b.numel() for b in mod.buffers())
                if active:
                    n = n * self.config.num_experts_per_token // self.config.num_experts
                total += n
                continue
            total += sum(p.numel() for p in mod.parameters(recurse=False))
        if self.config.tie_word_embeddings:
            total -= self.lm_head.weight.numel()
        return total

    # -- forward ---------------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_length: int, dtype: torch.dtype | None = None) -> HybridCache:
        """A hybrid cache for ``batch_size`` rows and up to ``max_length`` tokens (prompt + generation)."""
        return HybridCache(self.config, batch_size, max_length, dtype or self.dtype, self.device)

    def _check_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache) -> None:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a LongTensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be int64/int32 token ids, got {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty (seq_len 0)")
        lo, hi = torch.stack(torch.aminmax(input_ids)).tolist() if input_ids.numel() else (0, 0)  # one host read
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"input_ids has ids outside [0, vocab_size={self.config.vocab_size}): min {lo}, max {hi}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must match input_ids' shape {tuple(input_ids.shape)} "
                             f"(mask for the new tokens), got {tuple(attention_mask.shape)}")
        if cache is not None:
            if not isinstance(cache, HybridCache):
                raise TypeError(f"cache must come from model.new_cache(), got {type(cache).__name__}")
            if cache.batch_size != input_ids.shape[0]:
                raise ValueError(f"cache was made for batch_size {cache.batch_size}, input_ids has "
                                 f"{input_ids.shape[0]} rows")
        if self.device.type == "meta":
            raise RuntimeError("the model's weights are on the meta device: load them (from_pretrained) or "
                               "build with device='cpu'/'cuda'")

    #: a forward with a cache over more new tokens than this runs chunk by chunk (KDA state carried, MLA latents
    #: appended), so activation memory is bounded by the chunk whatever the prompt length; ``prefill_chunk_size=``
    #: on ``forward`` / ``generate`` overrides it per call
    prefill_chunk_size: int = 32768

    def _chunk_size(self, value) -> int:
        v = self.prefill_chunk_size if value is None else value
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"prefill_chunk_size must be a positive int (tokens per prefill forward), got {v!r}")
        return v

    def _check_length(self, T: int, cache) -> None:
        start = cache.get_seq_length() if cache is not None else 0
        limit = self.config.max_position_embeddings
        if start + T > limit:
            what = f"{T} new tokens after {start} cached" if start else f"{T} tokens"
            raise ValueError(f"input of {what} reaches position {start + T}, past the model's "
                             f"max_position_embeddings = {limit}")

    def forward(self, input_ids: torch.Tensor | None = None, cache: HybridCache | None = None,
                attention_mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                logits_to_keep: int = 0, output_hidden_layers: list[int] | None = None,
                checkpoint_positions=None, prefill_chunk_size: int | None = None, *, pixel_values=None,
                image_grid_thw=None, labels: torch.Tensor | None = None, **hf_kwargs) -> KimiK3Output:
        """input_ids [B, T] → logits [B, T, vocab] (the last ``logits_to_keep`` positions if > 0).

        With ``cache`` the call continues from the cached tokens (prefill, then 1..n tokens per call); more than
        ``prefill_chunk_size`` new tokens run as consecutive forwards of that many (same result, bounded memory).
        ``attention_mask`` [B, T] marks real tokens (1) vs left padding (0) of these new tokens.
        ``output_hidden_layers``: layer indices whose outputs are returned in ``hidden_states``.
        ``checkpoint_positions``: forwarded to every KDA layer (states exported in the same pass into
        ``cache.layers[i].checkpoints``). ``pixel_values`` / ``image_grid_thw`` are refused (a ValueError):
        images go to :class:`k3nn.KimiK3ForConditionalGeneration`.
        ``labels`` [B, T] (the input ids, -100 where not scored; unshifted): ``.loss`` is transformers' causal-LM
        loss (:func:`k3nn.hf_surface.causal_lm_loss`). transformers' other forward keywords (``return_dict``,
        ``use_cache``, ``num_items_in_batch``, ...) are accepted at values that change nothing, else refused
        (:func:`k3nn.hf_surface.forward_kwargs`).
        """
        _refuse_images(pixel_values, image_grid_thw)
        num_items = forward_kwargs(hf_kwargs) if hf_kwargs else None
        check_adapters(self)
        if labels is not None and logits_to_keep > 0:
            raise ValueError("labels score every position: leave logits_to_keep at 0")
        if inputs_embeds is None:
            self._check_inputs(input_ids, attention_mask, cache)
        chunk = self._chunk_size(prefill_chunk_size)
        T = (input_ids if inputs_embeds is None else inputs_embeds).shape[1]
        self._check_length(T, cache)
        with use_backend(self.backend):
            if cache is not None and cache.splittable and T > chunk:
                h, captured = self._chunked(input_ids, inputs_embeds, cache, attention_mask, output_hidden_layers,
                                            checkpoint_positions, logits_to_keep, chunk)
            else:
                h, captured = self.model(input_ids, inputs_embeds, cache, attention_mask, output_hidden_layers,
                                         checkpoint_positions)
            hk = h[:, -logits_to_keep:] if logits_to_keep > 0 else h
            logits = self.lm_head(hk)
        return KimiK3Output(logits=logits, hidden_states=captured if output_hidden_layers is not None else None,
                            last_hidden_state=h, cache=cache,
                            loss=None if labels is None else causal_lm_loss(logits, labels, num_items))

    def _chunked(self, input_ids, inputs_embeds, cache, attention_mask, output_layers, checkpoint_positions,
                 logits_to_keep: int, chunk: int):
        """The model over ``[0, T)`` as forwards of ``chunk`` tokens. Keeps only the hidden states asked for (the
        last ``logits_to_keep``, or all); KDA checkpoints requested anywhere are exported by the chunk holding
        them and returned in the order given."""
        from .kernels.kda.api import normalise_checkpoints

        src = input_ids if inputs_embeds is None else inputs_embeds
        B, T = src.shape[:2]
        bounds = [(a, min(T, a + chunk)) for a in range(0, T, chunk)]
        pairs = normalise_checkpoints(checkpoint_positions, [T] * B) if checkpoint_positions is not None else []
        per_chunk: list[list[list[int]]] = [[[] for _ in range(B)] for _ in bounds]
        order: list[list[int]] = [[] for _ in bounds]  # flat index of each export, in the chunk's export order
        owner = [next(c for c, (a, e) in enumerate(bounds) if p <= e) for _, p in pairs]
        for c in range(len(bounds)):
            for n in range(B):
                for m, (seq, p) in enumerate(pairs):
                    if seq == n and owner[m] == c:
                        per_chunk[c][n].append(p - bounds[c][0])
                        order[c].append(m)
        kda = [st for i, st in enumerate(cache.layers) if not self.config.is_mla_layer(i)]
        exported = [[None] * len(pairs) for _ in kda]
        hs, tail, captured = [], None, None
        for c, (a, e) in enumerate(bounds):
            cp = per_chunk[c] if pairs and order[c] else None
            h, cap = self.model(None if input_ids is None else input_ids[:, a:e],
                                None if inputs_embeds is None else inputs_embeds[:, a:e], cache,
                                None if attention_mask is None else attention_mask[:, a:e], output_layers, cp)
            if logits_to_keep > 0:
                tail = h if tail is None else torch.cat([tail, h], 1)[:, -logits_to_keep:]
            else:
                hs.append(h)
            captured = [[x] for x in cap] if captured is None else [xs + [x] for xs, x in zip(captured, cap)]
            if cp is not None:
                for j, st in enumerate(kda):
                    for k, m in enumerate(order[c]):
                        exported[j][m] = st.checkpoints[k]
        if pairs:
            for j, st in enumerate(kda):
                st.checkpoints = torch.stack(exported[j])
        h = tail if logits_to_keep > 0 else torch.cat(hs, 1)
        return h, [torch.cat(xs, 1) for xs in (captured or [])]

    def generate(self, input_ids: torch.Tensor, *args, pixel_values=None, image_grid_thw=None, **kwargs):
        _refuse_images(pixel_values, image_grid_thw)
        return super().generate(input_ids, *args, **kwargs)

    generate.__doc__ = GenerationMixin.generate.__doc__

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, max_shard_size: int | str = "5GB",
                        format: str | None = None, *, tokenizer=None, chat_template: str | None = None) -> None:
        """config.json + sharded safetensors. ``format``: ``"transformers"`` (default for a Kimi Linear model:
        ``KimiLinearForCausalLM.from_pretrained`` loads it; refused, naming why, for a model transformers cannot
        represent), ``"k3nn"`` (stacked experts; default otherwise) or ``"moonshot"`` (the original per-expert Kimi
        layout). ``tokenizer`` (a ``tokenizers.Tokenizer``, a transformers tokenizer or a tokenizer directory):
        written beside the weights as a directory ``AutoTokenizer`` loads, with ``chat_template`` (see
        :func:`k3nn.tokenizer.save_tokenizer`)."""
        from .checkpoint.io import save_pretrained

        save_pretrained(self, save_directory, max_shard_size=max_shard_size, format=format, tokenizer=tokenizer,
                        chat_template=chat_template)

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                        device: torch.device | str = "cpu", backend: str | None = None, revision: str | None = None,
                        cache_dir: str | None = None, local_files_only: bool | None = None,
                        token: str | bool | None = None, config: KimiK3Config | None = None,
                        torch_dtype: torch.dtype | str | None = None, device_map=None,
                        language_model_only: bool = False, **kwargs) -> "KimiK3":
        """Load a k3nn, Moonshot or transformers checkpoint (a directory or a hub id). ``dtype``: a torch dtype, its
        name or ``"auto"`` (default: the checkpoint's); ``torch_dtype`` is its transformers alias. ``device_map``:
        transformers' spelling of ``device`` for one device (``"auto"``: the GPU if there is one).
        A multimodal checkpoint (Kimi K2.5 / K3 with a vision tower) is refused unless ``language_model_only``:
        then its language model is loaded and the vision weights are skipped (with a warning); the whole model is
        :class:`k3nn.KimiK3ForConditionalGeneration`.
        ``config`` may be a transformers config (``AutoModelForCausalLM`` passes one); transformers' other loading
        keywords are accepted where they change nothing here and refused otherwise
        (:func:`k3nn.hf_surface.loading_kwargs`)."""
        from .checkpoint.io import from_pretrained

        return from_pretrained(cls, path_or_repo_id, dtype=dtype, device=device, backend=backend,
                               revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                               token=token, config=config, torch_dtype=torch_dtype, device_map=device_map,
                               language_model_only=language_model_only, **kwargs)
