"""The K3 layers as ``nn.Module``s, one per file, each reading as its math (the kernels live in :mod:`k3nn.ops`):

- :mod:`k3nn.layers.kda`: :class:`~k3nn.layers.kda.KimiDeltaAttention` (gated delta-rule linear attention);
- :mod:`k3nn.layers.mla`: :class:`~k3nn.layers.mla.MultiHeadLatentAttention` (latent KV cache, absorbed decode);
- :mod:`k3nn.layers.attnres`: Block Attention Residuals (softmax over depth);
- :mod:`k3nn.layers.moe`: the router, the experts and the MoE layer (standard and Stable LatentMoE);
- :mod:`k3nn.layers.mlp`, :mod:`k3nn.layers.norm`, :mod:`k3nn.layers.linear`: the dense MLP, RMSNorm / gated
  RMSNorm, and the linear layer the decode path packs;
- :mod:`k3nn.layers.dspark`: the DSpark drafter.

Layers take ``[B, T, d]`` hidden states and return ``[B, T, d]``; a layer with a cache also takes it (see each).
"""
