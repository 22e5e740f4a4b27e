"""Logits processing and sampling, with vLLM V1 semantics.

Order: raw logprobs -> grammar bitmask (structured output) -> allowed_token_ids
and bad_words (worker/token_controls.py) -> logit bias ->
min_tokens stop masking -> logits processors (plugins) -> penalties -> greedy
argmax | (temperature -> argmax-invariant logits processors -> min_p -> top_k
-> top_p -> exponential-race sampling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from pagedllm.core.sampling_params import SamplingParams, SamplingType
from pagedllm.core.scheduler_output import LogprobEntry
from pagedllm.worker.grammar_bitmask import apply_token_bitmask_inplace
from pagedllm.worker.logits_processor_rows import apply_logits_processors
from pagedllm.worker.token_controls import TokenControls

if TYPE_CHECKING:
    from pagedllm.logits_processors.interface import LogitsProcessor

# Exponential draws are clamped here so probs / q is never 0/0 (NaN would win argmax).
_TINY = torch.finfo(torch.float32).tiny


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), the same indices (the first of ties, a NaN wins),
    from max(): its CPU kernel took a third of argmax's time on [8, 8192]."""
    return x.max(dim=-1).indices


class LogprobsTensors(NamedTuple):
    """Column 0 is the sampled (or actual next prompt) token, columns 1..k the top-k."""

    logprob_token_ids: torch.Tensor  # LongTensor[N, k + 1]
    logprobs: torch.Tensor  # FloatTensor[N, k + 1]
    selected_token_ranks: torch.Tensor  # LongTensor[N], 1-based rank of column 0

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return (self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.selected_token_ranks.tolist())


class SampledTokens(NamedTuple):
    """What a step emits per sampling request (one token, or accepted drafts
    plus one), with one logprobs entry per token when the batch asked (the
    batch's largest top-n: trim per request)."""

    token_ids: list[list[int]]
    logprobs: list[list[LogprobEntry]] | None


def to_logprob_entries(tensors: LogprobsTensors) -> list[LogprobEntry]:
    """One entry per row of `tensors`."""
    token_ids, logprobs, ranks = tensors.tolists()
    return [LogprobEntry(*entry) for entry in zip(token_ids, logprobs, ranks, strict=True)]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # LongTensor[N]
    logprobs_tensors: LogprobsTensors | None


@dataclass
class SamplingMetadata:
    """Per-step batch view of the requests' SamplingParams; row i is request i."""

    temperature: torch.Tensor  # [N] float32; 1.0 on greedy rows (never divides by 0)
    is_greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [N] long, vocab_size when off; None when off everywhere
    top_p: torch.Tensor | None  # [N] float32, 1.0 when off; None when off everywhere
    min_p: torch.Tensor | None  # [N] float32, 0.0 when off; None when off everywhere
    # Row index -> the request's own generator (seeded random rows only).
    generators: dict[int, torch.Generator]
    # Largest `logprobs` in the batch; None when no row wants logprobs.
    max_num_logprobs: int | None
    no_penalties: bool
    presence_penalties: torch.Tensor  # [N] float32
    frequency_penalties: torch.Tensor  # [N] float32
    repetition_penalties: torch.Tensor  # [N] float32
    # Token counts over each row's output ids; None when no_penalties.
    output_token_counts: torch.Tensor | None  # [N, V] float32
    # Tokens seen in prompt or output (repetition penalty); None when no_penalties.
    seen_token_mask: torch.Tensor | None  # [N, V] bool
    # (rows, token ids) masked to -inf while a row is below min_tokens; None if none.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    vocab_size: int
    # Draws for random rows without their own generator (the engine's, seeded
    # from the config's seed); None = torch's global RNG.
    default_generator: torch.Generator | None = None
    # Structured output: (int32 bitmask [R, ceil(V / 32)], the R logits rows it
    # masks); other rows are untouched. Set by the model runner.
    grammar_bitmask: tuple[torch.Tensor, list[int]] | None = None
    # logit_bias as (rows, token ids, biases) of every biased entry; None if no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # The loaded logits processors (plugins), already told this step's rows
    # (worker/logits_processor_rows.py). Set by the model runner.
    logits_processors: Sequence[LogitsProcessor] = ()
    # allowed_token_ids, bad_words, logprob_token_ids; None when no row uses them.
    token_controls: TokenControls | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int | None] | None = None,
        default_generator: torch.Generator | None = None,
    ) -> SamplingMetadata:
        """`generators` maps row index -> generator for every seeded random row; the
        caller keeps them per request across steps. `eos_token_ids` (per row) lets
        the sampler forbid EOS and stop tokens while a row is below `min_tokens`."""
        types = [p.sampling_type for p in params]
        for row, sampling_type in enumerate(types):
            if sampling_type == SamplingType.RANDOM_SEED and row not in generators:
                raise ValueError(f"row {row} has seed={params[row].seed} but no generator")
        is_greedy_list = [t == SamplingType.GREEDY for t in types]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        temperature = floats([1.0 if g else p.temperature for p, g in zip(params, is_greedy_list, strict=True)])
        top_k, top_p, min_p = _truncation_tensors(params, vocab_size, device)

        logprob_counts = [p.num_logprobs for p in params if p.num_logprobs is not None]
        no_penalties = all(
            p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
            for p in params
        )
        output_token_counts, seen_token_mask = (None, None) if no_penalties else _penalty_counts(
            params, prompt_token_ids, output_token_ids, vocab_size, device
        )
        return cls(
            temperature=temperature,
            is_greedy=torch.tensor(is_greedy_list, dtype=torch.bool, device=device),
            all_greedy=all(is_greedy_list),
            all_random=not any(is_greedy_list),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=dict(generators),
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
            no_penalties=no_penalties,
            presence_penalties=floats([p.presence_penalty for p in params]),
            frequency_penalties=floats([p.frequency_penalty for p in params]),
            repetition_penalties=floats([p.repetition_penalty for p in params]),
            output_token_counts=output_token_counts,
            seen_token_mask=seen_token_mask,
            min_tokens_mask=_min_tokens_mask(params, output_token_ids, eos_token_ids, vocab_size, device),
            vocab_size=vocab_size,
            default_generator=default_generator,
            logit_bias=_logit_bias(params, vocab_size, device),
            token_controls=TokenControls.build(params, output_token_ids, vocab_size, device),
        )


