"""Speculative decoding: the Drafter plugin kind (n-gram, draft model, EAGLE).
The worker verifies the drafts (worker/draft_verification.py) with the
rejection sampler that keeps the target's distribution exact."""

from pagedllm.spec_decode.interface import Drafter, DrafterContext, DraftInputs, DraftOutput, TargetStep

__all__ = ["DraftInputs", "DraftOutput", "Drafter", "DrafterContext", "TargetStep"]
