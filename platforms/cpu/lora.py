"""The CPU platform's kernel for the "lora" op (a LoRASlots layer's
shrink/expand, model_registry/layers/lora.py), float32 and bfloat16.

Two paths, by the number of rows T:

- Decode sizes (T < GEMM_MIN_ROWS, and any T while a CPU graph is
  captured): a C kernel (csrc/lora.c) that reads the slots from the tensor,
  groups the rows by slot itself and streams each used adapter's A and B
  once for all of its rows, reading only the rank block of each stacked
  sub-matrix (q/k/v, gate/up) on the expand. Sums are float32, y rounded
  once. Nothing is read on the host, so a decode graph records it and a
  replay follows whatever slots the runner wrote into the tensor.
- Larger batches (prefill chunks, usually of one or a few adapters, and
  decode rows): the slots present are counted on the host (token_slots is
  host memory: no device sync); a slot with at least GEMM_MIN_ROWS rows
  runs one shrink and one expand GEMM on its rows (oneDNN: AVX512-BF16 or
  AMX in bfloat16) and one index_add_ (an addmm_ when it has every row),
  and the other slots' rows the C kernel.

Without a C compiler or AVX-512, or with `PAGEDLLM_CPU_LORA_KERNEL=0`
(logged once), decode batches take the grouped torch path too, and a graph
capture the masked torch formulation (every slot over every row), which
reads no host value.

No model_registry import (the layers import platforms/): the layer is read
by its attributes (lora_a, lora_b, max_rank, output_sizes).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from pagedllm.platforms.cpu.graph import is_capturing, kernel_call
from pagedllm.platforms.cpu.kernel_build import load_library, prebuild_in_background

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "lora.c"
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp", "-shared",
          "-fPIC")
ENV_SWITCH = "PAGEDLLM_CPU_LORA_KERNEL"
IMPL_NAME = "cpu_lora"
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_RANK = 512  # the C kernel's largest rank block (csrc/lora.c MAX_RANK_PAD)
# Outside capture, a slot with at least this many rows of the batch (a
# prefill chunk's) runs as two GEMMs on its rows; smaller groups (decode
# rows) go to the C kernel, and a batch of fewer rows goes there whole,
# without reading the slots on the host. benchmarks/lora_kernels.py, one
# adapter on the ~100M model's projections (bfloat16, one thread): the
# kernel was faster up to 70 rows, the two equal at 84, the GEMMs faster
# from 98 (docs/performance.md).
GEMM_MIN_ROWS = 96

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURE: list[Any] = [_INT, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR]

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when it cannot be or the
    CPU lacks AVX-512 (logged once)."""
    library = load_library(SOURCE, CFLAGS, ENV_SWITCH, "CPU LoRA kernel")
    if library is None:
        return None
    library.lora_available.restype, library.lora_available.argtypes = _INT, []
    library.lora_apply.restype, library.lora_apply.argtypes = _INT, _SIGNATURE
    if not library.lora_available():
        logger.info("CPU LoRA kernel needs AVX-512: decode batches group their adapters in torch")
        return None
    return library


def supports(layer: nn.Module) -> bool:
    """A LoRASlots layer whose slot buffers are contiguous float32 or bfloat16 CPU tensors."""
    lora_a, lora_b = getattr(layer, "lora_a", None), getattr(layer, "lora_b", None)
    return (isinstance(lora_a, torch.Tensor) and isinstance(lora_b, torch.Tensor) and lora_a.is_cpu
            and lora_a.dtype in KERNEL_DTYPES and lora_b.dtype == lora_a.dtype and lora_a.is_contiguous()
            and lora_b.is_contiguous() and hasattr(layer, "output_sizes") and hasattr(layer, "max_rank"))


