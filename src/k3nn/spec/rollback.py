"""Rolling back the hybrid cache after a verify window: KDA recurrent + conv state, MLA entries.

A verify window feeds T = n + 1 tokens (the pending token and n drafts) through the target with the cache; row b
then keeps the first ``a_b`` of them (1 ≤ a_b ≤ T). Everything the window wrote past ``a_b`` must vanish.

KDA strategies (``strategy=``):

* ``"replay"`` (default, ReplaySSM): the window never overwrites the committed state. Each KDA layer records its
  per-token inputs of the window (the layer input ``x`` [B, T, d]); at commit the layer re-runs
  ``project`` + the KDA op over only the accepted prefix ``x[:, :a_b]`` from the committed recurrent and conv
  state. The rebuilt state is bit-identical to a forward over the accepted prefix alone (same op, same shapes).
  Rows that accept the whole window take the window's final state directly.
* ``"slots"`` (per-position state slots): the window runs with ``checkpoint_positions = 1..T``, so the KDA op
  exports the state after every window position in the same pass; commit selects slot ``a_b``. The conv state
  (last W−1 pre-conv inputs) is recomputed from the recorded inputs of the accepted prefix.

MLA (contiguous :class:`~k3nn.cache.HybridCache`): the rejected entries of a row are masked out (``key_mask``),
``valid_counts`` (rope positions) counts only kept tokens, and the shared write position rewinds to the longest
kept prefix, so the next window overwrites the rejected tail.

Graph-safe form (``replay`` only; used by the static / CUDA-graph speculative loop): :meth:`WindowRollback.begin_static`
+ :meth:`WindowRollback.end_static` around a fixed-width window forward (the committed-state copies run on the
device, the Python bookkeeping only records which tensors hold the window's inputs and final state), then
:meth:`WindowRollback.static_commit_fn` gives, per accepted length ``a``, a fixed-shape function that folds the
first ``a`` window inputs into the committed state of the rows whose device acceptance equals ``a`` (rows with
``a = T`` take the window's final state). No host sync inside; the caller picks which ``a`` to run from the one
host read per round. The MLA side (mask, valid counts, device write position) is done by the caller.
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache.hybrid import HybridCache, KDAState
from ..kernels.registry import backend as use_backend
from ..layers.kda import KimiDeltaAttention

__all__ = ["SpecKDAState", "WindowRollback", "ROLLBACK_STRATEGIES", "rollback_memory_bytes"]

ROLLBACK_STRATEGIES = ("replay", "slots")


class SpecKDAState(KDAState):
    """A KDA cache entry that can hold a verify window uncommitted (same tensors as the wrapped entry).

    Outside a window it behaves like :class:`KDAState`. Inside one, the layer sees scratch copies of the
    committed recurrent / conv state (so in-place decode kernels cannot touch the committed state), ``update``
    stashes the window's final state (and exported checkpoints), and the layer's input is recorded when the layer
    shows it (:meth:`observe_input`)."""

    def __init__(self, base: KDAState):
        super().__init__(base.recurrent, base.conv, base.checkpoints)
        self.committed_recurrent, self.committed_conv = base.recurrent, base.conv
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.in_window = False
        self.window_x: torch.Tensor | None = None
        self.window_final: torch.Tensor | None = None
        self.window_conv: torch.Tensor | None = None
        self.window_ckpts: torch.Tensor | None = None
        self.window_ops: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._read_only: torch.Tensor | None = None

    def begin_read_only_window(self) -> None:
        """Open a verify window the fused decode op reads without writing (``write_state`` False for every row):
        no scratch copies; the op's inputs are recorded (:meth:`record_decode`) for
        :meth:`WindowRollback.fused_commit`. Graph-safe."""
        if self._read_only is None:
            self._read_only = torch.zeros(self.committed_recurrent.shape[0], dtype=torch.bool,
                                          device=self.committed_recurrent.device)
        self.write_state = self._read_only
        self.in_window = True
        self.window_x = self.window_final = self.window_conv = self.window_ckpts = self.window_ops = None

    def record_decode(self, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor) -> None:
        """Inside a window: keep the fused decode op's inputs (the read-only window commits from them)."""
        if self.in_window:
            self.window_ops = (qkv, f, b)

    def begin_window(self) -> None:
        """Open a verify window: the layer now works on scratch copies of the committed state, which stays
        untouched until :class:`WindowRollback` commits the accepted prefix."""
        if self._scratch is None:
            self._scratch = (torch.empty_like(self.committed_recurrent), torch.empty_like(self.committed_conv))
        rec, conv = self._scratch
        rec.copy_(self.committed_recurrent)
        conv.copy_(self.committed_conv)
        self.recurrent, self.conv = rec, conv
        self.in_window = True
        self.window_x = self.window_final = self.window_conv = self.window_ckpts = None

    def update(self, recurrent, conv, checkpoints=None) -> None:
        """Outside a window: :meth:`KDAState.update`. Inside: stash the window's final state (and checkpoints) for
        the commit instead of storing it."""
        if not self.in_window:
            return super().update(recurrent, conv, checkpoints)
        self.window_final, self.window_conv, self.window_ckpts = recurrent, conv, checkpoints

    def observe_input(self, module, x: torch.Tensor) -> None:
        """The KDA layer's (masked) input, shown by the layer before it runs: kept while a window is open."""
        if self.in_window:
            self.window_x = x

    def end_window(self) -> None:
        """Close the window: point back at the committed state and drop what the window recorded."""
        self.in_window = False
        self.write_state = None
        self.recurrent, self.conv = self.committed_recurrent, self.committed_conv
        self.window_x = self.window_final = self.window_conv = self.window_ckpts = self.window_ops = None


