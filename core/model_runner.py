"""Turns a SchedulerOutput into one flattened forward pass and samples.

The batch is never padded: every scheduled token of every request is one row
of `input_ids`, with its absolute position, its KV slot (`slot_mapping`) and
its request's block table. Rows that end a request's known tokens produce
logits; the sampler turns those into the next tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.attention_backends.base import AttentionMetadata
from pagedllm.core.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs
from pagedllm.core.scheduler_output import LogprobEntry, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.core.sampler import LogprobsTensors
    from pagedllm.core.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """The runner's copy of a request; it appends the tokens it samples."""

    req_id: str
    num_prompt_tokens: int
    token_ids: list[int]  # prompt + output
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: type[AttentionBackend],
        *,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        # Random rows without a per-request seed draw from this, so that the
        # engine's seed makes a whole run reproducible (vLLM's `seed`).
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.requests: dict[str, CachedRequestState] = {}

        kv_cache_shape = attn_backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        self.kv_caches: list[torch.Tensor] = []
        for layer in model.get_attention_layers():
            kv_cache = torch.zeros(kv_cache_shape, dtype=dtype, device=device)
            layer.kv_cache = kv_cache
            self.kv_caches.append(kv_cache)

    # ----------------------------------------------------------------- state

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            # Keep tokens and RNG state: the request resumes where it was.
            if req_id in self.requests:
                self.requests[req_id].block_ids = []
        for new_req in scheduler_output.scheduled_new_reqs:
            params = new_req.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            self.requests[new_req.req_id] = CachedRequestState(
                req_id=new_req.req_id,
                num_prompt_tokens=len(new_req.prompt_token_ids),
                token_ids=list(new_req.prompt_token_ids),
                sampling_params=params,
                generator=generator,
                block_ids=list(new_req.block_ids),
                num_computed_tokens=new_req.num_computed_tokens,
                eos_token_id=new_req.eos_token_id,
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # --------------------------------------------------------------- execute

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={})

        req_ids = list(scheduler_output.num_scheduled_tokens)
        states = [self.requests[req_id] for req_id in req_ids]
        num_tokens = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        num_computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_tokens, out=query_start_loc[1:])
        seq_lens = num_computed + num_tokens
        total_tokens = int(query_start_loc[-1])

        input_ids: list[int] = []
        for state, start, count in zip(states, num_computed.tolist(), num_tokens.tolist()):
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(state.req_id, [])
            input_ids.extend(state.token_ids[start : start + count - len(drafts)])
            input_ids.extend(drafts)

        # positions[t] = num_computed[r] + (t - query_start_loc[r]) for token t of request r
        req_index = np.repeat(np.arange(len(req_ids)), num_tokens)
        positions = num_computed[req_index] + np.arange(total_tokens) - query_start_loc[req_index]
        max_num_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((len(req_ids), max_num_blocks), dtype=np.int32)
        for row, state in enumerate(states):
            block_table[row, : len(state.block_ids)] = state.block_ids
        slot_mapping = (
            block_table[req_index, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )

        device = self.device
        query_start_loc_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
        seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        common_metadata = AttentionMetadata(
            num_actual_tokens=total_tokens,
            num_reqs=len(req_ids),
            max_query_len=int(num_tokens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=query_start_loc_cpu.to(device),
            seq_lens=seq_lens_cpu.to(device),
            block_table=torch.from_numpy(block_table).to(device),
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        # Backend-specific per-batch work, once for all layers.
        attn_metadata = self.attn_backend.build_metadata(common_metadata, self.block_size)
        hidden_states = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.from_numpy(positions).to(device),
            attn_metadata,
        )

        # A request samples when this step reaches the end of its known tokens.
        sampling_rows = [
            row
            for row, state in enumerate(states)
            if seq_lens[row] - len(scheduler_output.scheduled_spec_decode_tokens.get(state.req_id, ()))
            >= len(state.token_ids)
        ]
        output = ModelRunnerOutput(sampled_token_ids={req_id: [] for req_id in req_ids})
        self._compute_prompt_logprobs(states, num_computed, query_start_loc, seq_lens, hidden_states, output)
        if not sampling_rows:
            return output

        logits_indices = torch.tensor([int(query_start_loc[row + 1]) - 1 for row in sampling_rows], device=device)
        logits = self.model.compute_logits(hidden_states[logits_indices])
        sampling_states = [states[row] for row in sampling_rows]
        metadata = SamplingMetadata.build(
            params=[s.sampling_params for s in sampling_states],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in sampling_states],
            output_token_ids=[s.output_token_ids for s in sampling_states],
            generators={i: s.generator for i, s in enumerate(sampling_states) if s.generator is not None},
            vocab_size=logits.shape[-1],
            device=device,
            eos_token_ids=[s.eos_token_id for s in sampling_states],
            default_generator=self.generator,
        )
        sampler_output = self.sampler(logits, metadata)
        sampled = sampler_output.sampled_token_ids.tolist()
        logprobs = _to_entries(sampler_output.logprobs_tensors)
        for i, state in enumerate(sampling_states):
            token_id = sampled[i]
            state.token_ids.append(token_id)
            state.output_token_ids.append(token_id)
            output.sampled_token_ids[state.req_id] = [token_id]
            if logprobs is not None and state.sampling_params.logprobs is not None:
                output.logprobs[state.req_id] = [_trim(logprobs[i], state.sampling_params.logprobs)]
        return output

    def _compute_prompt_logprobs(
        self,
        states: list[CachedRequestState],
        num_computed: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        hidden_states: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        for row, state in enumerate(states):
            num_logprobs = state.sampling_params.prompt_logprobs
            start = int(num_computed[row])
            if num_logprobs is None or start >= state.num_prompt_tokens:
                continue
            # Position p's logits score prompt token p + 1; the last prompt
            # position's logits are for sampling, not for the prompt.
            end = min(int(seq_lens[row]), state.num_prompt_tokens - 1)
            entries: list[LogprobEntry | None] = [None] if start == 0 else []
            if end > start:
                first_row = int(query_start_loc[row])
                logits = self.model.compute_logits(hidden_states[first_row : first_row + end - start])
                targets = torch.tensor(state.token_ids[start + 1 : end + 1], device=logits.device)
                entries.extend(_to_entries(compute_prompt_logprobs(logits, targets, num_logprobs)) or [])
            output.prompt_logprobs[state.req_id] = entries


def _to_entries(tensors: LogprobsTensors | None) -> list[LogprobEntry] | None:
    if tensors is None:
        return None
    token_ids = tensors.logprob_token_ids.tolist()
    logprobs = tensors.logprobs.tolist()
    ranks = tensors.selected_token_ranks.tolist()
    return [LogprobEntry(t, l, r) for t, l, r in zip(token_ids, logprobs, ranks)]


def _trim(entry: LogprobEntry, num_logprobs: int) -> LogprobEntry:
    """Keep the chosen token plus this request's top-n (the batch computed the max)."""
    return LogprobEntry(entry.token_ids[: num_logprobs + 1], entry.logprobs[: num_logprobs + 1], entry.rank)
