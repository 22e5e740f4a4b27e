"""apply_rotary_emb computes the rotate-half formula (HF's) to the bit."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_registry.layers.rotary import RotaryEmbedding, apply_rotary_emb, rotate_half


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_is_bit_identical_to_rotate_half_formula(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"})
    positions = torch.randint(0, 512, (37,), generator=gen)
    cos, sin = rotary(positions)
    # q and k heads side by side inside a wider qkv row, as the Llama layer passes them.
    qkv = torch.randn(37, 20 * 64, generator=gen).to(dtype)
    x = qkv[:, : 16 * 64].view(37, 16, 64)
    expected = x * cos.unsqueeze(1).to(dtype) + rotate_half(x) * sin.unsqueeze(1).to(dtype)
    assert torch.equal(apply_rotary_emb(x, cos, sin), expected)
    assert torch.equal(x, qkv[:, : 16 * 64].view(37, 16, 64))  # the input is not modified