class WindowRollback:
    """Installs window-aware KDA state on ``cache`` for ``model`` and commits / rolls back verify windows.

    Use as a context manager::

        with WindowRollback(model, cache, "replay") as rb:
            rb.begin()
            model(window, cache=cache, checkpoint_positions=rb.checkpoint_positions(T))
            rb.commit(accepted)   # accepted: [B] ints in [1, T]
    """

    def __init__(self, model, cache: HybridCache, strategy: str = "replay"):
        if strategy not in ROLLBACK_STRATEGIES:
            raise ValueError(f"unknown rollback strategy {strategy!r}; choose one of {ROLLBACK_STRATEGIES}")
        self.model, self.cache, self.strategy = model, cache, strategy
        self.kda: list[tuple[KimiDeltaAttention, SpecKDAState]] = []
        layers = model.model.layers
        for i, st in enumerate(cache.layers):
            if isinstance(st, KDAState):
                if not isinstance(st, SpecKDAState):
                    st = SpecKDAState(st)
                    cache.layers[i] = st
                self.kda.append((layers[i].self_attn, st))
        self.start = 0
        self.width = 0

    def close(self) -> None:
        """Nothing to undo (the window-aware states stay on the cache and behave as plain ones outside a window)."""

    def __enter__(self) -> "WindowRollback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def begin(self) -> None:
        """Call right before the verify forward."""
        self.start = self.cache.seen_tokens
        for _, st in self.kda:
            st.begin_window()

    def checkpoint_positions(self, T: int):
        """What to pass as the verify forward's ``checkpoint_positions`` (None unless ``slots``)."""
        if self.strategy != "slots":
            return None
        return [list(range(1, T + 1)) for _ in range(self.cache.batch_size)]

    @torch.no_grad()
    def commit(self, accepted: torch.Tensor) -> None:
        """Keep the first ``accepted[b]`` window tokens of row b (1 ≤ accepted ≤ T) in every layer."""
        cache = self.cache
        T = cache.seen_tokens - self.start
        acc = accepted.to(device=cache.device, dtype=torch.long)
        acc_list = acc.tolist()  # the one host sync of a commit
        if T <= 0 or min(acc_list) < 1 or max(acc_list) > T:
            raise ValueError(f"accepted counts must be in [1, {T}], got {acc_list}")
        with use_backend(getattr(self.model, "backend", None)):
            for mod, st in self.kda:
                self._commit_kda(mod, st, acc_list, T)
        # MLA / shared bookkeeping: mask the rejected tail of each row, rewind the shared write position
        j = torch.arange(T, device=cache.device)
        keep = j[None, :] < acc[:, None]
        cache.key_mask[:, self.start:self.start + T] &= keep
        cache.holes = True
        cache.valid_counts -= T - acc
        cache.seen_tokens = self.start + max(acc_list)
        if getattr(cache, "static", False):
            cache.write_pos.fill_(cache.seen_tokens)

    # -- graph-safe (static) form ------------------------------------------------------------------------
    def fused_window(self, T: int) -> bool:
        """Whether a window of ``T`` tokens runs every KDA layer through the fused decode op, so that it can be
        read without writing and committed by :meth:`fused_commit` (one op call per layer, any accepted count)."""
        return all(0 < T <= mod.fused_decode_max_tokens for mod, _ in self.kda)

    def begin_static(self, fused: bool = False) -> None:
        """Graph-safe :meth:`begin`: device copies of the committed KDA state into the window scratch, or with
        ``fused`` (see :meth:`fused_window`) a window the fused op reads without writing."""
        if self.strategy != "replay":
            raise ValueError("the static (graph-safe) window rollback supports strategy='replay' only")
        for _, st in self.kda:
            if fused:
                st.begin_read_only_window()
            else:
                st.begin_window()

    def end_static(self) -> list[tuple[torch.Tensor, ...]]:
        """After the window forward: per KDA layer (window inputs x [B, T, d], final recurrent, final conv), or
        after a read-only window the fused op's inputs (qkv, f, b). The tensors are the forward's own (under a
        captured graph: its static outputs, refilled by each replay)."""
        refs = []
        for _, st in self.kda:
            if st.window_ops is not None:
                refs.append(st.window_ops)
            else:
                fin = st.window_final if st.window_final is not None else st.recurrent
                fconv = st.window_conv if st.window_conv is not None else st.conv
                refs.append((st.window_x, fin, fconv))
            st.end_window()
        return refs

    def fused_commit(self, keep: torch.Tensor, refs) -> None:
        """Fold the first ``keep[b]`` tokens of a read-only window (:meth:`begin_static` with ``fused``) into row
        b's committed KDA state (``keep`` [B] long on the device; 0 leaves the row alone): the fused decode op over
        the recorded inputs with ``num_tokens = keep``, one call per layer. ``refs``: what :meth:`end_static`
        returned. Graph-safe; the result equals a forward over the kept tokens alone."""
        rows = torch.arange(keep.shape[0], device=keep.device)
        idx = torch.where(keep > 0, rows, torch.full_like(rows, -1))
        with use_backend(getattr(self.model, "backend", None)):
            for (mod, st), (qkv, f, b) in zip(self.kda, refs):
                mod.commit_window(qkv, f, b, st.committed_recurrent, st.committed_conv, idx, keep.to(torch.int32))

    def static_commit_fn(self, a: int, T: int, kacc: torch.Tensor, refs):
        """A graph-safe function committing the rows b with ``kacc[b] == a`` (1 ≤ a ≤ T): a = T copies the
        window's final state, a < T replays the first a window inputs from the committed state. ``kacc`` is read
        at run time; ``refs`` (what :meth:`end_static` returned, or a callable giving it) when the function runs
        (a captured graph keeps the tensors it saw at capture)."""
        backend = getattr(self.model, "backend", None)

        def fn() -> None:
            sel = kacc == a
            window = refs() if callable(refs) else refs
            with use_backend(backend):
                for (mod, st), (x, fin, fconv) in zip(self.kda, window):
                    rec, conv = st.committed_recurrent, st.committed_conv
                    if a == T:
                        new_rec, new_conv = fin, fconv
                    else:
                        tmp = KDAState(rec.clone(), conv.clone())
                        mod(x[:, :a], tmp)
                        new_rec, new_conv = tmp.recurrent, tmp.conv
                    rec.copy_(torch.where(sel[:, None, None, None], new_rec.to(rec.dtype), rec))
                    conv.copy_(torch.where(sel[:, None, None], new_conv.to(conv.dtype), conv))

        return fn

    def _commit_kda(self, mod: KimiDeltaAttention, st: SpecKDAState, acc: list[int], T: int) -> None:
        if st.window_final is None:  # the layer wrote the scratch in place without calling update()
            st.window_final, st.window_conv = st.recurrent, st.conv
        rec, conv = st.committed_recurrent, st.committed_conv
        B = len(acc)
        full = [b for b in range(B) if acc[b] == T]
        if len(full) == B:
            rec.copy_(st.window_final)
            conv.copy_(st.window_conv)
        elif full:
            idx = torch.tensor(full, device=rec.device)
            rec[idx] = st.window_final[idx].to(rec.dtype)
            conv[idx] = st.window_conv[idx].to(conv.dtype)
        groups: dict[int, list[int]] = {}
        for b, a in enumerate(acc):
            if a != T:
                groups.setdefault(a, []).append(b)
        x, ckpts = st.window_x, st.window_ckpts
        st.end_window()
        for a, rows in groups.items():
            if self.strategy == "slots":
                idx = torch.tensor(rows, device=rec.device)
                slot = idx * T + (a - 1)  # checkpoints are ordered row-major over positions 1..T
                rec[idx] = ckpts[slot].to(rec.dtype)
                conv[idx] = _conv_after(mod, x[idx, :a], conv[idx]).to(conv.dtype)
            else:
                _replay(mod, x, rows, a, rec, conv)


