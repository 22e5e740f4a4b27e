"""The CPU platform and its kernel library.

- platform.py: `CpuPlatform` (the ``cpu`` platform: dtypes, KV budget,
  decode graphs, the ops it registers for a model's layers)
- graph.py: the CPU decode-graph recorder, and `kernel_call`, through which
  every C kernel a forward may run is called
- kernel_build.py: build-on-first-use of the plain-C kernels (csrc/)
- fused_ops.py: fused RMSNorm, SiLU * mul and rotary embedding kernels
- linear.py, amx_linear.py: oneDNN / MKL prepacked GEMMs and the AMX
  decode GEMM for linear layers
- host_memory.py: large host buffers on fresh anonymous mappings

``pagedllm.platforms.cpu.platform:CpuPlatform`` stays importable from here.
"""

from __future__ import annotations

from pagedllm.platforms.cpu.platform import CpuPlatform

__all__ = ["CpuPlatform"]
