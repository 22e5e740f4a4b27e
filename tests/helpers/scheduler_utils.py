"""Drive the Scheduler with a real KVCacheManager and a fake model runner.

`FakeRunner` plays the model runner's part of the protocol: it keeps its own
copy of every request's tokens, block table and `num_computed_tokens`, built
only from what the SchedulerOutputs tell it, and checks on every step that this
copy agrees with the scheduler's state. It samples one token for each request
whose scheduled tokens reach the end of its known tokens (none for a partial
prefill chunk): by default `1000 + index of the output`, or the next token of a
per-request script.

`run_async` drives the same pieces the way async scheduling does: step k+1 is
scheduled before step k's outputs are processed, and runs after them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

EOS = 2
DEFAULT_TOKEN_BASE = 1000


def prompt(start: int, num_tokens: int) -> list[int]:
    """Distinct token ids per test request, so prompts never share a prefix by accident."""
    return list(range(start, start + num_tokens))


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    arrival_time: float | None = None,
    priority: int = 0,
    eos_token_id: int | None = EOS,
    group_id: str | None = None,
    **params: object,
) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(
        request_id,
        prompt_token_ids,
        SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
        group_id=group_id,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    enable_caching: bool = True,
    **scheduler_kwargs: object,
) -> Scheduler:
    config = SchedulerConfig(**scheduler_kwargs)  # type: ignore[arg-type]
    manager = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, debug_checks=True)
    return Scheduler(config, manager, max_model_len)


@dataclass
class RunnerRequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class StepResult:
    scheduler_output: SchedulerOutput
    runner_output: ModelRunnerOutput
    outputs: dict[str, EngineCoreOutput]

    @property
    def scheduled(self) -> dict[str, int]:
        return self.scheduler_output.num_scheduled_tokens


@dataclass
class FakeRunner:
    scheduler: Scheduler
    scripts: dict[str, list[int]] = field(default_factory=dict)
    states: dict[str, RunnerRequestState] = field(default_factory=dict)
    # The step's measured seconds as a platform would report them
    # (ModelRunnerOutput.execute_time_s); None: 0.0, which the step cost model ignores.
    step_seconds: Callable[[SchedulerOutput], float] | None = None

    def next_token(self, request_id: str, num_output_tokens: int) -> int:
        script = self.scripts.get(request_id)
        if script is not None:
            return script[num_output_tokens]
        return DEFAULT_TOKEN_BASE + num_output_tokens

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        manager = self.scheduler.kv_cache_manager
        for request_id in scheduler_output.finished_req_ids:
            self.states.pop(request_id, None)
        for request_id in scheduler_output.preempted_req_ids:
            # Tokens are kept for the resume; the blocks are gone.
            self.states[request_id].block_ids = []

        new_ids = [data.req_id for data in scheduler_output.scheduled_new_reqs]
        cached_ids = [data.req_id for data in scheduler_output.scheduled_cached_reqs]
        assert sorted(new_ids + cached_ids) == sorted(scheduler_output.num_scheduled_tokens), (
            "every scheduled request is described exactly once"
        )
        for new_data in scheduler_output.scheduled_new_reqs:
            assert new_data.req_id not in self.states
            self.states[new_data.req_id] = RunnerRequestState(
                list(new_data.prompt_token_ids), list(new_data.block_ids), new_data.num_computed_tokens
            )
        for cached_data in scheduler_output.scheduled_cached_reqs:
            state = self.states[cached_data.req_id]
            if cached_data.resumed_from_preemption:
                state.block_ids = list(cached_data.new_block_ids)
                state.num_computed_tokens = cached_data.num_computed_tokens
            else:
                state.block_ids.extend(cached_data.new_block_ids)
                assert cached_data.num_computed_tokens == state.num_computed_tokens

        sampled: dict[str, list[int]] = {}
        for request_id, num_new_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.states[request_id]
            request = self.scheduler.requests.get(request_id)
            if request is None:  # async scheduling: it finished after this step was scheduled
                continue
            assert num_new_tokens > 0
            assert state.token_ids == request.all_token_ids, f"{request_id}: runner tokens diverged"
            assert state.block_ids == manager.get_block_ids(request_id), f"{request_id}: block table diverged"
            state.num_computed_tokens += num_new_tokens
            assert state.num_computed_tokens == request.num_computed_tokens
            assert state.num_computed_tokens <= len(state.token_ids)
            assert state.num_computed_tokens <= self.scheduler.max_model_len
            assert len(state.block_ids) * manager.block_size >= state.num_computed_tokens
            if state.num_computed_tokens == len(state.token_ids):
                token_id = self.next_token(request_id, len(state.token_ids) - request.num_prompt_tokens)
                sampled[request_id] = [token_id]
                state.token_ids.append(token_id)
        seconds = 0.0 if self.step_seconds is None else self.step_seconds(scheduler_output)
        return ModelRunnerOutput(sampled_token_ids=sampled, execute_time_s=seconds)

    def step(self) -> StepResult:
        """schedule -> (runner) -> update_from_output, block invariant checked in between."""
        scheduler_output = self.scheduler.schedule()
        self.check_invariants()
        runner_output = self.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.check_invariants()
        return StepResult(scheduler_output, runner_output, {output.request_id: output for output in outputs})

    def check_invariants(self) -> None:
        self.scheduler.kv_cache_manager.check_invariants(self.scheduler.running)

    def run_async(self, max_steps: int = 1000) -> list[StepResult]:
        """Async scheduling's order, serialized: schedule(k + 1), then
        update_from_output(k), then step k + 1 runs. Returns each processed
        step, in order, until nothing is left."""
        results: list[StepResult] = []
        pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and pending is None:
                return results
            scheduler_output = self.scheduler.schedule() if self.scheduler.has_unfinished_requests() else None
            if pending is not None:
                outputs = self.scheduler.update_from_output(*pending)
                results.append(StepResult(*pending, {output.request_id: output for output in outputs}))
                pending = None
            if scheduler_output is not None:
                self.check_invariants()
                pending = scheduler_output, self.execute(scheduler_output)
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
