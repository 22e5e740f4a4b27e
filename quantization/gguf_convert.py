"""GGUF quantized tensors -> the canonical grouped layout, exactly.

For one GGUF tensor (its raw block bytes, its type, its shape [N, K] in
torch order) `convert_gguf_tensor` returns (bits, group_size, codes, scales,
offsets) such that, in float32,

    W8: codes int8 [N, K];        w = codes * scales (+ offsets)
    W4: codes uint8 [N, K // 2];  w = code * scales + offsets
        (value k even in the LOW nibble of byte k // 2, codes 0..15)

with scales / offsets float32 [N, K // group_size], equals
gguf.quants.dequantize bit for bit:

    Q8_0 -> W8, g=32: code = q, scale = the block's fp16 d; no offsets
    Q6_K -> W8, g=16: code = q - 32, scale = d * sc (the group's int8 scale)
    Q4_K -> W4, g=32: code = q, scale = d * sc_j, offset = -(dmin * m_j)
            (sc_j, m_j the sub-block's 6-bit scale and min, 12-byte packed)
    anything else (Q4_0, Q5_0, Q5_K, IQ*, F16, ...) -> None: dequantize at load

Each scale and offset is the float32 product dequantize computes, so
code * scale + offset rounds the same way (keep the multiply and the add
as two float32 operations; a fused multiply-add may differ in the last bit).
The layout is rows as stored: Llama's q/k rows still carry llama.cpp's
rotary permutation (model_registry/gguf_checkpoint.unpermute_rotary_rows
applies to codes, scales and offsets alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

QK_K = 256


class GroupedTensor(NamedTuple):
    bits: int
    group_size: int
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None


def convert_gguf_tensor(data: np.ndarray, tensor_type: int, shape: Sequence[int]) -> GroupedTensor | None:
    """`data`: the tensor's raw bytes (uint8, any shape); `shape`: [N, K]."""
    from gguf import GGMLQuantizationType

    converter = {
        GGMLQuantizationType.Q8_0: _q8_0,
        GGMLQuantizationType.Q6_K: _q6_k,
        GGMLQuantizationType.Q4_K: _q4_k,
    }.get(GGMLQuantizationType(tensor_type))
    if converter is None or len(shape) != 2:
        return None
    rows, cols = (int(dim) for dim in shape)
    return converter(np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1), rows, cols)


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _tensor(array: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).reshape(rows, -1)


def _q8_0(data: np.ndarray, rows: int, cols: int) -> GroupedTensor:
    blocks = data.reshape(rows, cols // 32, 34)  # fp16 d, 32 int8
    scales = _fp16(blocks[..., :2])
    codes = blocks[..., 2:].copy().view(np.int8)
    return GroupedTensor(8, 32, _tensor(codes, rows), _tensor(scales, rows), None)


def _q6_k(data: np.ndarray, rows: int, cols: int) -> GroupedTensor:
    blocks = data.reshape(-1, 210)  # ql[128], qh[64], int8 scales[16], fp16 d
    ql, qh = blocks[:, :128].reshape(-1, 2, 1, 64), blocks[:, 128:192].reshape(-1, 2, 1, 32)
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = _fp16(blocks[:, 208:210])
    # value c*128 + s*32 + l: low 4 bits from ql[c*64 + (s % 2)*32 + l] (nibble s // 2), high 2 from qh[c*32 + l]
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = low.reshape(-1, 2, 4, 32) | (high.reshape(-1, 2, 4, 32) << 4)
    codes = (q.astype(np.int8) - np.int8(32)).reshape(rows, cols)
    return GroupedTensor(8, 16, _tensor(codes, rows), _tensor(d * sc, rows), None)


def q4_k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 sub-blocks' 6-bit scales and mins from K-quants' 12 bytes:
    bytes 0-3 / 4-7 hold sc / m of sub-blocks 0-3 (low 6 bits) and the top
    2 bits of sub-blocks 4-7's; bytes 8-11 their low 4 bits (sc low, m high)."""
    sc_low, m_low, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([sc_low & 0x3F, (rest & 0x0F) | ((sc_low >> 2) & 0x30)], axis=1)
    mins = np.concatenate([m_low & 0x3F, (rest >> 4) | ((m_low >> 2) & 0x30)], axis=1)
    return sc, mins


def _q4_k(data: np.ndarray, rows: int, cols: int) -> GroupedTensor:
    blocks = data.reshape(-1, 144)  # fp16 d, fp16 dmin, scales[12], qs[128]
    d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
    sc, mins = q4_k_scale_min(blocks[:, 4:16])
    # sub-blocks 2c and 2c + 1 are the low and high nibbles of qs[c*32 : c*32 + 32]
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(rows, cols)
    codes = q[:, 0::2] | (q[:, 1::2] << 4)
    scales = d * sc.astype(np.float32)
    offsets = -(dmin * mins.astype(np.float32))
    return GroupedTensor(4, 32, _tensor(codes, rows), _tensor(scales, rows), _tensor(offsets, rows))
