"""MXFP4 weights (OCP Microscaling Formats v1.0): read, never computed with.

A block of 32 consecutive values along a matrix's input dimension shares
one scale. Each value is an FP4 E2M1 number (sign, 2 exponent bits, 1
mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two a byte,
the even element in the low nibble. The scale is an E8M0 byte: 2^(s - 127),
s = 255 being NaN. GPT-OSS checkpoints store each expert matrix so, in
nn.Linear's [out, in] layout: `<proj>_blocks` uint8 [E, out, in / 32, 16]
and `<proj>_scales` uint8 [E, out, in / 32].

pagedllm has no MXFP4 kernel: the loader dequantizes (exactly: every FP4
value times a power of two is a float32) and the experts run in the compute
dtype.
"""

from __future__ import annotations

import torch

# FP4 E2M1 code -> value (bit 3 the sign).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK_SIZE = 32  # values sharing one scale
E8M0_BIAS = 127
E8M0_NAN = 255


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., G, 16] and scales [..., G] -> float32 [..., G * 32].

    Raises ValueError on misshaped or non-uint8 tensors and on a NaN scale
    (255): a weight the format says is not a number is refused, not loaded."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8; the checkpoint has {blocks.dtype}, {scales.dtype}")
    if blocks.shape[-1:] != (MXFP4_BLOCK_SIZE // 2,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., G, {MXFP4_BLOCK_SIZE // 2}] need scales [..., G]: "
                         f"the checkpoint has blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}")
    if bool((scales == E8M0_NAN).any()):
        raise ValueError(f"an MXFP4 scale is {E8M0_NAN}, NaN in the E8M0 format")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS
    return torch.ldexp(values, exponents).flatten(-2)


def dequantize_mxfp4_matrix(blocks: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """One matrix's blocks [out, in / 32, 16] and scales -> float32 [out, in]
    (`shape`, checked)."""
    rows, cols = shape
    expected = (rows, cols // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE // 2)
    if cols % MXFP4_BLOCK_SIZE or tuple(blocks.shape) != expected:
        raise ValueError(f"shape mismatch: model expects MXFP4 blocks {expected} of a {rows} x {cols} matrix "
                         f"(its input dimension a multiple of {MXFP4_BLOCK_SIZE}), checkpoint has "
                         f"{tuple(blocks.shape)}")
    return dequantize_mxfp4(blocks, scales)


__all__ = ["E8M0_BIAS", "FP4_E2M1_VALUES", "MXFP4_BLOCK_SIZE", "dequantize_mxfp4", "dequantize_mxfp4_matrix"]
