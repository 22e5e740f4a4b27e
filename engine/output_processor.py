"""Turns the engine core's per-step EngineCoreOutputs into RequestOutputs:
incremental detokenization, stop strings, logprobs, n > 1 fan-in, metrics.

Driving it (what LLM does):

    request = input_processor.process(request_id, prompt, params)   # n > 1 fans out
    processor.add_request(request)
    client.add_requests(request.engine_requests())
    while processor.has_unfinished_requests():
        processed = processor.process_outputs(client.get_output())
        engine_core.abort_requests(processed.reqs_to_abort)   # stopped by a stop string
        yield from processed.request_outputs
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.outputs import (
    CompletionOutput,
    Logprob,
    LogprobPairs,
    PackedLogprobs,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from pagedllm.engine.sealed_list import SealedList
from pagedllm.engine.stop_strings import check_stop_strings, stop_buffer_length

if TYPE_CHECKING:
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.core.scheduler_output import LogprobEntry
    from pagedllm.core.stats import IterationStats
    from pagedllm.engine.input_processor import ProcessedRequest
    from pagedllm.engine.outputs import SampleLogprobs


class ProcessedOutputs(NamedTuple):
    request_outputs: list[RequestOutput]
    # Engine request ids finished here (stop string) that the core must abort.
    reqs_to_abort: list[str]


def normalize_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return [s for s in stop if s]


@dataclass
class RequestState:
    """Output-side state of one engine request (one sample)."""

    request_id: str  # the engine core's id (a child id when n > 1)
    external_request_id: str  # the id the user gave
    index: int  # sample index within its parent
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer | None
    stop: list[str]
    include_stop_str_in_output: bool
    min_tokens: int
    metrics: RequestMetrics
    parent: ParentRequest | None = None
    max_tokens: int | None = None  # the request's max_tokens, for metrics
    output_text: str = ""
    # NOTE: SealedLists, not lists: the collector need not scan them (sealed_list.py).
    output_token_ids: SealedList[int] = field(default_factory=SealedList)
    logprobs: SealedList[LogprobPairs] | None = None
    cumulative_logprob: float | None = None
    # logprob_token_ids: the entries after the sampled token are those ids, not a top-k.
    explicit_logprob_ids: bool = False
    prompt_logprobs: SealedList[LogprobPairs | None] | None = None
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # How much was already sent (DELTA outputs).
    sent_text_len: int = 0
    sent_num_tokens: int = 0
    sent_num_prompt_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_text(self, delta: bool) -> str:
        # NOTE: while running, the last (max stop length - 1) chars may be the
        # start of a stop string; they are never sent before it is decided.
        if self.finished:
            length = len(self.output_text)
        else:
            length = max(0, len(self.output_text) - stop_buffer_length(self.stop, self.include_stop_str_in_output))
        if not delta:
            return self.output_text[:length]
        start = self.sent_text_len
        if length <= start:
            return ""
        self.sent_text_len = length
        return self.output_text[start:length]

    def make_completion(self) -> CompletionOutput | None:
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.next_text(delta)
        start = self.sent_num_tokens if delta else 0
        self.sent_num_tokens = len(self.output_token_ids)
        # Sample positions are never None: the packed sequence holds dicts only.
        logprobs = None if self.logprobs is None else cast("SampleLogprobs", PackedLogprobs(self.logprobs.since(start)))
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.output_token_ids.since(start),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            stop_reason=self.stop_reason,
        )

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        if self.prompt_logprobs is None:
            return None
        start = self.sent_num_prompt_logprobs if self.output_kind == RequestOutputKind.DELTA else 0
        self.sent_num_prompt_logprobs = len(self.prompt_logprobs)
        return PackedLogprobs(self.prompt_logprobs.since(start))


class ParentRequest:
    """A request with `n > 1`: fans its samples' outputs (engine requests
    "{i}_{id}", see engine/input_processor.py) back into one RequestOutput."""

    def __init__(self, request_id: str, params: SamplingParams, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.params = params
        self.n: int = params.n
        self.output_kind = output_kind
        self.child_states: list[RequestState] = []
        self.completions: list[CompletionOutput | None] = [None] * self.n
        self.num_finished = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n

    def add_completion(self, completion: CompletionOutput, finished: bool) -> list[CompletionOutput] | None:
        """Completions to emit now, or None while FINAL_ONLY waits for siblings."""
        if finished:
            self.num_finished += 1
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            return [completion]
        self.completions[completion.index] = completion
        if not self.finished:
            return None
        return [c for c in self.completions if c is not None]

    def metrics(self) -> RequestMetrics:
        children = [state.metrics for state in self.child_states]

        def first(values: list[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            return min(present) if present else None

        def last(values: list[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            return max(present) if present else None

        return RequestMetrics(
            arrival_time=children[0].arrival_time,
            first_scheduled_time=first([m.first_scheduled_time for m in children]),
            first_token_time=first([m.first_token_time for m in children]),
            last_token_time=last([m.last_token_time for m in children]),
            finished_time=last([m.finished_time for m in children]) if self.finished else None,
            spec_num_drafts=sum(m.spec_num_drafts for m in children),
            spec_num_draft_tokens=sum(m.spec_num_draft_tokens for m in children),
            spec_num_accepted_tokens=sum(m.spec_num_accepted_tokens for m in children),
        )


class OutputProcessor:
    """Output side of the engine (runs in the front-end process in vLLM)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._decoded_token_cache: dict[int, str] = {}

    # ------------------------------------------------------------ requests

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def owner_of(self, engine_request_id: str) -> str | None:
        """The request (its id as the caller gave it) an engine request is a
        sample of; None if it is not tracked."""
        state = self.request_states.get(engine_request_id)
        return None if state is None else state.external_request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(self, request: ProcessedRequest, output_kind: RequestOutputKind | None = None) -> None:
        """Track a request and its samples (the input processor fanned n > 1 out)."""
        sample_ids = [sample_id for sample_id, _ in request.samples]
        for request_id in {request.request_id, *sample_ids}:
            if request_id in self.request_states or request_id in self.parent_requests:
                raise InvalidRequestError("request_id", request_id, "a request with this id is already running")
        if output_kind is None:
            output_kind = RequestOutputKind(getattr(request.params, "output_kind", RequestOutputKind.FINAL_ONLY))
        parent = ParentRequest(request.request_id, request.params, output_kind) if request.params.n > 1 else None
        for index, (sample_id, sample_params) in enumerate(request.samples):
            state = self._add_state(request, index, sample_id, sample_params, output_kind)
            if parent is not None:
                state.parent = parent
                parent.child_states.append(state)
        if parent is not None:
            self.parent_requests[request.request_id] = parent

    def _add_state(
        self,
        request: ProcessedRequest,
        index: int,
        request_id: str,
        params: SamplingParams,
        output_kind: RequestOutputKind,
    ) -> RequestState:
        prompt_token_ids = request.prompt_token_ids
        detokenizer = None
        if getattr(params, "detokenize", True) and self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=getattr(params, "skip_special_tokens", True),
                spaces_between_special_tokens=getattr(params, "spaces_between_special_tokens", True),
            )
        want_logprobs = getattr(params, "num_logprobs", None) is not None
        state = RequestState(
            request_id=request_id,
            external_request_id=request.request_id,
            index=index,
            prompt=request.prompt,
            prompt_token_ids=list(prompt_token_ids),
            output_kind=output_kind,
            detokenizer=detokenizer,
            # Stop strings need text; without detokenization they cannot match.
            stop=normalize_stop(getattr(params, "stop", None)) if detokenizer else [],
            include_stop_str_in_output=getattr(params, "include_stop_str_in_output", False),
            min_tokens=getattr(params, "min_tokens", 0) or 0,
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            logprobs=SealedList() if want_logprobs else None,
            cumulative_logprob=0.0 if want_logprobs else None,
            explicit_logprob_ids=getattr(params, "logprob_token_ids", None) is not None,
            prompt_logprobs=SealedList() if getattr(params, "prompt_logprobs", None) is not None else None,
            max_tokens=getattr(params, "max_tokens", None),
        )
        self.request_states[request_id] = state
        return state

    def abort_requests(
        self, request_ids: list[str], iteration_stats: IterationStats | None = None, now: float | None = None
    ) -> list[str]:
        """Forget requests by user id (all samples of an n > 1 request) or
        engine id; return the engine request ids the core must abort.

        With `iteration_stats`, every sample still unfinished is accounted
        there as finished by "abort", once: aborts happen on this side (a
        client leaving, shutdown), so the core never reports them."""
        removed: list[RequestState] = []
        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            if parent is None:
                state = self.request_states.get(request_id)
                if state is None:
                    continue
                if state.parent is None:
                    del self.request_states[request_id]
                    removed.append(state)
                    continue
                # Aborting one sample aborts the request it belongs to.
                parent = self.parent_requests.pop(state.parent.request_id, None)
            if parent is not None:
                for child in parent.child_states:
                    if self.request_states.pop(child.request_id, None) is not None:
                        removed.append(child)
        if iteration_stats is not None:
            now = time.time() if now is None else now
            for state in removed:
                state.finish_reason = "abort"
                state.metrics.finished_time = now
                self._record_finished(state, iteration_stats, now)
        return [state.request_id for state in removed]

    # ------------------------------------------------------------- outputs

    def process_outputs(
        self,
        outputs: list[EngineCoreOutput],
        now: float | None = None,
        iteration_stats: IterationStats | None = None,
    ) -> ProcessedOutputs:
        """Apply one engine step's outputs; with `iteration_stats`, also
        account the step's tokens, latencies and finished requests there."""
        now = time.time() if now is None else now
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        for engine_output in outputs:
            state = self.request_states.get(engine_output.request_id)
            if state is None or state.finished:
                continue  # aborted by the user meanwhile
            prev_last_token_time = state.metrics.last_token_time
            if self._update_state(state, engine_output, now):
                reqs_to_abort.append(state.request_id)
            if iteration_stats is not None:
                iteration_stats.update_from_output(
                    len(engine_output.new_token_ids), len(state.prompt_token_ids), state.metrics,
                    prev_last_token_time, now,
                )
            if state.finished:
                state.metrics.finished_time = now
                del self.request_states[state.request_id]
                if iteration_stats is not None:
                    self._record_finished(state, iteration_stats, now)
            if not engine_output.new_token_ids and not state.finished:
                continue  # a prompt-logprobs-only chunk: sent with the next token
            request_output = self._make_request_output(state)
            if request_output is not None:
                request_outputs.append(request_output)
        return ProcessedOutputs(request_outputs, reqs_to_abort)

    @staticmethod
    def _record_finished(state: RequestState, iteration_stats: IterationStats, now: float) -> None:
        assert state.finish_reason is not None
        iteration_stats.update_from_finished_request(
            state.finish_reason, state.metrics, len(state.prompt_token_ids), len(state.output_token_ids),
            state.max_tokens, now,
        )
        parent = state.parent
        if parent is None:
            iteration_stats.n_params.append(1)
        elif all(child.finished for child in parent.child_states):
            # NOTE: one observation per user request, when its last sample ends.
            iteration_stats.n_params.append(parent.n)

    def _update_state(self, state: RequestState, engine_output: EngineCoreOutput, now: float) -> bool:
        """Apply one step; True when a stop string ended a request the engine
        core still runs."""
        metrics = state.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = engine_output.first_scheduled_time
        state.num_cached_tokens = max(0, engine_output.num_cached_tokens)
        if engine_output.spec_counts is not None:
            (metrics.spec_num_drafts, metrics.spec_num_draft_tokens,
             metrics.spec_num_accepted_tokens) = engine_output.spec_counts
        finish_reason = engine_output.finish_reason
        stop_reason = engine_output.stop_reason
        new_token_ids = engine_output.new_token_ids
        match = None if state.detokenizer is None else self._update_text(state, new_token_ids, finish_reason)
        stopped_by_string = False
        if match is not None:
            # A stop string ends the output at the token that completed it,
            # also when more tokens came in the same step (accepted drafts).
            new_token_ids = new_token_ids[: match[0]]
            stopped_by_string = finish_reason is None
            finish_reason, stop_reason = "stop", match[1]
        if new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            state.output_token_ids.extend(new_token_ids)
        if state.logprobs is not None and engine_output.new_logprobs:
            for entry in engine_output.new_logprobs[: len(new_token_ids)]:
                state.logprobs.append(self._to_logprob_pairs(entry, ranked=not state.explicit_logprob_ids))
                state.cumulative_logprob = (state.cumulative_logprob or 0.0) + entry.logprobs[0]
        if state.prompt_logprobs is not None and engine_output.new_prompt_logprobs:
            state.prompt_logprobs.extend(
                None if entry is None else self._to_logprob_pairs(entry) for entry in engine_output.new_prompt_logprobs
            )
        if finish_reason is not None:
            state.finish_reason = finish_reason
            state.stop_reason = stop_reason
        return stopped_by_string

    @staticmethod
    def _update_text(state: RequestState, new_token_ids: list[int], finish_reason: str | None
                     ) -> tuple[int, str] | None:
        """Detokenize a step's new tokens into `state.output_text`; with stop
        strings, token by token, so that a match returns (the new tokens up
        to the one that completed it, the stop string), the text truncated."""
        detokenizer = state.detokenizer
        assert detokenizer is not None
        text_token_ids = new_token_ids
        if finish_reason == "stop" and new_token_ids and not state.include_stop_str_in_output:
            # The EOS / stop token ended it: its text is not part of the output (vLLM).
            text_token_ids = new_token_ids[:-1]
        steps = [[token] for token in text_token_ids] if state.stop and len(text_token_ids) > 1 else [text_token_ids]
        if finish_reason is not None:
            steps.append([])  # the detokenizer's held-back text
        num_tokens = len(state.output_token_ids)
        for step in steps:
            delta = detokenizer.update(step) if step else detokenizer.flush()
            # (the flush's text came with the last token, or the excluded EOS / stop token)
            num_tokens = num_tokens + len(step) if step else len(state.output_token_ids) + len(new_token_ids)
            state.output_text += delta
            if state.stop and delta and num_tokens > state.min_tokens:
                match = check_stop_strings(state.output_text, len(delta), state.stop, state.include_stop_str_in_output)
                if match is not None:
                    state.output_text = state.output_text[: match.truncate_to]
                    return num_tokens - len(state.output_token_ids), match.stop_str
        return None

    def _make_request_output(self, state: RequestState) -> RequestOutput | None:
        completion = state.make_completion()
        if completion is None:
            return None
        parent = state.parent
        if parent is None:
            return RequestOutput(
                request_id=state.external_request_id,
                prompt=state.prompt,
                prompt_token_ids=state.prompt_token_ids,
                prompt_logprobs=state.take_prompt_logprobs(),
                outputs=[completion],
                finished=state.finished,
                num_cached_tokens=state.num_cached_tokens,
                metrics=copy.copy(state.metrics),
            )
        completions = parent.add_completion(completion, state.finished)
        if completions is None:
            return None
        if parent.finished:
            self.parent_requests.pop(parent.request_id, None)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.take_prompt_logprobs(),
            outputs=completions,
            finished=parent.finished,
            # The prompt as the samples saw it: the smallest hit among them.
            num_cached_tokens=min(child.num_cached_tokens for child in parent.child_states),
            metrics=parent.metrics(),
        )

    def _to_logprob_pairs(self, entry: LogprobEntry, ranked: bool = True) -> LogprobPairs:
        # Index 0 is the chosen token with its own rank; then top-k ranked 1..k
        # (or, not `ranked`, the request's logprob_token_ids, whose ranks are not computed).
        logprobs: dict[int, Logprob] = {}
        for position, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs, strict=True)):
            if position > 0 and token_id in logprobs:
                continue  # the chosen token is also in the top-k
            rank = entry.rank if position == 0 else (position if ranked else None)
            logprobs[token_id] = Logprob(logprob=logprob, rank=rank, decoded_token=self._decode_token(token_id))
        return tuple(logprobs.items())

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._decoded_token_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._decoded_token_cache[token_id] = text
        return text
