"""The shared token-bitmask layout (see interface.py): allocating, packing and
unpacking rows. Applying a bitmask to logits is the sampler's (worker/grammar_bitmask.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BITS_PER_WORD = 32


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [num_rows, ceil(vocab_size / 32)], every token allowed (-1 = all bits)."""
    import torch  # NOTE: here, so the API process (it only validates grammars) never imports torch

    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 [ceil(V / 32)] with bit t set where `allowed[t]` (bool [V])."""
    import torch

    padded = torch.zeros(bitmask_width(len(allowed)) * BITS_PER_WORD, dtype=torch.int64)
    padded[: len(allowed)] = allowed.to(torch.int64)
    words = (padded.view(-1, BITS_PER_WORD) << torch.arange(BITS_PER_WORD, dtype=torch.int64)).sum(dim=1)
    # Two's complement: bit 31 set means a negative int32.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed."""
    import torch

    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