def _truncation_tensors(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(top_k, top_p, min_p) per row; each None when no row uses it."""
    top_k = top_p = min_p = None
    if any(p.top_k > 0 and p.top_k < vocab_size for p in params):
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params],
                             dtype=torch.long, device=device).clamp_(max=vocab_size)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    return top_k, top_p, min_p


def _penalty_counts(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output token counts [N, V], seen mask [N, V]: output tokens, and
    prompt tokens too when a row has a repetition penalty)."""
    output_token_counts = _token_counts(output_token_ids, vocab_size, device)
    seen_token_mask = output_token_counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        seen_token_mask |= _token_counts(prompt_token_ids, vocab_size, device) > 0
    return output_token_counts, seen_token_mask


def _token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, V] float32 counts of each row's ids, by one scatter_add over padded ids."""
    num_rows = len(token_ids)
    max_len = max((len(ids) for ids in token_ids), default=0)
    # Padding (and any id outside the vocabulary) lands in an extra column V that is dropped.
    padded = torch.full((num_rows, max_len), vocab_size, dtype=torch.long)
    for row, ids in enumerate(token_ids):
        if ids:
            padded[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    padded = padded.masked_fill_((padded < 0) | (padded > vocab_size), vocab_size).to(device)
    counts = torch.zeros((num_rows, vocab_size + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _min_tokens_mask(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int | None] | None,
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    tokens: list[int] = []
    for row, p in enumerate(params):
        if len(output_token_ids[row]) >= p.min_tokens:
            continue
        stop_ids = p.all_stop_token_ids
        eos = eos_token_ids[row] if eos_token_ids is not None else None
        if eos is not None and not p.ignore_eos:
            stop_ids.add(eos)
        for token_id in sorted(stop_ids):
            if token_id < vocab_size:
                rows.append(row)
                tokens.append(token_id)
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(tokens, dtype=torch.long, device=device))


def _logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, p in enumerate(params):
        if not p.logit_bias:
            continue  # NOTE: the common case; a batch without biases builds nothing
        for token_id, bias in p.logit_bias.items():
            # Validation refuses ids past the vocabulary (validate_vocab); never index past it.
            if token_id < vocab_size:
                rows.append(row)
                token_ids.append(token_id)
                biases.append(bias)
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(token_ids, dtype=torch.long, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output tokens: positive logits / p, negative * p),
    then frequency (- f * count in output) and presence (- p * [count > 0])."""
    if metadata.no_penalties:
        return logits
    counts = metadata.output_token_counts
    seen = metadata.seen_token_mask
    if counts is None or seen is None:
        raise ValueError("SamplingMetadata has penalties but no token counts")
    repetition = torch.where(seen, metadata.repetition_penalties.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - metadata.frequency_penalties.unsqueeze(1) * counts
    return logits - metadata.presence_penalties.unsqueeze(1) * (counts > 0).float()


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k keeps logits >= the k-th largest; top-p keeps the smallest set whose
    cumulative probability reaches p (at least one token)."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most probable token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def random_sample(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1): a draw from probs. A row with a generator
    draws its q from it alone, so its tokens do not depend on the rest of the batch."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_(generator=default_generator)
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return argmax_rows(probs.div(q.clamp_(min=_TINY)))


def gather_logprobs(
    logprobs: torch.Tensor,
    num_logprobs: int,
    token_ids: torch.Tensor,
    explicit: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> LogprobsTensors:
    """Top `num_logprobs` of each row plus `token_ids`' logprob and 1-based
    rank; `explicit` (rows, ids [R, K <= num_logprobs]) puts those rows'
    logprob_token_ids in place of their top-k."""
    token_ids = token_ids.long()
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))
    # Rank as vLLM: how many logprobs are >= the chosen token's.
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
        values = torch.cat([token_logprobs, top_logprobs], dim=1)
    else:
        ids, values = token_ids.unsqueeze(1), token_logprobs
    if explicit is not None:
        rows, explicit_ids = explicit
        columns = slice(1, 1 + explicit_ids.shape[1])
        ids[rows, columns] = explicit_ids
        values[rows, columns] = logprobs[rows].gather(1, explicit_ids)
    return LogprobsTensors(ids, values, ranks)


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprobs of the actual next prompt tokens (column 0) plus the top-k, from raw logits."""
    return gather_logprobs(logits.float().log_softmax(dim=-1), num_logprobs, target_token_ids)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        # NOTE: logprobs are of the raw model distribution (vLLM's raw_logprobs),
        # before any penalty, mask or temperature.
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None
        logits = self.apply_logits_processors(logits, metadata)
        sampled = self.sample(logits, metadata)

        logprobs_tensors = None
        if raw_logprobs is not None and metadata.max_num_logprobs is not None:
            controls = metadata.token_controls
            logprobs_tensors = gather_logprobs(
                raw_logprobs, metadata.max_num_logprobs, sampled, controls.logprob_token_ids if controls else None
            )
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Grammar bitmask, allowed_token_ids and bad_words, logit bias,
        min_tokens stop masking, the logits processors that are not argmax-invariant, and penalties:
        the logits greedy rows take the argmax of (float32 in, float32 out)."""
        if metadata.grammar_bitmask is not None:
            bitmask, rows = metadata.grammar_bitmask
            logits = logits.contiguous()
            apply_token_bitmask_inplace(logits, bitmask, rows)
        if metadata.token_controls is not None:
            logits = metadata.token_controls.apply(logits)
        if metadata.logit_bias is not None:
            bias_rows, bias_token_ids, biases = metadata.logit_bias
            # Out of place: the caller may still read the raw logits (logprobs).
            logits = logits.index_put((bias_rows, bias_token_ids), biases, accumulate=True)
        if metadata.min_tokens_mask is not None:
            mask_rows, mask_token_ids = metadata.min_tokens_mask
            logits = logits.index_put((mask_rows, mask_token_ids), torch.tensor(float("-inf"), device=logits.device))
        if metadata.logits_processors:
            # A copy: processors may work in place, and the caller still reads the raw logits.
            logits = apply_logits_processors(metadata.logits_processors, logits.clone(), argmax_invariant=False)
        return apply_penalties(logits, metadata)

    @staticmethod
    def compute_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows sample from: temperature,
        argmax-invariant logits processors, min_p,
        top-k, top-p, softmax over processed logits (speculative decoding
        verifies drafts against it)."""
        logits = logits / metadata.temperature.unsqueeze(1)
        logits = apply_logits_processors(metadata.logits_processors, logits, argmax_invariant=True)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        return logits.softmax(dim=-1)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.all_greedy:
            return argmax_rows(logits)
        greedy_logits = logits
        sampled = random_sample(self.compute_probs(logits, metadata), metadata.generators, metadata.default_generator)
        if metadata.all_random:
            return sampled
        # Greedy rows take the argmax of the penalized logits, before temperature.
        return torch.where(metadata.is_greedy, argmax_rows(greedy_logits), sampled)
