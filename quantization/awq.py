"""AWQ checkpoints (Lin et al., 2023; AutoAWQ's "gemm" layout), read
through the shared wNa16 steps (wna16.py).

Per linear layer [N outputs, K inputs], with g = group_size (-1: K):

    qweight int32 [K, N / 8]      codes packed along N
    qzeros  int32 [K / g, N / 8]  zero points packed the same way
    scales  fp16  [K / g, N]

    w[n, k] = (q[k, n] - zero[k // g, n]) * scales[k // g, n]

Eight 4-bit codes share an int32 in AutoAWQ's interleaved order: slot i
(bits 4i..4i+3) holds column 8c + AWQ_PACK_ORDER[i]. Only zero_point true,
4 bits and version "gemm" are read (the gemv and marlin variants pack
differently); `modules_to_not_convert` layers load as float.
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

FORMAT = "awq"
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # slot i holds column AWQ_PACK_ORDER[i]
# The slot of column j: the inverse of AWQ_PACK_ORDER.
AWQ_SLOT_OF_COLUMN = tuple(AWQ_PACK_ORDER.index(column) for column in range(8))
VERSIONS = ("gemm",)


def awq_config(quant_config: dict[str, Any]) -> WNA16Config:
    bits = config_value(quant_config, ["w_bit", "bits"], FORMAT)
    if bits != 4:
        raise unsupported(FORMAT, "bits", bits, "4")
    group_size = check_group_size(FORMAT, "group_size", config_value(quant_config, ["q_group_size", "group_size"],
                                                                     FORMAT))
    zero_point = config_value(quant_config, ["zero_point"], FORMAT, True)
    if zero_point is not True:
        raise unsupported(FORMAT, "zero_point", zero_point, "true")
    version = str(config_value(quant_config, ["version"], FORMAT, "gemm")).lower()
    if version not in VERSIONS:
        raise unsupported(FORMAT, "version", version, ", ".join(VERSIONS))
    skip = config_value(quant_config, ["modules_to_not_convert"], FORMAT, None) or ()
    return WNA16Config(FORMAT, bits, group_size, skip_modules=tuple(skip))


class AWQMethod(WNA16Method):
    @classmethod
    def from_checkpoint_config(cls, quant_config: dict[str, Any]) -> AWQMethod:
        return cls(awq_config(quant_config))

    def unpack_qweight(self, qweight: torch.Tensor) -> torch.Tensor:  # [K, N / 8] -> [K, N]
        return unpack_int32(qweight, 4, dim=1, order=AWQ_SLOT_OF_COLUMN)

    def unpack_qzeros(self, qzeros: torch.Tensor) -> torch.Tensor:  # [G, N / 8] -> [G, N]
        return unpack_int32(qzeros, 4, dim=1, order=AWQ_SLOT_OF_COLUMN)


__all__ = ["AWQMethod", "awq_config"]
