"""ferrollm's kernels, one home for both devices:

- :mod:`ferrollm.kernels.cpu`: the Rust CPU kernels (``rust/kernels``) on torch tensors: the
  GEMM and GEMV, paged attention, norms, rotary, activations; :mod:`ferrollm.kernels.cpu.gguf`, the
  GGUF block decoders;
- :mod:`ferrollm.kernels.triton`: the Triton kernels of the GPU path, each beside the torch
  reference it is tested against.

This package imports neither: the CPU part needs the native module, the Triton part needs Triton.
"""
