"""Write GPTQ and AWQ checkpoints of a float model for the benchmarks:
round to nearest (no calibration: GPTQ's error feedback and AWQ's
activation-aware scaling would only do better), asymmetric 4-bit, one
scale and zero per group of inputs. GPTQ v1 (zero - 1 stored; zero >= 1)
packs codes along K; AWQ ("gemm") along N in AutoAWQ's interleaved order.

    write_packed_checkpoint(float_dir, out_dir, "gptq", group_size=128)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_int32(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """4-bit codes -> int32 along `dim`: slot i (bits 4i..4i+3) of each int32 holds code order[i] of its 8."""
    moved = codes.to(torch.int64).movedim(dim, -1)
    moved = moved.reshape(*moved.shape[:-1], -1, 8)[..., list(order)]
    packed = (moved << (torch.arange(8) * 4)).sum(-1)
    return packed.to(torch.int64).where(packed < 2**31, packed - 2**32).to(torch.int32).movedim(-1, dim)


def round_to_nearest(weight: torch.Tensor, group_size: int, min_zero: int) -> tuple[torch.Tensor, ...]:
    """(codes [N, K], zeros [N, G], scales [N, G]) with w ~= (code - zero) * scale."""
    num_out, num_in = weight.shape
    group_size = num_in if group_size == -1 else group_size  # -1: one group per output channel
    grouped = weight.float().view(num_out, num_in // group_size, group_size)
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-6).half().float()
    zeros = torch.round(-low / scales).clamp(min_zero, 15)
    codes = torch.clamp(torch.round(grouped / scales[..., None]) + zeros[..., None], 0, 15)
    return codes.view(num_out, num_in).to(torch.int64), zeros.to(torch.int64), scales


def pack_layer(name: str, weight: torch.Tensor, fmt: str, group_size: int) -> dict[str, torch.Tensor]:
    prefix = name.removesuffix("weight")
    codes, zeros, scales = round_to_nearest(weight, group_size, min_zero=1 if fmt == "gptq" else 0)
    stored = {prefix + "scales": scales.t().half().contiguous()}
    if fmt == "awq":
        stored[prefix + "qweight"] = pack_int32(codes.t(), 1, AWQ_PACK_ORDER).contiguous()
        stored[prefix + "qzeros"] = pack_int32(zeros.t(), 1, AWQ_PACK_ORDER).contiguous()
        return stored
    stored[prefix + "qweight"] = pack_int32(codes.t(), 0).contiguous()
    stored[prefix + "qzeros"] = pack_int32((zeros - 1).t(), 1).contiguous()
    group = weight.shape[1] if group_size == -1 else group_size
    stored[prefix + "g_idx"] = (torch.arange(weight.shape[1]) // group).to(torch.int32)
    return stored


def write_packed_checkpoint(source: Path, out_dir: Path, fmt: str, group_size: int) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    stored: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            if name.endswith(".weight") and name.split(".")[-2] in LINEAR_SUFFIXES:
                stored.update(pack_layer(name, tensor, fmt, group_size))
            else:
                stored[name] = tensor
    save_file(stored, str(out_dir / "model.safetensors"))
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": fmt, "bits": 4, "group_size": group_size, "sym": False,
                                     "desc_act": False, "zero_point": True, "version": "gemm"}
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir
