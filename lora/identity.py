"""An adapter's identity: a digest of what it computes.

SHA-256 over a version tag, then, module by module in sorted order, the
module's name, its scaling (what the config contributes to the product)
and its A and B tensors (dtype, shape and raw bytes). Names, paths and
metadata (the base model's name, PEFT's version) are not part of it: two
folders holding the same weights are one adapter, and any change to a
weight or a scaling is another.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping

import torch

_VERSION = b"pagedllm-lora-digest-v1\0"


def adapter_digest(modules: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]) -> str:
    """Hex digest of `modules`: module name -> (A [r, in], B [out, r], scaling)."""
    digest = hashlib.sha256(_VERSION)
    for name in sorted(modules):
        lora_a, lora_b, scaling = modules[name]
        encoded = name.encode("utf-8")
        digest.update(struct.pack("<I", len(encoded)) + encoded + struct.pack("<d", scaling))
        for tensor in (lora_a, lora_b):
            _update_tensor(digest, tensor)
    return digest.hexdigest()


def _update_tensor(digest: hashlib._Hash, tensor: torch.Tensor) -> None:
    dtype = str(tensor.dtype).encode("ascii")
    digest.update(struct.pack("<I", len(dtype)) + dtype + struct.pack("<I", tensor.dim()))
    digest.update(struct.pack(f"<{tensor.dim()}q", *tensor.shape))
    data = tensor.detach().contiguous().cpu()
    digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
