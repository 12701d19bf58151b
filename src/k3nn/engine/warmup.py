"""The requests :meth:`k3nn.engine.Engine.warmup` runs (then discards) so that serving meets no compile or autotune:
the step shapes requests will bring, before the decode graphs are captured."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["WarmupRequests", "warmup_prompt_lengths"]


def warmup_prompt_lengths(max_batched_tokens: int, max_positions: int, pool_tokens: int | None = None,
                          moe: tuple[int, int, bool] | None = None) -> list[int]:
    """Prompt lengths :meth:`Engine.warmup` runs on CUDA besides its batches: every power of two up to the step
    budget, the budget itself, and with ``moe`` = (experts, experts per token, MXFP4) one step size of each MoE
    kernel specialisation (:func:`~k3nn.kernels.moe.triton_fused.step_token_counts`); each within the context
    and the page pool (``pool_tokens``), leaving room for the warm-up's few decode steps."""
    top = min(int(max_batched_tokens), int(max_positions) - 8)
    if pool_tokens is not None:
        top = min(top, int(pool_tokens) - 8)
    if top < 1:
        return []
    lens = {1 << i for i in range(top.bit_length()) if (1 << i) <= top} | {top}
    if moe is not None:
        from ..kernels.moe.triton_fused import step_token_counts

        lens |= set(step_token_counts(*moe, top))
    return sorted(lens)


class WarmupRequests:
    """Step 1 of :meth:`Engine.warmup <k3nn.engine.Engine.warmup>` (a base class of :class:`~k3nn.engine.Engine`)."""

    def _run_warmup_requests(self, prompt_len: int, batch_sizes: Sequence[int] | None) -> None:
        """For each batch size, prompts of ``prompt_len``, ``+ 1`` and ``+ 33`` tokens and a prefix hit of the first
        one, plain and with every warmed draft length; on CUDA, one prompt of each length
        :func:`warmup_prompt_lengths` gives. Each batch runs to the end and its requests are dropped."""
        mx = self.config.max_num_seqs
        sizes = sorted(set(batch_sizes)) if batch_sizes is not None else sorted({1, min(2, mx), mx})
        g = torch.Generator().manual_seed(0)
        gamma = self.default_num_spec if self.drafter is not None else 0
        lens = [prompt_len, prompt_len + 1, prompt_len + 33]
        for b in sizes:
            for n_spec in sorted({0, gamma} | set(range(1, gamma + 1, max(1, gamma // 3)))):
                if n_spec and self.drafter is None:
                    continue
                prompts = [self._warmup_prompt(lens[k % len(lens)], g) for k in range(b)]
                self._warmup_run(prompts + prompts[:1], n_spec)  # the repeat: a prefix hit of the first prompt
        if self.pools.device.type == "cuda":  # the interpreter compiles nothing: no need to sweep there
            c = self.mcfg
            pool = self.pools.allocator.num_blocks * self.pools.block_size
            moe = (c.num_experts, c.num_experts_per_token, bool(c.mxfp4_experts)) if c.num_experts else None
            for n in warmup_prompt_lengths(self.config.max_num_batched_tokens, c.max_position_embeddings, pool, moe):
                self._warmup_run([self._warmup_prompt(n, g)], 0)

    def _warmup_prompt(self, n: int, g: torch.Generator) -> list[int]:
        p = torch.randint(0, self.mcfg.vocab_size, (n,), generator=g).tolist()
        if self.multimodal is not None:  # text prompts: no image / video placeholders
            ph = {self.multimodal.config.image_token_id, self.multimodal.config.video_token_id}
            p = [0 if t in ph else t for t in p]
        return p

    def _warmup_run(self, prompts: list[list[int]], n_spec: int) -> None:
        ids = [self.add_request(p, max_new_tokens=n_spec + 3, ignore_eos=True,
                                num_speculative_tokens=n_spec if self.drafter is not None else None)
               for p in prompts]
        list(self.stream())
        for rid in ids:
            del self.requests[rid]
