"""GPTQ checkpoints (Frantar et al., 2022; AutoGPTQ / GPTQModel's layout),
read through the shared wNa16 steps (wna16.py).

Per linear layer [N outputs, K inputs], with g = group_size (-1: K):

    qweight int32 [K / (32 / bits), N]   codes packed along K, the first
                                         input in the lowest bits
    qzeros  int32 [K / g, N / (32 / bits)]  zero points packed along N
    scales  fp16  [K / g, N]
    g_idx   int32 [K]                    each input's group

    w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]

checkpoint_format "gptq" (v1, the default) stores zero - 1, "gptq_v2"
stores the zero itself. desc_act=True (act-order) quantized the inputs in
another order, so g_idx is not k // g: the inputs are sorted by group at
load and x's columns are permuted the same way. bits 4 and 8 (8 through the
W8 layout); lm_head quantization and per-module `dynamic` rules are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.quantization.wna16 import (
    WNA16Config,
    WNA16Method,
    check_group_size,
    config_value,
    unpack_int32,
    unsupported,
)

FORMAT = "gptq"
BITS = (4, 8)
# checkpoint_format -> what is added to a stored zero point.
ZERO_SHIFTS = {"gptq": 1, "gptq_v2": 0}


def gptq_config(quant_config: dict[str, Any]) -> WNA16Config:
    bits = config_value(quant_config, ["bits"], FORMAT)
    if bits not in BITS:
        raise unsupported(FORMAT, "bits", bits, ", ".join(map(str, BITS)))
    group_size = check_group_size(FORMAT, "group_size", config_value(quant_config, ["group_size"], FORMAT))
    checkpoint_format = config_value(quant_config, ["checkpoint_format"], FORMAT, "gptq")
    if checkpoint_format not in ZERO_SHIFTS:
        raise unsupported(FORMAT, "checkpoint_format", checkpoint_format, ", ".join(ZERO_SHIFTS))
    if config_value(quant_config, ["lm_head"], FORMAT, False):
        raise unsupported(FORMAT, "lm_head", True, "false (the LM head stays float)")
    if config_value(quant_config, ["dynamic"], FORMAT, None):
        raise unsupported(FORMAT, "dynamic", quant_config["dynamic"], "none (one setting for every layer)")
    return WNA16Config(FORMAT, bits, group_size, desc_act=bool(config_value(quant_config, ["desc_act"], FORMAT, False)),
                       zero_shift=ZERO_SHIFTS[checkpoint_format], has_g_idx=True)


class GPTQMethod(WNA16Method):
    @classmethod
    def from_checkpoint_config(cls, quant_config: dict[str, Any]) -> GPTQMethod:
        return cls(gptq_config(quant_config))

    def unpack_qweight(self, qweight: torch.Tensor) -> torch.Tensor:  # [K / f, N] -> [K, N]
        assert self.config is not None
        return unpack_int32(qweight, self.config.bits, dim=0)

    def unpack_qzeros(self, qzeros: torch.Tensor) -> torch.Tensor:  # [G, N / f] -> [G, N]
        assert self.config is not None
        return unpack_int32(qzeros, self.config.bits, dim=1)


__all__ = ["GPTQMethod", "gptq_config"]
