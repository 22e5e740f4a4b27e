"""oneDNN-prepacked GEMMs for the linear layers of a model on the CPU (and
MKL's sgemm on a transposed copy for small float32 weights, see
MKL_MAX_WEIGHT_ELEMENTS).

MKL's plain sgemm re-lays the weight out for every call; oneDNN can do it
once at load time, which pays for the small, skinny GEMMs of decode. vLLM's
CPU backend prepacks the same way. bfloat16 GEMMs already run on oneDNN
(AMX / AVX-512 BF16), but prepacked they skip the per-call reorder too
(faster at decode sizes, the same at prefill sizes: docs/performance.md),
and bit-identical to F.linear. A dtype is prepacked only after a probe shows
the oneDNN op exists and agrees with F.linear; otherwise nothing changes.
Layers whose weight is of another dtype (int8 from quantization/) keep
their own GEMM.

On a CPU with AMX, bfloat16 batches of at most amx_linear.AMX_MAX_ROWS
rows (decode) run on our own AMX kernel instead, which streams the weights
faster than oneDNN at those sizes (amx_linear.py). Its packed copy is
one more weight-sized buffer per layer; `PAGEDLLM_CPU_AMX_LINEAR=0` goes
without it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.platforms.cpu import amx_linear

# The batch size oneDNN tunes the packed layout for; any size still works.
_PACK_BATCH_HINT = 64
PREPACKED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here in `dtype` and agrees with F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False  # emulated bfloat16: F.linear's own path is as good
    try:  # a build can list the op and still lack the kernel
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(8, 16, generator=generator).to(dtype)
        x = torch.randn(3, 16, generator=generator).to(dtype)
        packed = ops._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        out = ops._linear_pointwise(x, packed, None, "none", [], "")
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        return bool(torch.allclose(out.float(), nn.functional.linear(x, weight).float(), atol=tolerance))
    except RuntimeError:
        return False


# A float32 weight of at most this many elements (2 MiB, half a core's L2)
# runs on MKL's sgemm instead, from a [K, N] copy made at load: at decode
# sizes MKL's small GEMMs took about half the time of the prepacked oneDNN
# ones (1-8 rows of the 7M model's 256 x 256 ... 256 x 1376 layers, one
# thread; decode steps of that model at batch 1 and 8: 0.84-0.88x the time)
# and as little at prefill sizes, and MKL runs a small GEMM on fewer threads
# instead of the whole team. Larger weights (the ~100M model's, 0.6M-3.1M
# elements) were slower that way at batch 32 (1.1x the generate time), so
# they keep oneDNN.
MKL_MAX_WEIGHT_ELEMENTS = 1 << 19


def _runs_on_mkl(module: nn.Linear) -> bool:
    return module.weight.dtype == torch.float32 and module.weight.numel() <= MKL_MAX_WEIGHT_ELEMENTS


# NOTE: under torch.compile (`device.compile_model`) the layers trace as plain
# F.linear: Inductor's lowering of _linear_pointwise accepts only a weight it
# packed itself (a frozen constant), and failed on ours for bfloat16 (an
# InductorError at the first forward). is_compiling() is decided at trace
# time, so the compiled graph holds no branch and eager mode pays one call.
def _prepacked_gemm(module: nn.Linear) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), _PACK_BATCH_HINT)

    def apply_linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return nn.functional.linear(x, module.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")

    return apply_linear


def _with_amx_for_few_rows(module: nn.Linear, gemm: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
                           ) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """`gemm`, but batches of at most AMX_MAX_ROWS rows (decode) on the AMX
    kernel (amx_linear.py) where it takes the weight."""
    packed = amx_linear.pack(module.weight)
    if packed is None:
        return gemm
    num_out, num_in = module.weight.shape
    # The kernel adds a float32 bias: the layer's own, converted once here, not per call.
    bias_f32 = None if module.bias is None else module.bias.detach().float().contiguous()

    def apply_linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not torch.compiler.is_compiling() and x.numel() <= amx_linear.AMX_MAX_ROWS * num_in:
            kernel_bias = bias_f32 if bias is module.bias else bias
            out = amx_linear.linear(x.reshape(-1, num_in), packed, num_out, kernel_bias)
            if out is not None:
                return out.view(*x.shape[:-1], num_out)
        return gemm(x, bias)

    return apply_linear


def _mkl_gemm(module: nn.Linear) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    weight_t = module.weight.detach().t().contiguous()  # [K, N]: sgemm's plain layout

    def apply_linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return nn.functional.linear(x, module.weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.mm(rows, weight_t) if bias is None else torch.addmm(bias, rows, weight_t)
        return out.view(*x.shape[:-1], out.shape[-1])

    return apply_linear


def supports(layer: nn.Module) -> bool:
    """Whether the prepacked GEMM takes this linear layer: a float32 or
    bfloat16 weight on the CPU that oneDNN runs here (an int8 one from
    quantization/ keeps its method's GEMM)."""
    weight = getattr(layer, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype in PREPACKED_DTYPES
            and weight.is_cpu and _onednn_runs(weight.dtype))


@functools.cache
def _onednn_runs(dtype: torch.dtype) -> bool:
    return onednn_linear_available(dtype)


def build_gemm(layer: nn.Module) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """The layer's GEMM, (x, bias) -> x @ weight.T + bias: prepacked oneDNN,
    or for a small float32 weight MKL's sgemm on a [K, N] copy; in bfloat16,
    few-row batches on the AMX kernel where it takes the weight. The original
    weight stays registered (the model's parameters and tied embeddings keep
    working)."""
    assert isinstance(layer, nn.Linear)
    with torch.no_grad():
        gemm = _mkl_gemm(layer) if _runs_on_mkl(layer) else _prepacked_gemm(layer)
        if layer.weight.dtype == torch.bfloat16:
            gemm = _with_amx_for_few_rows(layer, gemm)
    return gemm


IMPL_NAME = "cpu_prepacked"
PRIORITY = 10


def register_ops(register: Callable[..., None]) -> None:
    """Offer the prepacked GEMM as the "linear" op (model_registry/layers/ops.py)."""
    register("linear", IMPL_NAME, build_gemm, priority=PRIORITY, supports=supports)