def _replay(mod: KimiDeltaAttention, x: torch.Tensor, rows: list[int], a: int, rec: torch.Tensor,
            conv: torch.Tensor) -> None:
    """Fold the accepted inputs ``x[rows, :a]`` into the committed state by running the layer itself on them
    (so the rebuilt state is exactly what a forward over the accepted prefix alone produces, whichever KDA path
    the layer takes)."""
    if len(rows) == rec.shape[0]:
        mod(x[:, :a], KDAState(rec, conv))
        return
    idx = torch.tensor(rows, device=rec.device)
    tmp = KDAState(rec[idx], conv[idx])
    mod(x[idx, :a], tmp)
    rec[idx] = tmp.recurrent
    conv[idx] = tmp.conv


def _conv_after(mod: KimiDeltaAttention, x: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
    """The conv state (last W−1 pre-conv q|k|v inputs) after the accepted inputs x [n, a, d]."""
    W1 = conv.shape[1]
    tail = x[:, max(0, x.shape[1] - W1):]
    raw = torch.cat([mod.q_proj(tail), mod.k_proj(tail), mod.v_proj(tail)], -1)
    return torch.cat([conv.to(raw.dtype), raw], 1)[:, -W1:]


def rollback_memory_bytes(config, gamma: int, batch_size: int = 1, strategy: str = "replay",
                          dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes the KDA side of speculative decoding holds per batch, for a verify window of γ + 1 tokens.

    ``committed``: the recurrent (fp32) + conv state every request has anyway. ``extra``: what the strategy adds
    (per KDA layer and request): both keep one working copy of the state that the window writes (so in-place
    decode kernels never touch the committed state) and the window's layer inputs (hidden size d per token,
    activation dtype); ``slots`` also holds the γ + 1 states exported by the window. ``mla_extra`` is 0 for
    both: rejected MLA entries are masked in place and overwritten by the next window.
    """
    if strategy not in ROLLBACK_STRATEGIES:
        raise ValueError(f"unknown rollback strategy {strategy!r}; choose one of {ROLLBACK_STRATEGIES}")
    n_kda = len(config.kda_layers)
    H, D, W = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
    act = torch.finfo(dtype).bits // 8
    state = H * D * D * 4
    conv = (W - 1) * 3 * H * D * act
    T = gamma + 1
    x_rec = T * config.hidden_size * act
    extra = state + x_rec + (T * state if strategy == "slots" else 0)
    committed = n_kda * batch_size * (state + conv)
    extra_total = n_kda * batch_size * extra
    return {"committed": committed, "extra": extra_total, "total": committed + extra_total, "mla_extra": 0,
            "per_layer_per_request_extra": extra}