class CpuLoRAKernel:
    """(y [T, out], x [T, in], token_slots int32 [T]) -> None: y += each
    row's adapter product, reading the layer's slot buffers at each call
    (the runner loads adapters into them in place)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.max_rank = int(getattr(layer, "max_rank"))  # noqa: B009 - read by attribute (see the top)
        offsets = [0]
        for size in getattr(layer, "output_sizes"):  # noqa: B009
            offsets.append(offsets[-1] + int(size))
        self.out_offsets = torch.tensor(offsets, dtype=torch.int64)

    def __call__(self, y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor) -> None:
        if token_slots.shape != x.shape[:1] or y.shape[0] != x.shape[0]:  # the C kernel reads T slots and rows
            raise ValueError(f"LoRA rows: x {tuple(x.shape)}, y {tuple(y.shape)}, slots {tuple(token_slots.shape)}")
        if x.shape[0] == 0:
            return
        library = None if torch.compiler.is_compiling() else load()
        capturing = is_capturing()
        if library is None or x.dtype not in KERNEL_DTYPES or y.dtype != x.dtype or self.max_rank > MAX_RANK:
            self.torch_path(y, x, token_slots)
        elif capturing or x.shape[0] < GEMM_MIN_ROWS:
            self.c_kernel(library, y, x, token_slots)
        else:
            self.mixed(library, y, x, token_slots)

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's lora_a and lora_b (read at each call: the runner loads adapters into them in place)."""
        return cast(torch.Tensor, self.layer.lora_a), cast(torch.Tensor, self.layer.lora_b)

    def torch_path(self, y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor) -> None:
        """The grouped GEMMs, or their masked form (no host read) under capture."""
        (masked_lora if is_capturing() else grouped_lora)(y, x, *self.buffers, token_slots)

    def mixed(self, library: ctypes.CDLL, y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor) -> None:
        """Slots with at least GEMM_MIN_ROWS rows (a prefill chunk's) as
        GEMMs, the others' rows on the C kernel (reads the slots on the host)."""
        counts = torch.bincount(token_slots, minlength=self.buffers[0].shape[0])[1:].tolist()
        large = [slot for slot, count in enumerate(counts, start=1) if count >= GEMM_MIN_ROWS]
        if not large:
            self.c_kernel(library, y, x, token_slots)
            return
        # the small groups' slots, the large ones' rows set to 0 (None: no small group)
        rest = token_slots.clone() if any(0 < count < GEMM_MIN_ROWS for count in counts) else None
        for slot in large:
            rows = (token_slots == slot).nonzero().squeeze(1)
            add_slot_rows(y, x, *self.buffers, slot, rows)
            if rest is not None:
                rest[rows] = 0
        if rest is not None:
            self.c_kernel(library, y, x, rest)

    def c_kernel(self, library: ctypes.CDLL, y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor) -> None:
        lora_a, lora_b = self.buffers
        num_slots, rank_total, num_in = lora_a.shape
        rows = x.contiguous()
        slots = token_slots if token_slots.dtype == torch.int32 else token_slots.to(torch.int32)
        out = y if y.is_contiguous() else torch.zeros_like(y, memory_format=torch.contiguous_format)
        shrunk = torch.empty(rows.shape[0], rank_total, dtype=torch.float32)
        status = kernel_call(library.lora_apply, KERNEL_DTYPES[x.dtype], rows, rows.shape[0], num_in,
                             slots.contiguous(), num_slots - 1, lora_a, lora_b, rank_total,
                             len(self.out_offsets) - 1, self.max_rank, self.out_offsets, y.shape[1], shrunk, out)
        if status != 0:  # out of memory in the kernel: the same product in torch
            self.torch_path(out, rows, slots)
        if out is not y:
            y.add_(out)


def grouped_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 token_slots: torch.Tensor) -> None:
    """Per slot present: its rows' shrink and expand GEMMs (reads the slots on the host)."""
    for slot in token_slots.unique().tolist():
        if slot != 0:
            add_slot_rows(y, x, lora_a, lora_b, slot, (token_slots == slot).nonzero().squeeze(1))


def add_slot_rows(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: int,
                  rows: torch.Tensor) -> None:
    """y[rows] += (x[rows] @ lora_a[slot].T) @ lora_b[slot].T: two GEMMs, and
    an index_add_ unless the rows are all of them."""
    if rows.shape[0] == x.shape[0]:
        y.addmm_(x @ lora_a[slot].T, lora_b[slot].T)
    else:
        y.index_add_(0, rows, (x.index_select(0, rows) @ lora_a[slot].T) @ lora_b[slot].T)


def masked_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                token_slots: torch.Tensor) -> None:
    """Every slot over every row, masked by the slots (reads no host value)."""
    for slot in range(1, lora_a.shape[0]):
        mask = (token_slots == slot).unsqueeze(1).to(x.dtype)
        y.add_(((x @ lora_a[slot].T) @ lora_b[slot].T) * mask)


def build(layer: nn.Module) -> Kernel:
    prebuild_in_background(load)  # the compile overlaps the rest of the model's preparation
    return CpuLoRAKernel(layer)


def register_ops(register: Callable[..., None]) -> None:
    """Offer the kernel as the "lora" op (model_registry/layers/ops.py)."""
    register("lora", IMPL_NAME, build, supports=supports)


__all__ = ["GEMM_MIN_ROWS", "CpuLoRAKernel", "grouped_lora", "masked_lora", "register_ops", "supports"]
