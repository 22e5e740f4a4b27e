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
from pagedllm.worker.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs, gather_logprobs
from pagedllm.core.scheduler_output import LogprobEntry, ModelRunnerOutput, SchedulerOutput
from pagedllm.spec_decode.interface import DraftInputs, TargetStep
from pagedllm.spec_decode.rejection_sampler import DraftLayout, rejection_sample

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.worker.decode_graphs import DecodeGraphRunner
    from pagedllm.worker.sampler import LogprobsTensors
    from pagedllm.kv_connectors.base import KVConnectorBase
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.spec_decode.interface import Drafter


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
    # The drafter's q for the drafts it last proposed ([n, V]); None: one-hot.
    draft_probs: torch.Tensor | None = None


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
        # Speculative decoding: set by the engine once the KV cache exists
        # (a model drafter allocates its own cache with the same geometry).
        self.drafter: Drafter | None = None
        # Set by the engine when decode steps replay captured graphs.
        self.graph_runner: DecodeGraphRunner | None = None
        # Set by the engine with kv_transfer configured: loads before the
        # forward, saves after it.
        self.kv_connector: KVConnectorBase | None = None
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
        input_ids_tensor = torch.tensor(input_ids, dtype=torch.long, device=device)
        positions_tensor = torch.from_numpy(positions).to(device)
        connector, connector_metadata = self.kv_connector, scheduler_output.kv_connector_metadata
        if connector is not None and connector_metadata is not None:
            connector.start_load_kv(connector_metadata)
            for layer_index in range(len(self.kv_caches)):
                connector.wait_for_layer_load(layer_index)
        if self.graph_runner is not None and self.graph_runner.can_run(common_metadata):
            hidden_states = self.graph_runner.run(input_ids_tensor, positions_tensor, common_metadata)
        else:
            # Backend-specific per-batch work, once for all layers.
            attn_metadata = self.attn_backend.build_metadata(common_metadata, self.block_size)
            hidden_states = self.model(input_ids_tensor, positions_tensor, attn_metadata)
        if connector is not None and connector_metadata is not None:
            for layer_index, kv_cache in enumerate(self.kv_caches):
                connector.save_kv_layer(layer_index, kv_cache, connector_metadata)
            connector.wait_for_save()

        # A request samples when this step reaches the end of its known tokens.
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = [len(spec_tokens.get(req_id, ())) for req_id in req_ids]
        sampling_rows = [
            row for row, state in enumerate(states) if seq_lens[row] - num_drafts[row] >= len(state.token_ids)
        ]
        output = ModelRunnerOutput(sampled_token_ids={req_id: [] for req_id in req_ids})
        self._compute_prompt_logprobs(states, num_computed, query_start_loc, seq_lens, hidden_states, output)
        if not sampling_rows and self.drafter is None:
            return output

        sampling_states = [states[row] for row in sampling_rows]
        sampled: list[list[int]] = []
        if sampling_rows:
            # With a drafter: score all 1 + n positions and keep the accepted
            # prefix, also for steps without drafts, so that a seeded request
            # draws its random numbers the same way whatever the batch around
            # it drafted (it would not if this step used the plain sampler).
            sample = self._verify_drafts if self.drafter is not None else self._sample
            sampled = sample(scheduler_output, hidden_states, query_start_loc, sampling_rows, sampling_states, output)
        for state, token_ids in zip(sampling_states, sampled):
            state.token_ids.extend(token_ids)
            state.output_token_ids.extend(token_ids)
            output.sampled_token_ids[state.req_id] = token_ids

        if self.drafter is not None:
            # NOTE: called even when nothing sampled: a model drafter mirrors
            # every prefill chunk into its own KV cache.
            num_rejected = np.zeros(len(req_ids), dtype=np.int64)
            for row, token_ids in zip(sampling_rows, sampled):
                num_rejected[row] = num_drafts[row] + 1 - len(token_ids)
            # Position after each request's last kept row: its next token is known.
            next_positions = seq_lens - num_rejected
            target_step = TargetStep(
                req_ids=req_ids,
                input_ids=input_ids_tensor,
                positions=positions,
                query_start_loc=query_start_loc,
                block_table=block_table,
                hidden_states=hidden_states,
                num_rejected=num_rejected,
                next_token_ids=np.array(
                    [state.token_ids[int(p)] for state, p in zip(states, next_positions)], dtype=np.int64
                ),
            )
            self._propose_drafts(sampling_rows, sampling_states, target_step, output)
        return output

    def _sample(
        self,
        scheduler_output: SchedulerOutput,
        hidden_states: torch.Tensor,
        query_start_loc: np.ndarray,
        sampling_rows: list[int],
        sampling_states: list[CachedRequestState],
        output: ModelRunnerOutput,
    ) -> list[list[int]]:
        """One token per sampling request, from its last position."""
        logits_indices = torch.tensor([int(query_start_loc[row + 1]) - 1 for row in sampling_rows], device=self.device)
        logits = self.model.compute_logits(hidden_states[logits_indices])
        metadata = SamplingMetadata.build(
            params=[s.sampling_params for s in sampling_states],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in sampling_states],
            output_token_ids=[s.output_token_ids for s in sampling_states],
            generators={i: s.generator for i, s in enumerate(sampling_states) if s.generator is not None},
            vocab_size=logits.shape[-1],
            device=self.device,
            eos_token_ids=[s.eos_token_id for s in sampling_states],
            default_generator=self.generator,
        )
        if scheduler_output.grammar_bitmask is not None:
            metadata.grammar_bitmask = self._grammar_rows(scheduler_output, sampling_states)
        sampler_output = self.sampler(logits, metadata)
        sampled = sampler_output.sampled_token_ids.tolist()
        logprobs = _to_entries(sampler_output.logprobs_tensors)
        for i, state in enumerate(sampling_states):
            if logprobs is not None and state.sampling_params.logprobs is not None:
                output.logprobs[state.req_id] = [_trim(logprobs[i], state.sampling_params.logprobs)]
        return [[token_id] for token_id in sampled]

    def _verify_drafts(
        self,
        scheduler_output: SchedulerOutput,
        hidden_states: torch.Tensor,
        query_start_loc: np.ndarray,
        sampling_rows: list[int],
        sampling_states: list[CachedRequestState],
        output: ModelRunnerOutput,
    ) -> list[list[int]]:
        """Score all 1 + n_i positions of every sampling request and keep the
        accepted drafts plus one token (spec_decode/rejection_sampler.py).

        Row j of request i is processed as if its first j drafts were already
        output tokens: penalties, min_tokens and the grammar see them."""
        device = self.device
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        drafts = [spec_tokens.get(state.req_id, []) for state in sampling_states]
        logits_indices: list[int] = []
        for row, request_drafts in zip(sampling_rows, drafts):
            end = int(query_start_loc[row + 1])
            logits_indices.extend(range(end - 1 - len(request_drafts), end))
        raw_logits = self.model.compute_logits(hidden_states[torch.tensor(logits_indices, device=device)]).float()

        params, prompts, outputs, eos_ids = [], [], [], []
        row_generators: dict[int, torch.Generator] = {}
        for state, request_drafts in zip(sampling_states, drafts):
            prompt = state.token_ids[: state.num_prompt_tokens]
            request_params = state.sampling_params
            # Only penalties and min_tokens read the output ids: skip the copies otherwise.
            sees_drafts = not _no_penalties(request_params) or len(state.output_token_ids) < request_params.min_tokens
            for position in range(len(request_drafts) + 1):
                if state.generator is not None:
                    row_generators[len(params)] = state.generator
                params.append(request_params)
                prompts.append(prompt)
                outputs.append(
                    state.output_token_ids + request_drafts[:position] if sees_drafts else state.output_token_ids
                )
                eos_ids.append(state.eos_token_id)
        metadata = SamplingMetadata.build(
            params=params,
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            generators=row_generators,
            vocab_size=raw_logits.shape[-1],
            device=device,
            eos_token_ids=eos_ids,
            default_generator=self.generator,
        )
        if scheduler_output.grammar_bitmask is not None:
            metadata.grammar_bitmask = self._grammar_rows(scheduler_output, sampling_states, all_positions=True)
        logits = self.sampler.apply_logits_processors(raw_logits, metadata)
        target_probs = None if metadata.all_greedy else self.sampler.compute_probs(logits, metadata)

        layout = DraftLayout.build([len(d) for d in drafts], device=device)
        max_k = layout.max_num_drafts
        draft_ids = torch.tensor([d + [0] * (max_k - len(d)) for d in drafts], dtype=torch.long, device=device)
        draft_probs = None
        if target_probs is not None and any(s.draft_probs is not None for s in sampling_states):
            # Requests without q get one-hot rows (their drafts were deterministic).
            draft_probs = torch.zeros_like(target_probs)
            row_start = layout.row_start.tolist()
            for i, (state, request_drafts) in enumerate(zip(sampling_states, drafts)):
                n = len(request_drafts)
                if not n:
                    continue
                if state.draft_probs is not None:
                    draft_probs[row_start[i] : row_start[i] + n] = state.draft_probs[:n].to(draft_probs.dtype)
                else:
                    rows = torch.arange(row_start[i], row_start[i] + n, device=device)
                    draft_probs[rows, torch.tensor(request_drafts, device=device)] = 1.0
        request_generators = {i: s.generator for i, s in enumerate(sampling_states) if s.generator is not None}
        emitted = rejection_sample(
            layout,
            draft_ids,
            logits,
            target_probs,
            metadata.is_greedy[layout.row_start],
            draft_probs=draft_probs,
            generators=request_generators,
            default_generator=self.generator,
        ).tolist()
        sampled = [[t for t in row if t >= 0] for row in emitted]

        if metadata.max_num_logprobs is not None:
            # NOTE: logprobs are the target's raw distribution at each emitted position.
            row_start = layout.row_start.tolist()
            rows = [row_start[i] + j for i, tokens in enumerate(sampled) for j in range(len(tokens))]
            token_ids = [t for tokens in sampled for t in tokens]
            raw_logprobs = raw_logits[torch.tensor(rows, device=device)].log_softmax(dim=-1)
            entries = _to_entries(
                gather_logprobs(raw_logprobs, metadata.max_num_logprobs, torch.tensor(token_ids, device=device))
            ) or []
            next_entry = 0
            for state, tokens in zip(sampling_states, sampled):
                request_entries = entries[next_entry : next_entry + len(tokens)]
                next_entry += len(tokens)
                if state.sampling_params.logprobs is not None:
                    output.logprobs[state.req_id] = [_trim(e, state.sampling_params.logprobs) for e in request_entries]
        return sampled

    def _propose_drafts(
        self,
        sampling_rows: list[int],
        sampling_states: list[CachedRequestState],
        target_step: TargetStep,
        output: ModelRunnerOutput,
    ) -> None:
        if self.drafter is None:
            return
        draft_output = self.drafter.propose(
            DraftInputs(
                req_ids=[s.req_id for s in sampling_states],
                token_ids=[s.token_ids for s in sampling_states],
                sampling_params=[s.sampling_params for s in sampling_states],
                batch_rows=sampling_rows,
                target_step=target_step,
            )
        )
        all_probs = draft_output.draft_probs
        for i, (state, draft_token_ids) in enumerate(zip(sampling_states, draft_output.draft_token_ids)):
            state.draft_probs = all_probs[i] if all_probs is not None else None
            if draft_token_ids:
                output.spec_token_ids[state.req_id] = list(draft_token_ids)

    @staticmethod
    def _grammar_rows(
        scheduler_output: SchedulerOutput, sampling_states: list[CachedRequestState], all_positions: bool = False
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The bitmask rows of this step's sampled positions and the logits rows
        they mask. A request owns 1 + len(drafts) bitmask rows; without
        `all_positions` the logits hold one row per request (its first
        position), with it 1 + len(drafts) rows per request, in batch order."""
        bitmask = scheduler_output.grammar_bitmask
        if bitmask is None:
            return None
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        logits_row: dict[str, int] = {}
        next_logits_row = 0
        for state in sampling_states:
            logits_row[state.req_id] = next_logits_row
            next_logits_row += 1 + len(spec_tokens.get(state.req_id, ())) if all_positions else 1
        bitmask_rows: list[int] = []
        logits_rows: list[int] = []
        next_row = 0
        for req_id in scheduler_output.structured_output_request_ids:
            num_rows = 1 + len(spec_tokens.get(req_id, ()))
            if req_id in logits_row:
                for position in range(num_rows if all_positions else 1):
                    bitmask_rows.append(next_row + position)
                    logits_rows.append(logits_row[req_id] + position)
            next_row += num_rows
        if not logits_rows:
            return None
        if len(bitmask_rows) != bitmask.shape[0]:
            bitmask = bitmask[bitmask_rows]
        return bitmask, logits_rows

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


def _no_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty == 0.0 and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0


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
