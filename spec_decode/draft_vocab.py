"""A draft vocabulary: the target tokens an EAGLE head's lm_head scores.

A full-vocabulary lm_head is a large part of a small head's cost (the tiny
target's: 8192 x 256, the size of the rest of the head), paid at every
draft step. EAGLE-3 checkpoints predict over a smaller draft vocabulary of
the most frequent tokens (FR-Spec, Zhao et al., 2025, does the same for
EAGLE-1 with the target's lm_head rows). The layout is vLLM's / SpecForge's:
`draft_vocab_size` in config.json and a `d2t` tensor [draft_vocab_size]
(target id = draft id + d2t[draft id]) among the safetensors; a `t2d` mask
beside it is ignored.

Drafting stays a valid proposal for the rejection sampler: the draft
distribution is a softmax over the draft vocabulary, mapped to the target's
with -inf logits (probability 0) elsewhere, so the drafted token and q agree.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.core.errors import ConfigError

# The config.json key and the tensor name, as in EAGLE-3 checkpoints.
DRAFT_VOCAB_SIZE = "draft_vocab_size"
D2T = "d2t"
T2D = "t2d"


def draft_vocab_size(hf_config: Any) -> int:
    """The head's draft vocabulary size (the full vocabulary when unset)."""
    return int(getattr(hf_config, DRAFT_VOCAB_SIZE, None) or hf_config.vocab_size)


def check_d2t(d2t: torch.Tensor, draft_size: int, vocab_size: int, model_path: str) -> torch.Tensor:
    """The target ids of the draft vocabulary [draft_size] (long), after
    checking `d2t` maps each draft id to a distinct target id."""
    if tuple(d2t.shape) != (draft_size,):
        raise ConfigError(f"speculative.model ({D2T})", model_path,
                          f"a d2t of shape ({draft_size},) ({DRAFT_VOCAB_SIZE}), not {tuple(d2t.shape)}")
    targets = torch.arange(draft_size, device=d2t.device) + d2t.to(torch.long)
    if int(targets.min()) < 0 or int(targets.max()) >= vocab_size or len(targets.unique()) != draft_size:
        raise ConfigError(
            f"speculative.model ({D2T})", model_path,
            f"draft id + d2t[draft id]: distinct target ids in [0, {vocab_size})",
        )
    return targets


def to_target_logits(draft_logits: torch.Tensor, target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, draft_size] -> [N, vocab_size]: -inf where no draft token maps."""
    out = draft_logits.new_full((draft_logits.shape[0], vocab_size), float("-inf"))
    out[:, target_ids] = draft_logits
    return out
