"""Draft verification: score every draft of a step at once and keep the
accepted prefix plus one token (rejection_sampler.py holds the algorithm).

The target scored 1 + n_i positions of request i. Row j of request i is
processed as if its first j drafts were already output tokens: penalties,
min_tokens and the grammar see them. The model runner verifies every step
of a run with a drafter, also for requests without drafts, so that a seeded
request draws its random numbers the same way whatever the batch around it
drafted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.worker.rejection_sampler import DraftLayout, rejection_sample
from pagedllm.worker.sampler import SampledTokens, SamplingMetadata, gather_logprobs, to_logprob_entries
from pagedllm.worker.token_controls import explicit_logprob_token_ids

if TYPE_CHECKING:
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.core.scheduler_output import LogprobEntry
    from pagedllm.worker.persistent_batch import CachedRequestState
    from pagedllm.worker.sampler import Sampler
    from pagedllm.worker.sampling_batch import SamplingBatch


def verify_drafts(sampler: Sampler, raw_logits: torch.Tensor, sampling: SamplingBatch) -> SampledTokens:
    """The accepted drafts plus one token of every request of `sampling`.

    :param raw_logits: [R, V] float32, the target's logits at the 1 + n_i
        rows of each request in turn (R = sum(1 + n_i)): the rows of
        `sampling.logits_indices`.
    """
    requests = sampling.requests
    drafts = sampling.drafts if sampling.drafts is not None else [[] for _ in requests]
    device = raw_logits.device
    metadata = _row_sampling_metadata(requests, drafts, raw_logits.shape[-1], device, sampling.default_generator)
    metadata.grammar_bitmask = sampling.grammar_bitmask
    metadata.logits_processors = sampling.logits_processors
    logits = sampler.apply_logits_processors(raw_logits, metadata)
    target_probs = None if metadata.all_greedy else sampler.compute_probs(logits, metadata)

    if target_probs is None:
        token_ids = _greedy_emitted(logits, drafts)
    else:
        token_ids = _sampled_emitted(drafts, logits, target_probs, metadata, requests, sampling)
    if metadata.max_num_logprobs is None:
        return SampledTokens(token_ids, None)
    return SampledTokens(
        token_ids, _emitted_logprobs(raw_logits, drafts, requests, token_ids, metadata.max_num_logprobs)
    )


def _greedy_emitted(logits: torch.Tensor, drafts: Sequence[list[int]]) -> list[list[int]]:
    """Every request greedy: its drafts while each equals the target's
    argmax at its row, then the argmax of the first row that differs (or
    of the bonus row). The same tokens as rejection_sample's greedy rows,
    without its [B, K + 1] bookkeeping (a third of a bs-1 verify step)."""
    argmax = logits.argmax(dim=-1).tolist()
    emitted: list[list[int]] = []
    row = 0
    for request_drafts in drafts:
        tokens: list[int] = []
        for position, draft in enumerate(request_drafts):
            if draft != argmax[row + position]:
                break
            tokens.append(draft)
        tokens.append(argmax[row + len(tokens)])
        emitted.append(tokens)
        row += len(request_drafts) + 1
    return emitted


def _sampled_emitted(
    drafts: Sequence[list[int]],
    logits: torch.Tensor,
    target_probs: torch.Tensor,
    metadata: SamplingMetadata,
    requests: Sequence[CachedRequestState],
    sampling: SamplingBatch,
) -> list[list[int]]:
    """Some request samples: rejection sampling over the whole batch."""
    layout = DraftLayout.build([len(d) for d in drafts], device=logits.device)
    max_k = layout.max_num_drafts
    draft_ids = torch.tensor([d + [0] * (max_k - len(d)) for d in drafts], dtype=torch.long, device=logits.device)
    emitted = rejection_sample(
        layout,
        draft_ids,
        logits,
        target_probs,
        metadata.is_greedy[layout.row_start],
        draft_probs=_draft_probs(target_probs, layout, requests, drafts),
        generators={i: s.generator for i, s in enumerate(requests) if s.generator is not None},
        default_generator=sampling.default_generator,
    ).tolist()
    return [[t for t in row if t >= 0] for row in emitted]


def _row_sampling_metadata(
    requests: Sequence[CachedRequestState],
    drafts: Sequence[list[int]],
    vocab_size: int,
    device: torch.device,
    default_generator: torch.Generator,
) -> SamplingMetadata:
    """One sampling row per scored position: row j of a request sees its
    first j drafts as output tokens."""
    params: list[SamplingParams] = []
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    eos_ids: list[int | None] = []
    row_generators: dict[int, torch.Generator] = {}
    for state, request_drafts in zip(requests, drafts, strict=True):
        prompt = state.token_ids[: state.num_prompt_tokens]
        request_params = state.sampling_params
        # Only penalties, min_tokens and bad words read the output ids: skip the copies otherwise.
        sees_drafts = (
            not _no_penalties(request_params) or len(state.output_token_ids) < request_params.min_tokens
            or bool(request_params.bad_words_token_ids)
        )
        for position in range(len(request_drafts) + 1):
            if state.generator is not None:
                row_generators[len(params)] = state.generator
            params.append(request_params)
            prompts.append(prompt)
            outputs.append(
                state.output_token_ids + request_drafts[:position] if sees_drafts else state.output_token_ids
            )
            eos_ids.append(state.eos_token_id)
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        generators=row_generators,
        vocab_size=vocab_size,
        device=device,
        eos_token_ids=eos_ids,
        default_generator=default_generator,
    )


def _draft_probs(
    target_probs: torch.Tensor, layout: DraftLayout, requests: Sequence[CachedRequestState], drafts: Sequence[list[int]]
) -> torch.Tensor | None:
    """q at every row [R, V] when some request's drafter reported one; requests
    without q get one-hot rows (their drafts were deterministic)."""
    if all(s.draft_probs is None for s in requests):
        return None
    device = target_probs.device
    draft_probs = torch.zeros_like(target_probs)
    row_start = layout.row_start.tolist()
    for i, (state, request_drafts) in enumerate(zip(requests, drafts, strict=True)):
        n = len(request_drafts)
        if not n:
            continue
        if state.draft_probs is not None:
            draft_probs[row_start[i] : row_start[i] + n] = state.draft_probs[:n].to(draft_probs.dtype)
        else:
            rows = torch.arange(row_start[i], row_start[i] + n, device=device)
            draft_probs[rows, torch.tensor(request_drafts, device=device)] = 1.0
    return draft_probs


def _emitted_logprobs(
    raw_logits: torch.Tensor,
    drafts: Sequence[list[int]],
    requests: Sequence[CachedRequestState],
    token_ids: list[list[int]],
    num_logprobs: int,
) -> list[list[LogprobEntry]]:
    """Per request, one entry per emitted token.

    NOTE: logprobs are the target's raw distribution at each emitted position."""
    device = raw_logits.device
    row_start = np.cumsum([0] + [len(d) + 1 for d in drafts[:-1]]).tolist()
    rows = [row_start[i] + j for i, tokens in enumerate(token_ids) for j in range(len(tokens))]
    flat_token_ids = [t for tokens in token_ids for t in tokens]
    raw_logprobs = raw_logits[torch.tensor(rows, device=device)].log_softmax(dim=-1)
    row_params = [state.sampling_params for state, tokens in zip(requests, token_ids, strict=True) for _ in tokens]
    explicit = explicit_logprob_token_ids(row_params, raw_logits.shape[-1], device)
    entries = to_logprob_entries(
        gather_logprobs(raw_logprobs, num_logprobs, torch.tensor(flat_token_ids, device=device), explicit)
    )
    per_request: list[list[LogprobEntry]] = []
    next_entry = 0
    for tokens in token_ids:
        per_request.append(entries[next_entry : next_entry + len(tokens)])
        next_entry += len(tokens)
    return per_request


def _no_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty == 0.0 and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0
