"""Verify draft tokens against the target model (Leviathan et al., 2023;
Chen et al., 2023), batched over requests with different draft lengths.

Request i proposes n_i drafts and the target scored n_i + 1 positions: row j
of request i is the target's distribution after the first j drafts. The
output keeps the accepted prefix of the drafts plus one token:

- greedy: accept while draft == target argmax; the first mismatch emits the
  target's argmax and stops; all accepted -> a bonus argmax;
- random: accept draft x with probability min(1, p(x) / q(x)); on rejection
  emit a sample of normalize(max(p - q, 0)) and stop; all accepted -> a bonus
  sample of p at position n_i. A drafter without probabilities proposed x
  deterministically, so its q is one-hot (accept with p(x), recover from p
  without x). This keeps every emitted token distributed exactly as p.

All rows live in one flat [R, V] tensor (R = sum(n_i + 1)); only the small
per-request bookkeeping is padded to [B, K + 1].
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Output slots past a request's emitted tokens.
PLACEHOLDER_TOKEN_ID = -1
# Exponential draws are clamped here so probs / q is never 0/0.
_TINY = torch.finfo(torch.float32).tiny


class DraftLayout(NamedTuple):
    """Where each request's rows are in the flat [R, V] tensors."""

    num_draft_tokens: torch.Tensor  # [B] long
    row_start: torch.Tensor  # [B] long: first row of request i
    row_request: torch.Tensor  # [R] long: request of each row
    row_position: torch.Tensor  # [R] long: j, the number of drafts before the row
    max_num_drafts: int

    @classmethod
    def build(cls, num_draft_tokens: torch.Tensor | list[int], device: torch.device | str = "cpu") -> DraftLayout:
        num_drafts = torch.as_tensor(num_draft_tokens, dtype=torch.long, device=device)
        num_rows = num_drafts + 1
        row_start = torch.cumsum(num_rows, 0) - num_rows
        row_request = torch.repeat_interleave(torch.arange(len(num_drafts), device=device), num_rows)
        row_position = torch.arange(len(row_request), device=device) - row_start[row_request]
        max_num_drafts = int(num_drafts.max()) if len(num_drafts) else 0
        return cls(num_drafts, row_start, row_request, row_position, max_num_drafts)


def rejection_sample(
    layout: DraftLayout,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    target_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The emitted tokens, LongTensor [B, K + 1], PLACEHOLDER_TOKEN_ID padded.

    :param draft_token_ids: [B, K] drafts (entries past n_i are ignored).
    :param target_logits: [R, V] the target's logits after masks and
        penalties: greedy rows take their argmax.
    :param target_probs: [R, V] the target's sampling distribution (after
        temperature, top-k, top-p, min-p) for random rows; None when every
        request is greedy.
    :param is_greedy: [B] bool.
    :param draft_probs: [R, V] q at each draft row (bonus rows ignored); None
        means one-hot q for every request.
    :param generators: request index -> its own generator (seeded requests).
    """
    num_requests = len(layout.num_draft_tokens)
    device = target_logits.device
    max_k = layout.max_num_drafts
    # [B, K + 1]: drafts padded with 0 (the bonus column never compares).
    drafts = torch.zeros((num_requests, max_k + 1), dtype=torch.long, device=device)
    if max_k:
        drafts[:, :max_k] = draft_token_ids[:, :max_k].clamp(min=0)
    row_draft = drafts[layout.row_request, layout.row_position]  # [R]
    is_draft_row = layout.row_position < layout.num_draft_tokens[layout.row_request]  # [R]

    # Greedy: the target's argmax at every row is both verdict and recovery.
    target_argmax = target_logits.argmax(dim=-1)
    row_greedy = is_greedy[layout.row_request]
    accepted = row_draft == target_argmax
    recovered = target_argmax
    if target_probs is not None and not bool(row_greedy.all()):
        uniform, exponential = _random_draws(layout, target_probs.shape, generators, default_generator, device)
        random_accepted, random_recovered = _random_verdicts(
            target_probs, draft_probs, row_draft, is_draft_row, uniform, exponential
        )
        accepted = torch.where(row_greedy, accepted, random_accepted)
        recovered = torch.where(row_greedy, recovered, random_recovered)
    return _emitted_tokens(layout, drafts, accepted & is_draft_row, recovered)


def _random_verdicts(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    row_draft: torch.Tensor,
    is_draft_row: torch.Tensor,
    uniform: torch.Tensor,
    exponential: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (accept the draft: u <= p / q, the token emitted if not)."""
    p_draft = target_probs.gather(1, row_draft.unsqueeze(1)).squeeze(1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = target_probs.scatter(1, row_draft.unsqueeze(1), 0.0)
    else:
        q_draft = draft_probs.gather(1, row_draft.unsqueeze(1)).squeeze(1)
        residual = (target_probs - draft_probs).clamp_(min=0.0)
    accepted = uniform * q_draft <= p_draft  # u <= p / q without dividing by 0
    # Bonus rows sample p itself; a residual with no mass (p <= q
    # everywhere, so a rejection had probability 0) falls back to p.
    use_p = ~is_draft_row | (residual.sum(dim=-1) <= 0)
    residual = torch.where(use_p.unsqueeze(1), target_probs, residual)
    return accepted, residual.div_(exponential).argmax(dim=-1)


def _emitted_tokens(
    layout: DraftLayout, drafts: torch.Tensor, accepted: torch.Tensor, recovered: torch.Tensor
) -> torch.Tensor:
    """[B, K + 1]: each request's leading accepted drafts (a_i of them), then
    the recovered (or bonus) token of row a_i, then placeholders."""
    num_requests, width = drafts.shape
    device = drafts.device
    row_request, row_position = layout.row_request, layout.row_position
    accepted_grid = torch.zeros((num_requests, width), dtype=torch.long, device=device)
    accepted_grid[row_request, row_position] = accepted.long()
    num_accepted = accepted_grid.cumprod(dim=1).sum(dim=1)  # [B]
    recovered_grid = torch.zeros((num_requests, width), dtype=torch.long, device=device)
    recovered_grid[row_request, row_position] = recovered

    columns = torch.arange(width, device=device).unsqueeze(0)
    a = num_accepted.unsqueeze(1)
    placeholder = torch.full_like(drafts, PLACEHOLDER_TOKEN_ID)
    return torch.where(columns < a, drafts, torch.where(columns == a, recovered_grid, placeholder))


def _random_draws(
    layout: DraftLayout,
    shape: torch.Size,
    generators: dict[int, torch.Generator] | None,
    default_generator: torch.Generator | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: u ~ U[0, 1) and Exp(1) noise over the vocabulary. A request
    with its own generator draws all its rows from it alone, so its tokens do
    not depend on the rest of the batch."""
    num_rows = shape[0]
    uniform = torch.empty(num_rows, device=device)
    exponential = torch.empty(shape, device=device)
    generators = generators or {}
    if len(generators) < len(layout.num_draft_tokens):
        uniform.uniform_(generator=default_generator)
        exponential.exponential_(generator=default_generator)
    if generators:
        row_start = layout.row_start.tolist()
        num_drafts = layout.num_draft_tokens.tolist()
        for request_index, generator in generators.items():
            start, stop = row_start[request_index], row_start[request_index] + num_drafts[request_index] + 1
            uniform[start:stop].uniform_(generator=generator)
            exponential[start:stop].exponential_(generator=generator)
    return uniform, exponential.clamp_(min=_TINY)
