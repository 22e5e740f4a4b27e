"""Turns a SchedulerOutput into one flattened forward pass and samples.

The batch is never padded: every scheduled token of every request is one row
of `input_ids`, with its absolute position, its KV slot (`slot_mapping`) and
its request's block table (model_registry/input_batch.py). Rows that end a request's
known tokens produce logits; the sampler turns those into the next tokens, or,
with a drafter, worker/draft_verification.py keeps the accepted drafts plus
one. Both read the step's one SamplingBatch (worker/sampling_batch.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.core.sampling_params import SamplingType
from pagedllm.core.scheduler_output import (
    KVConnectorOutput,
    KVConnectorStats,
    LogprobEntry,
    ModelRunnerOutput,
    SchedulerOutput,
    SpecStepTimes,
)
from pagedllm.model_registry.input_batch import InputBatch
from pagedllm.spec_decode.interface import DraftInputs, TargetStep
from pagedllm.spec_decode.measurements import SpecMeasurements
from pagedllm.worker.draft_placeholders import DraftPlaceholders
from pagedllm.worker.draft_verification import verify_drafts
from pagedllm.worker.logits_processor_rows import LogitsProcessorRows
from pagedllm.worker.lora_batch import LoRABatch
from pagedllm.worker.persistent_batch import CachedRequestState, PersistentBatch
from pagedllm.worker.sampler import (
    SampledTokens,
    Sampler,
    SamplingMetadata,
    compute_prompt_logprobs,
    to_logprob_entries,
)
from pagedllm.worker.sampling_batch import SamplingBatch

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.kv_connectors.base import KVConnectorBase, KVConnectorMetadata
    from pagedllm.logits_processors.interface import LogitsProcessor
    from pagedllm.lora.model import LoRAModelSlots
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.spec_decode.interface import Drafter
    from pagedllm.spec_decode.policy import SpeculationPolicy
    from pagedllm.worker.decode_graphs import DecodeGraphRunner


class ModelRunner:
    def __init__(
        self,
        model: ModelForCausalLM,
        attn_backend: type[AttentionBackend],
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        device: torch.device,
        vocab_size: int,
        max_model_len: int,
        max_num_reqs: int,
        seed: int = 0,
        drafter: Drafter | None = None,
        spec_policy: SpeculationPolicy | None = None,
        kv_connector: KVConnectorBase | None = None,
        graph_runner: DecodeGraphRunner | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
        num_kv_cache_groups: int = 1,
        lora: LoRAModelSlots | None = None,
    ) -> None:
        """`kv_caches`: the per-layer KV tensors, already bound to the model's
        attention layers (model_registry/kv_cache.py: allocate_kv_caches);
        `lora`: the model's adapter slots when LoRA is enabled."""
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        # Speculative decoding: proposes drafts after every step (a model
        # drafter holds its own KV cache with the same block geometry).
        self.drafter = drafter
        # How many tokens each request drafts for its next step (None: all k),
        # from what the runner measures (spec_decode/measurements.py).
        self.spec_policy = spec_policy
        self.spec_measurements = SpecMeasurements()
        # Async scheduling: the drafts that fill the scheduler's placeholders.
        self.draft_placeholders = DraftPlaceholders()
        self._last_step_end: float | None = None
        self._captures_at_start = 0
        # With kv_transfer configured: loads before the forward, saves after it.
        self.kv_connector = kv_connector
        self._reported_connector_stats = KVConnectorStats()
        # Replays captured graphs for uniform decode steps.
        self.graph_runner = graph_runner
        # Adapter slots: loaded as the scheduler says, each row's set per step.
        self.lora_batch = None if lora is None else LoRABatch(lora, device)
        self.sampler = Sampler()
        # The loaded logits processors (plugins) and the rows they were last told.
        self.logits_processor_rows = LogitsProcessorRows(logits_processors)
        # Random rows without a per-request seed draw from this, so that the
        # engine's seed makes a whole run reproducible (vLLM's `seed`).
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.requests: dict[str, CachedRequestState] = {}
        # Their token ids, block tables and computed counts, row per request.
        self.input_batch = PersistentBatch(max_num_reqs, max_model_len, block_size, num_kv_cache_groups)
        # The last step's sampling requests and their tensors, while reusable.
        self._cached_sampling: tuple[list[CachedRequestState], SamplingMetadata] | None = None

    # ----------------------------------------------------------------- state

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        input_batch = self.input_batch
        if self.lora_batch is not None:
            self.lora_batch.update(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            input_batch.remove_request(req_id)
            self.spec_measurements.forget(req_id)
        if self.drafter is not None and scheduler_output.finished_req_ids:
            self.drafter.finish_requests(set(scheduler_output.finished_req_ids))
            self.draft_placeholders.forget(scheduler_output.finished_req_ids)
        for req_id in scheduler_output.preempted_req_ids:
            # Keep tokens and RNG state: the request resumes where it was.
            if req_id in self.requests:
                input_batch.set_block_ids(req_id, [])
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
                eos_token_id=new_req.eos_token_id,
            )
            input_batch.add_request(
                new_req.req_id, new_req.prompt_token_ids, new_req.block_ids, new_req.num_computed_tokens,
                new_req.other_group_block_ids,
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            if cached.resumed_from_preemption:
                input_batch.set_block_ids(cached.req_id, cached.new_block_ids, cached.other_group_block_ids)
            else:
                input_batch.append_block_ids(cached.req_id, cached.new_block_ids, cached.other_group_block_ids)
            input_batch.set_num_computed_tokens(cached.req_id, self.draft_placeholders.num_computed_tokens(cached))

    # --------------------------------------------------------------- execute

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        if self.drafter is not None:  # for the speculation policy's cost samples only
            self._captures_at_start = self._num_graph_captures()
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={}, kv_connector_output=self._kv_connector_output(
                scheduler_output))
        states = [self.requests[req_id] for req_id in scheduler_output.num_scheduled_tokens]
        output = ModelRunnerOutput(sampled_token_ids={state.req_id: [] for state in states})
        num_scheduled, spec_tokens = self.draft_placeholders.fill(scheduler_output, output)
        drafts = [spec_tokens.get(state.req_id, []) for state in states]
        batch, input_ids = self._prepare_inputs(num_scheduled, states, drafts)
        hidden_states = self._forward_with_kv_transfer(input_ids, batch, scheduler_output.kv_connector_metadata)
        self._compute_prompt_logprobs(states, batch, hidden_states, output)
        sampling = self._sampling_batch(scheduler_output, states, drafts, batch)
        if sampling.requests:
            raw_logits = self.model.compute_logits(hidden_states[sampling.logits_indices])
            sampled = (
                self._sample(raw_logits, sampling)
                if sampling.drafts is None
                else verify_drafts(self.sampler, raw_logits.float(), sampling)
            )
            self._record_sampled(sampling, sampled, output)
        if self.drafter is not None:
            verify_s = time.perf_counter() - start
            # NOTE: called even when nothing sampled: a model drafter mirrors
            # every prefill chunk into its own KV cache.
            target_step = self._target_step(states, drafts, batch, input_ids, hidden_states, sampling, output)
            target_step.aux_hidden_states = self._aux_hidden_states()
            self._observe_acceptance(sampling, output)
            draft_s, num_drafted = self._propose_drafts(self.drafter, sampling, target_step, output)
            output.spec_step = SpecStepTimes(verify_s, draft_s, len(sampling.requests), num_drafted)
            self._observe_step_cost(sum(num_scheduled.values()), drafts, sampling, output.spec_step, start)
            self.draft_placeholders.record(scheduler_output, output)
        output.kv_connector_output = self._kv_connector_output(scheduler_output)
        self._last_step_end = time.perf_counter()
        output.execute_time_s = self._last_step_end - start
        return output

    def _prepare_inputs(
        self, num_scheduled: dict[str, int], states: list[CachedRequestState], drafts: list[list[int]]
    ) -> tuple[InputBatch, torch.Tensor]:
        """The step's batch and its input ids (each request's next known
        tokens, then the drafts to verify), from the persistent rows."""
        batch, input_ids = self.input_batch.prepare(
            list(num_scheduled), np.fromiter(num_scheduled.values(), dtype=np.int64, count=len(states)), drafts
        )
        if self.lora_batch is not None:
            self.lora_batch.prepare_step([state.req_id for state in states], batch.query_lens)
        return batch, torch.from_numpy(input_ids).to(self.device)

    def _forward_with_kv_transfer(
        self, input_ids: torch.Tensor, batch: InputBatch, connector_metadata: KVConnectorMetadata | None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; the KV connector loads before, saves after."""
        connector = self.kv_connector
        if connector is None or connector_metadata is None:
            return self._forward(input_ids, batch)
        connector.start_load_kv(connector_metadata)
        for layer_index in range(len(self.kv_caches)):
            connector.wait_for_layer_load(layer_index)
        hidden_states = self._forward(input_ids, batch)
        for layer_index, kv_cache in enumerate(self.kv_caches):
            connector.save_kv_layer(layer_index, kv_cache, connector_metadata)
        connector.wait_for_save()
        return hidden_states

    def _kv_connector_output(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        """The connector's worker-side report after this step: what
        `get_finished` says, and its counts (loaded, saved) since the last report."""
        connector = self.kv_connector
        if connector is None:
            return None
        finished_sending, finished_recving = connector.get_finished(set(scheduler_output.finished_req_ids))
        now = connector.stats.copy()
        stats, self._reported_connector_stats = now.minus(self._reported_connector_stats), now
        return KVConnectorOutput(finished_sending, finished_recving, stats)

    def _aux_hidden_states(self) -> torch.Tensor | None:
        """The target's kept layer inputs of this step (EAGLE-3), from the
        graph that replayed it or the eager forward; None for a model
        without them (a plugin API 1.0 model has no such method)."""
        if self.graph_runner is not None and self.graph_runner.replayed_aux is not None:
            return self.graph_runner.replayed_aux
        get = getattr(self.model, "get_aux_hidden_states", None)
        return None if get is None else get()

    def _forward(self, input_ids: torch.Tensor, batch: InputBatch) -> torch.Tensor:
        graphs, lora_batch = self.graph_runner, self.lora_batch
        if graphs is not None:
            if graphs.can_run(batch):
                return graphs.run_model(input_ids, batch, None if lora_batch is None else lora_batch.step_slots)
            graphs.replayed_aux = None  # this step's are the model's own
            if lora_batch is not None:
                lora_batch.activate()  # a capture in can_run pointed the layers at its buffer
        return self.model(input_ids, *batch.to_device(self.attn_backend, self.block_size, self.device))

    def _sampling_batch(
        self,
        scheduler_output: SchedulerOutput,
        states: list[CachedRequestState],
        drafts: list[list[int]],
        batch: InputBatch,
    ) -> SamplingBatch:
        """The requests that sample this step (those that reach the end of
        their known tokens) and the rows they score. With a drafter every
        request scores all 1 + n positions through draft verification, also
        in steps without drafts where a seeded request samples, so that it
        draws its random numbers the same way whatever the batch around it
        drafted (it would not with the plain sampler); a step with neither
        samples plainly (verification of nothing cost ~1 ms a step).
        `drafts`: every scheduled request's, in batch order."""
        rows = [
            row for row, state in enumerate(states) if batch.seq_lens[row] - len(drafts[row]) >= len(state.token_ids)
        ]
        requests = [states[row] for row in rows]
        sampling_drafts = None if self.drafter is None else [drafts[row] for row in rows]
        if sampling_drafts is not None and not any(sampling_drafts) and not any(
                state.sampling_params.sampling_type == SamplingType.RANDOM_SEED for state in requests):
            sampling_drafts = None
        logits_indices: list[int] = []
        for i, row in enumerate(rows):
            end = int(batch.query_start_loc[row + 1])
            logits_indices.extend(range(end - 1 - (len(sampling_drafts[i]) if sampling_drafts else 0), end))
        return SamplingBatch(
            requests=requests,
            batch_rows=rows,
            drafts=sampling_drafts,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=self.device),
            grammar_bitmask=_grammar_rows(scheduler_output, requests, sampling_drafts),
            # NOTE: told only when a row samples; a step without sampling keeps their rows.
            logits_processors=self._logits_processors_for(requests, sampling_drafts) if requests else (),
            default_generator=self.generator,
        )

    def _sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> SampledTokens:
        """One token per sampling request, from its last position."""
        metadata = self._sampling_metadata(sampling.requests, logits.shape[-1])
        metadata.grammar_bitmask = sampling.grammar_bitmask
        metadata.logits_processors = sampling.logits_processors
        sampler_output = self.sampler(logits, metadata)
        token_ids = [[token_id] for token_id in sampler_output.sampled_token_ids.tolist()]
        tensors = sampler_output.logprobs_tensors
        return SampledTokens(token_ids, None if tensors is None else [[e] for e in to_logprob_entries(tensors)])

    def _logits_processors_for(
        self, sampling_states: list[CachedRequestState], drafts: list[list[int]] | None
    ) -> Sequence[LogitsProcessor]:
        """The processors, told this step's logits rows (one per request, or
        one per draft position and the bonus position)."""
        rows = self.logits_processor_rows
        rows.update(sampling_states, drafts)
        return rows.processors

    def _sampling_metadata(self, sampling_states: list[CachedRequestState], vocab_size: int) -> SamplingMetadata:
        """The sampling tensors of these rows: built when the sampling requests
        change, reused while the same requests sample in the same order (a
        decode batch in steady state) unless they depend on the requests'
        outputs (penalties, a min_tokens still ahead, bad words)."""
        cached = self._cached_sampling
        if cached is not None and len(cached[0]) == len(sampling_states) and all(
            state is cached_state for state, cached_state in zip(sampling_states, cached[0], strict=True)
        ):
            return cached[1]
        metadata = SamplingMetadata.build(
            params=[s.sampling_params for s in sampling_states],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in sampling_states],
            output_token_ids=[s.output_token_ids for s in sampling_states],
            generators={i: s.generator for i, s in enumerate(sampling_states) if s.generator is not None},
            vocab_size=vocab_size,
            device=self.device,
            eos_token_ids=[s.eos_token_id for s in sampling_states],
            default_generator=self.generator,
        )
        controls = metadata.token_controls
        reusable = metadata.no_penalties and metadata.min_tokens_mask is None and not (
            controls is not None and controls.depends_on_output
        )
        self._cached_sampling = (sampling_states, metadata) if reusable else None
        return metadata

    def _record_sampled(self, sampling: SamplingBatch, sampled: SampledTokens, output: ModelRunnerOutput) -> None:
        input_batch = self.input_batch
        for i, (state, token_ids) in enumerate(zip(sampling.requests, sampled.token_ids, strict=True)):
            input_batch.append_token_ids(state.req_id, token_ids)
            state.token_ids.extend(token_ids)
            state.output_token_ids.extend(token_ids)
            output.sampled_token_ids[state.req_id] = token_ids
            num_logprobs = state.sampling_params.num_logprobs
            if sampled.logprobs is not None and num_logprobs is not None:
                output.logprobs[state.req_id] = [_trim(entry, num_logprobs) for entry in sampled.logprobs[i]]

    # ---------------------------------------------------------------- drafts

    @staticmethod
    def _target_step(
        states: list[CachedRequestState],
        drafts: list[list[int]],
        batch: InputBatch,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        sampling: SamplingBatch,
        output: ModelRunnerOutput,
    ) -> TargetStep:
        """What a model drafter mirrors: this step's rows minus the rejected drafts."""
        num_rejected = np.zeros(len(states), dtype=np.int64)
        for row in sampling.batch_rows:
            num_rejected[row] = len(drafts[row]) + 1 - len(output.sampled_token_ids[states[row].req_id])
        # Position after each request's last kept row: its next token is known.
        next_positions = batch.seq_lens - num_rejected
        return TargetStep(
            req_ids=[state.req_id for state in states],
            input_ids=input_ids,
            positions=batch.positions,
            query_start_loc=batch.query_start_loc,
            block_table=batch.block_table,
            hidden_states=hidden_states,
            num_rejected=num_rejected,
            next_token_ids=np.array(
                [state.token_ids[int(p)] for state, p in zip(states, next_positions, strict=True)], dtype=np.int64
            ),
        )

    def _propose_drafts(
        self, drafter: Drafter, sampling: SamplingBatch, target_step: TargetStep, output: ModelRunnerOutput
    ) -> tuple[float, int]:
        """Ask the drafter and keep, per request, as many drafts as the policy
        allows: (seconds in `propose`, requests given drafts). A drafter
        without its own KV (`needs_lookahead_slots` False) is asked only for
        the requests given drafts; a model drafter mirrors every request."""
        requests = sampling.requests
        counts = self._policy_counts(requests)
        chosen = [i for i, n in enumerate(counts) if n > 0 or drafter.needs_lookahead_slots]
        for state in requests:
            state.draft_probs = None
        if not chosen and not drafter.needs_lookahead_slots:
            self._observe_drafted(requests, counts)
            return 0.0, 0  # NOTE: a model drafter mirrors prefill chunks even when nothing sampled
        start = time.perf_counter()
        draft_output = drafter.propose(
            DraftInputs(
                req_ids=[requests[i].req_id for i in chosen],
                token_ids=[requests[i].token_ids for i in chosen],
                sampling_params=[requests[i].sampling_params for i in chosen],
                batch_rows=[sampling.batch_rows[i] for i in chosen],
                target_step=target_step,
                num_drafts=[counts[i] for i in chosen],
            )
        )
        draft_s = time.perf_counter() - start
        found = [0] * len(requests)
        for i, draft_token_ids in zip(chosen, draft_output.draft_token_ids, strict=False):
            found[i] = min(len(draft_token_ids), counts[i])
        # NOTE: a seeded random request keeps its drafts (see _policy_counts).
        if self.spec_policy is not None and not any(
            state.sampling_params.sampling_type == SamplingType.RANDOM_SEED for state in requests
        ) and not self.spec_policy.keep_drafts([state.req_id for state in requests], found, self.spec_measurements):
            self._observe_drafted(requests, [0] * len(requests))
            return draft_s, 0  # a plain step after all
        self._observe_drafted(requests, found)
        all_probs = draft_output.draft_probs
        for j, (i, draft_token_ids) in enumerate(zip(chosen, draft_output.draft_token_ids, strict=False)):
            state = requests[i]
            probs = all_probs[j] if all_probs is not None else None
            state.draft_probs = None if probs is None else probs[: found[i]]
            if found[i]:
                output.spec_token_ids[state.req_id] = list(draft_token_ids[: found[i]])
        return draft_s, sum(1 for n in counts if n > 0)

    def _policy_counts(self, requests: list[CachedRequestState]) -> list[int]:
        """Drafts each request may have for its next step: the policy's
        choice, except that a seeded random request always gets k: which
        tokens it samples depends on where drafts were verified, so its
        draft count must not depend on timings or on the batch around it."""
        policy = self.spec_policy
        k = self.drafter.num_speculative_tokens if self.drafter is not None else 0
        if policy is None:
            return [k] * len(requests)
        req_ids = [state.req_id for state in requests]
        counts = [max(0, min(k, int(n))) for n in policy.num_drafts(req_ids, self.spec_measurements)]
        for i, state in enumerate(requests):
            if state.sampling_params.sampling_type == SamplingType.RANDOM_SEED:
                counts[i] = k
        return counts

    def _observe_drafted(self, requests: list[CachedRequestState], num_drafts: list[int]) -> None:
        """The drafts each request's next step verifies (0: the policy gave
        none, the drafter found none, or the policy dropped them)."""
        if self.spec_policy is not None:
            for state, count in zip(requests, num_drafts, strict=True):
                self.spec_measurements.observe_drafted(state.req_id, count)

    def _observe_acceptance(self, sampling: SamplingBatch, output: ModelRunnerOutput) -> None:
        """Each verified request's drafts proposed and accepted, for the policy."""
        if not sampling.drafts:
            return
        for state, drafts in zip(sampling.requests, sampling.drafts, strict=True):
            if drafts:
                num_accepted = len(output.sampled_token_ids[state.req_id]) - 1
                self.spec_measurements.observe_acceptance(state.req_id, len(drafts), num_accepted)

    def _num_graph_captures(self) -> int:
        """Graphs the target and the drafter captured so far (lazily, on a shape's first step)."""
        graphs = [self.graph_runner, getattr(self.drafter, "draft_graphs", None)]
        return sum(graph.num_captures for graph in graphs if graph is not None)

    def _observe_step_cost(
        self,
        num_scheduled_tokens: int,
        drafts: list[list[int]],
        sampling: SamplingBatch,
        times: SpecStepTimes,
        start: float,
    ) -> None:
        """Record a pure decode step's cost (every request scored 1 + its
        drafts and sampled): plain or verify, the runner's time for it, and
        the time outside the runner before it. A verify step's includes the
        propose after it (in steady state, what drafting costs a step); a
        plain step's only when the drafter runs every step whatever the
        policy says (a model drafter mirrors the target into its KV cache):
        what it measures is a step without speculation, and a model-free
        drafter's propose there may be it catching up on every step it
        skipped (suffix trees at batch 32: ~26 ms once), which read as a
        plain step 6x too dear made drafting look cheap."""
        num_drafts = sum(len(d) for d in drafts)
        if len(sampling.requests) != len(drafts) or (
            num_scheduled_tokens != len(drafts) + num_drafts
        ):
            return
        if self._num_graph_captures() != self._captures_at_start:
            return  # this step captured a graph (its shape's first): not what such a step costs
        rest_s = None if self._last_step_end is None else start - self._last_step_end
        verified = num_drafts > 0
        always_runs = self.drafter is not None and self.drafter.needs_lookahead_slots
        self.spec_measurements.observe_step(
            len(drafts), verified=verified,
            step_s=times.verify_s + (times.draft_s if verified or always_runs else 0.0), rest_s=rest_s,
        )

    # ------------------------------------------------------- prompt logprobs

    def _compute_prompt_logprobs(
        self,
        states: list[CachedRequestState],
        batch: InputBatch,
        hidden_states: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        num_computed = batch.num_computed_tokens
        for row, state in enumerate(states):
            num_logprobs = state.sampling_params.prompt_logprobs
            start = int(num_computed[row])
            if num_logprobs is None or start >= state.num_prompt_tokens:
                continue
            # Position p's logits score prompt token p + 1; the last prompt
            # position's logits are for sampling, not for the prompt.
            end = min(int(batch.seq_lens[row]), state.num_prompt_tokens - 1)
            entries: list[LogprobEntry | None] = [None] if start == 0 else []
            if end > start:
                first_row = int(batch.query_start_loc[row])
                logits = self.model.compute_logits(hidden_states[first_row : first_row + end - start])
                targets = torch.tensor(state.token_ids[start + 1 : end + 1], device=logits.device)
                entries.extend(to_logprob_entries(compute_prompt_logprobs(logits, targets, num_logprobs)))
            output.prompt_logprobs[state.req_id] = entries


def _grammar_rows(
    scheduler_output: SchedulerOutput, sampling_states: list[CachedRequestState], drafts: list[list[int]] | None
) -> tuple[torch.Tensor, list[int]] | None:
    """The bitmask rows of this step's sampled positions and the logits rows
    they mask. A request owns 1 + len(drafts) bitmask rows; without
    `drafts` (each sampling request's, None without a drafter) the logits
    hold one row per request (its first position), with them 1 + len(drafts)
    rows per request, in batch order."""
    bitmask = scheduler_output.grammar_bitmask
    if bitmask is None:
        return None
    # NOTE: a grammar request's drafts are never placeholders (it is not
    # scheduled ahead of its output), so the scheduler's are the verified ones.
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    all_positions = drafts is not None
    logits_row: dict[str, int] = {}
    next_logits_row = 0
    for i, state in enumerate(sampling_states):
        logits_row[state.req_id] = next_logits_row
        next_logits_row += 1 + len(drafts[i]) if drafts is not None else 1
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


def _trim(entry: LogprobEntry, num_logprobs: int) -> LogprobEntry:
    """Keep the chosen token plus this request's top-n (the batch computed the max)."""
    return LogprobEntry(entry.token_ids[: num_logprobs + 1], entry.logprobs[: num_logprobs + 1], entry.rank)
