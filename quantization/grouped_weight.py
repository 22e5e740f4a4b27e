"""The canonical layout of grouped 8-bit and 4-bit weights.

Every quantized checkpoint format (GPTQ, AWQ, GGUF Q8_0 / Q6_K / Q4_K,
compressed-tensors INT8) converts its tensors into this one layout at load,
and the grouped GEMM kernels (platforms/cpu/grouped_linear.py) consume it.
A weight W [N, K] (N output channels, K inputs) is stored as codes and one
scale (and offset) per group of `group_size` consecutive inputs of a row:

    W8: codes int8 [N, K]
        w[n, k] = codes[n, k] * scales[n, k // g] (+ offsets[n, k // g])
    W4: codes uint8 [N, K // 2], two codes a byte: input k even in the low
        nibble, k + 1 in the high one, values 0..15
        w[n, k] = code(n, k) * scales[n, k // g] + offsets[n, k // g]

scales and offsets are float32 [N, K // g]; W4 always has offsets (GPTQ and
AWQ: offset = -zero * scale; Q4_K: offset = -dmin * m), W8 may have none.
g = K is one scale per output channel.

torch only: every format's converter imports this module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedllm.core.errors import PagedLLMError

BITS = (4, 8)
W4_MAX_CODE = 15


class GroupedWeightError(PagedLLMError, ValueError):
    """Tensors that do not form the layout; a converter adds the checkpoint's
    path (model_registry's ModelLoadError) where it knows it."""


class GroupedWeight(NamedTuple):
    bits: int  # 8 or 4
    group_size: int  # g: inputs per scale, K % g == 0
    codes: torch.Tensor  # W8 int8 [N, K]; W4 uint8 [N, K // 2]
    scales: torch.Tensor  # float32 [N, K // g]
    offsets: torch.Tensor | None  # float32 [N, K // g]; required for W4

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[1]) * (2 if self.bits == 4 else 1)

    def validate(self, name: str = "weight") -> GroupedWeight:
        """self, or GroupedWeightError naming the tensor that breaks the layout."""
        if self.bits not in BITS:
            raise GroupedWeightError(f"{name}: bits={self.bits} is not one of {BITS}")
        code_dtype = torch.int8 if self.bits == 8 else torch.uint8
        if self.codes.dim() != 2 or self.codes.dtype != code_dtype:
            raise GroupedWeightError(f"{name}: codes of W{self.bits} must be {code_dtype} [N, K"
                                 f"{' // 2' if self.bits == 4 else ''}], got {self.codes.dtype} "
                                 f"{list(self.codes.shape)}")
        num_in = self.in_features
        if self.group_size <= 0 or num_in % self.group_size:
            raise GroupedWeightError(f"{name}: group_size={self.group_size} does not divide K={num_in}")
        expected = [self.out_features, num_in // self.group_size]
        for label, tensor in (("scales", self.scales), ("offsets", self.offsets)):
            if tensor is None:
                continue
            if tensor.dtype != torch.float32 or list(tensor.shape) != expected:
                raise GroupedWeightError(f"{name}: {label} must be float32 {expected}, got {tensor.dtype} "
                                     f"{list(tensor.shape)}")
        if self.bits == 4 and self.offsets is None:
            raise GroupedWeightError(f"{name}: W4 needs offsets (GPTQ/AWQ: -zero * scale), got None")
        return self

    def unpacked_codes(self) -> torch.Tensor:
        """The codes as one value per input: int8 [N, K] or uint8 [N, K]."""
        return unpack_w4(self.codes) if self.bits == 4 else self.codes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] computed in float32 as the formula above, then cast to dtype."""
        codes = self.unpacked_codes().float()
        num_out, num_in = codes.shape
        grouped = codes.view(num_out, num_in // self.group_size, self.group_size)
        weight = grouped * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            weight = weight + self.offsets.unsqueeze(-1)
        return weight.view(num_out, num_in).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """reference_linear(x, self, bias): a method too, so that a kernel
        module (platforms/, which may not import this one at run time) can
        fall back to it."""
        return reference_linear(x, self, bias)


def pack_w4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [N, K] (K even) -> [N, K // 2], k even in the low nibble."""
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] % 2:
        raise ValueError(f"pack_w4 takes uint8 [N, K] with K even, got {codes.dtype} {list(codes.shape)}")
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_w4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] -> uint8 codes [N, K], the inverse of pack_w4."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(packed.shape[0], -1)


def reference_linear(x: torch.Tensor, weight: GroupedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) in float32 over the dequantized weight, in x's dtype."""
    out = F.linear(x.float(), weight.dequantize(torch.float32).to(x.device),
                   None if bias is None else bias.float())
    return out.to(x.dtype)


__all__ = ["GroupedWeight", "GroupedWeightError", "pack_w4", "reference_linear", "unpack_w4"]
