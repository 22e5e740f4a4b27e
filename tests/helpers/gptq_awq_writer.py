"""GPTQ and AWQ checkpoints written from a float checkpoint with each
format's own packing: round to nearest (no calibration: GPTQ's error
feedback and AWQ's activation-aware scaling would only do better), one
scale and zero per group of inputs, optional act-order. The packers follow
vLLM's test utilities (vllm/model_executor/layers/quantization/utils/
quant_utils.py: pack_rows for GPTQ's qweight, pack_cols for its qzeros,
awq_pack for AWQ's interleaved columns), so pagedllm's readers are checked
against an independent writer. Used by tests/test_gptq_awq.py and the
quantization benchmark.

    write_gptq_awq(float_dir, out_dir, Case("gptq", group_size=128, sym=False))
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """vLLM's pack_rows: [K, N] codes -> int32 [K / f, N], row i*f + j in bits j*bits."""
    factor = 32 // bits
    codes = q.numpy().astype(np.uint32)
    packed = np.zeros((codes.shape[0] // factor, codes.shape[1]), dtype=np.uint32)
    for i in range(factor):
        packed |= codes[i::factor, :] << bits * i
    return torch.from_numpy(packed.astype(np.int32))


def pack_cols(q: torch.Tensor, bits: int) -> torch.Tensor:
    """vLLM's pack_cols: [K, N] codes -> int32 [K, N / f], column i*f + j in bits j*bits."""
    factor = 32 // bits
    codes = q.numpy().astype(np.uint32)
    packed = np.zeros((codes.shape[0], codes.shape[1] // factor), dtype=np.uint32)
    for i in range(factor):
        packed |= codes[:, i::factor] << bits * i
    return torch.from_numpy(packed.astype(np.int32))


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """vLLM's awq_pack (AutoAWQ's order): columns interleaved [0, 2, 4, 6, 1, 3, 5, 7], then pack_cols."""
    interleave = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    num_cols = q.shape[1]
    codes = q.numpy().reshape(-1, 8)[:, interleave].reshape(-1, num_cols)
    return pack_cols(torch.from_numpy(np.ascontiguousarray(codes)), 4)


class Quantized(NamedTuple):
    codes: torch.Tensor  # [N, K] integers
    zeros: torch.Tensor  # [N, G] integers
    scales: torch.Tensor  # [N, G] float32, fp16-representable
    g_idx: torch.Tensor  # [K] int32

    def dequantize(self) -> torch.Tensor:
        """The formats' formula: w[n, k] = (q[n, k] - zero[n, g_idx[k]]) * scale[n, g_idx[k]]."""
        index = self.g_idx.long()
        return (self.codes.float() - self.zeros.float()[:, index]) * self.scales[:, index]


def round_to_nearest(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                     order: torch.Tensor | None, min_zero: int = 0) -> Quantized:
    """GPTQ's quantizer without the error feedback: inputs grouped in `order`
    (act-order: g_idx[order[p]] = p // g), one scale and zero per group and row."""
    num_out, num_in = weight.shape
    group_size = num_in if group_size == -1 else group_size
    order = torch.arange(num_in) if order is None else order
    grouped = weight.float()[:, order].view(num_out, num_in // group_size, group_size)
    max_code = 2**bits - 1
    if sym:
        scales = grouped.abs().amax(-1) * 2 / max_code
        zeros = torch.full_like(scales, (max_code + 1) // 2)
    else:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scales = (high - low) / max_code
    scales = scales.clamp(min=1e-6).half().float()
    if not sym:
        zeros = torch.round(-low / scales).clamp(min_zero, max_code)
    codes = torch.clamp(torch.round(grouped / scales[..., None]) + zeros[..., None], 0, max_code)
    in_order = torch.empty(num_out, num_in)
    in_order[:, order] = codes.view(num_out, num_in)
    g_idx = torch.empty(num_in, dtype=torch.int32)
    g_idx[order] = (torch.arange(num_in) // group_size).to(torch.int32)
    return Quantized(in_order.to(torch.int64), zeros.to(torch.int64), scales, g_idx)


class Case(NamedTuple):
    fmt: str  # "gptq" or "awq"
    bits: int = 4
    group_size: int = 32
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # GPTQ: v1 stores zero - 1, gptq_v2 the zero


def stored_tensors(name: str, quantized: Quantized, case: Case) -> dict[str, torch.Tensor]:
    prefix = name.removesuffix("weight")
    scales = quantized.scales.t().half().contiguous()
    if case.fmt == "awq":
        return {prefix + "qweight": awq_pack(quantized.codes.t().contiguous()),
                prefix + "qzeros": awq_pack(quantized.zeros.t().contiguous()), prefix + "scales": scales}
    zero_shift = 1 if case.checkpoint_format == "gptq" else 0
    mask = 2**case.bits - 1
    stored_zeros = (quantized.zeros - zero_shift) & mask
    return {prefix + "qweight": pack_rows(quantized.codes.t().contiguous(), case.bits),
            prefix + "qzeros": pack_cols(stored_zeros.t().contiguous(), case.bits), prefix + "scales": scales,
            prefix + "g_idx": quantized.g_idx}


def quant_config(case: Case) -> dict[str, object]:
    if case.fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": case.group_size, "zero_point": True,
                "version": "gemm"}
    return {"quant_method": "gptq", "bits": case.bits, "group_size": case.group_size, "desc_act": case.desc_act,
            "sym": case.sym, "checkpoint_format": case.checkpoint_format}


def write_gptq_awq(source: Path, out_dir: Path, case: Case) -> tuple[Path, Path]:
    """(the float checkpoint `source` packed as `case` says, a float
    checkpoint of its dequantized weights), written under `out_dir`."""
    packed, dequantized = out_dir / case.fmt, out_dir / f"{case.fmt}-dequantized"
    shutil.copytree(source, packed)
    shutil.copytree(source, dequantized)
    tensors = load_file(str(source / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if not (name.endswith(".weight") and parts[-2] in LINEAR_SUFFIXES):
            stored[name] = tensor
            continue
        # Act-order: layers that read one input (q/k/v, gate/up) share its permutation.
        reader = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        order = None
        if case.desc_act:
            order = torch.randperm(tensor.shape[1], generator=torch.Generator().manual_seed(len(reader)))
        # v1 cannot store a zero point of 0 (zero - 1 wraps to 15, read back as 16).
        min_zero = 1 if case.fmt == "gptq" and case.checkpoint_format == "gptq" else 0
        quantized = round_to_nearest(tensor, case.bits, case.group_size, case.sym, order, min_zero)
        stored.update(stored_tensors(name, quantized, case))
        tensors[name] = quantized.dequantize().to(tensor.dtype)
    save_file(stored, str(packed / "model.safetensors"))
    save_file(tensors, str(dequantized / "model.safetensors"))
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = quant_config(case)
    (packed / "config.json").write_text(json.dumps(config))
    return packed, dequantized
