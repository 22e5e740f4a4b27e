"""GGUF quantized tensors to the canonical grouped layout, bit for bit
against gguf.quants.dequantize (float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from helpers.gguf_writer import quantize

from pagedllm.quantization.gguf_convert import GroupedTensor, convert_gguf_tensor

ROWS, COLS = 6, 512


def packed(qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    weights = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32)
    weights[0] += 3.0  # a row with no negative values: Q4_K's min is 0 there
    weights[1, :64] = 0.0  # an all-zero block and sub-blocks
    return quantize(weights, qtype)


def reconstruct(grouped: GroupedTensor) -> torch.Tensor:
    if grouped.bits == 4:
        low, high = grouped.codes & 0x0F, grouped.codes >> 4
        codes = torch.stack([low, high], dim=-1).reshape(grouped.codes.shape[0], -1)
    else:
        codes = grouped.codes
    scales = grouped.scales.repeat_interleave(grouped.group_size, dim=1)
    weights = codes.to(torch.float32) * scales
    if grouped.offsets is not None:
        weights = weights + grouped.offsets.repeat_interleave(grouped.group_size, dim=1)
    return weights


@pytest.mark.parametrize(("qtype", "bits", "group_size", "code_dtype", "has_offsets"), [
    (GGMLQuantizationType.Q8_0, 8, 32, torch.int8, False),
    (GGMLQuantizationType.Q6_K, 8, 16, torch.int8, False),
    (GGMLQuantizationType.Q4_K, 4, 32, torch.uint8, True),
])
def test_grouped_layout_reproduces_gguf_dequantize_exactly(
    qtype: GGMLQuantizationType, bits: int, group_size: int, code_dtype: torch.dtype, has_offsets: bool
) -> None:
    data = packed(qtype)
    grouped = convert_gguf_tensor(data, qtype, (ROWS, COLS))
    assert grouped is not None
    assert (grouped.bits, grouped.group_size, grouped.codes.dtype) == (bits, group_size, code_dtype)
    assert grouped.codes.shape == (ROWS, COLS if bits == 8 else COLS // 2)
    assert grouped.scales.shape == (ROWS, COLS // group_size) and grouped.scales.dtype == torch.float32
    assert (grouped.offsets is not None) == has_offsets
    expected = torch.from_numpy(quants.dequantize(data, qtype))
    assert torch.equal(reconstruct(grouped), expected)


def test_q6_k_codes_are_centred_and_q4_k_codes_are_nibbles() -> None:
    q6 = convert_gguf_tensor(packed(GGMLQuantizationType.Q6_K), GGMLQuantizationType.Q6_K, (ROWS, COLS))
    q4 = convert_gguf_tensor(packed(GGMLQuantizationType.Q4_K), GGMLQuantizationType.Q4_K, (ROWS, COLS))
    assert q6 is not None and q4 is not None
    assert int(q6.codes.min()) >= -32 and int(q6.codes.max()) <= 31
    assert int(q6.codes.min()) < 0 < int(q6.codes.max())
    assert bool((q4.offsets <= 0).all()) and bool((q4.offsets[0] == 0).any())  # type: ignore[operator]


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0,
                                   GGMLQuantizationType.Q5_K, GGMLQuantizationType.F16])
def test_other_types_are_left_to_dequantize_at_load(qtype: GGMLQuantizationType) -> None:
    assert convert_gguf_tensor(np.zeros((ROWS, 8), np.uint8), qtype, (ROWS, COLS)) is None
