"""The kernels behind :mod:`k3nn.ops`: one package per op family (``kda``, ``mla``, ``attnres``, ``moe``,
``mxfp4``, ``norm``, ``glu``, ``linear``), each with its eager PyTorch reference next to its Triton and CUDA
implementations, and :mod:`k3nn.kernels.registry`, which registers them and picks one per call
(``k3nn.backend()``, ``available_backends()``). Call the ops through :mod:`k3nn.ops`, which validates the arguments
first.
"""
