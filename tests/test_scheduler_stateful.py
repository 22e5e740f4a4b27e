"""Random programs against the Scheduler and its KV cache manager (Hypothesis
state machine), with the FakeRunner of tests/helpers/scheduler_utils.py.

Each program builds a tight engine (4-12 blocks of 2-4 tokens, 2-4 sequences,
a 4-16 token budget, FCFS or priority, chunked prefill on or off) and runs up
to 50 of: add a burst of requests (salted or not, prompts sharing a few
prefixes, 1-12 max_tokens, a scripted output that may hit EOS), add an urgent
request (priority policy), abort a live request, run 1-8 steps (schedule ->
FakeRunner -> update_from_output), reset the prefix cache (sometimes after a
drain). Preemption and chunked prefill come from the tight limits.

After every step the outside record of `KVReference` (tests/helpers) is
updated from the SchedulerOutput alone and checked against the manager; the
queues must agree with the request statuses; finished requests hold no blocks.
Every program ends by draining: every request finishes with exactly the output
its script gives, and every block is free again.

Rerun longer with PAGEDLLM_STATEFUL_SCALE=20 (multiplies the programs); a
failure prints a @reproduce_failure line to put on SchedulerMachine.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import NamedTuple

import pytest
from helpers.kv_reference import KVReference
from helpers.scheduler_utils import EOS, FakeRunner, make_scheduler
from helpers.stateful_budget import PREFIXES, SALTS, TAIL_TOKENS, stateful_settings
from hypothesis import Phase
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput

MAX_TOKENS = 12
# A drain that needs more steps than this is a livelock.
MAX_DRAIN_STEPS = 2000

prompts = st.builds(
    lambda prefix, tail: [*prefix, *tail],
    st.sampled_from(PREFIXES),
    st.lists(st.sampled_from(TAIL_TOKENS), max_size=10),
).filter(bool)
# Outputs repeat the tail alphabet (so outputs extend shared prefixes too) and
# sometimes stop at EOS.
scripts = st.lists(st.sampled_from((*TAIL_TOKENS * 3, EOS)), min_size=MAX_TOKENS, max_size=MAX_TOKENS)


class RequestSpec(NamedTuple):
    prompt: list[int]
    salt: str | None
    max_tokens: int
    priority: int  # used by the priority policy only
    script: list[int]  # the FakeRunner's outputs


request_specs = st.builds(
    RequestSpec,
    prompts,
    st.sampled_from(SALTS),
    st.integers(1, MAX_TOKENS),
    st.integers(0, 2),
    scripts,
)

SEEN: Counter[str] = Counter()
MUST_SEE = (
    "preempted",
    "resumed",
    "chunked prefill",
    "prefix hit",
    "salted hit",
    "abort running",
    "abort waiting",
    "stopped by EOS",
    "length capped",
    "reset with cached blocks",
    "reset refused",
    "drained at teardown",
)


def expected_output(request: Request, script: list[int], max_model_len: int) -> tuple[list[int], str]:
    """The output the script gives, and why it ends (length wins over EOS, as
    in Scheduler._check_stop)."""
    max_tokens = request.sampling_params.max_tokens
    assert max_tokens is not None
    output: list[int] = []
    for token_id in script:
        output.append(token_id)
        if request.num_prompt_tokens + len(output) >= max_model_len or len(output) >= max_tokens:
            return output, "length"
        if token_id == EOS:
            return output, "stop"
    raise AssertionError("scripts cover max_tokens")


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler: Scheduler | None = None
        self.added: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.clock = 0.0

    @initialize(
        num_blocks=st.integers(4, 12),
        block_size=st.integers(2, 4),
        max_num_seqs=st.integers(2, 4),
        max_num_batched_tokens=st.integers(4, 16),
        long_prefill_token_threshold=st.sampled_from((0, 0, 3)),
        policy=st.sampled_from(("fcfs", "priority")),
        chunked=st.sampled_from((True, True, False)),
        first_requests=st.lists(request_specs, max_size=6),
    )
    def make_engine(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int,
        policy: str,
        chunked: bool,
        first_requests: list[RequestSpec],
    ) -> None:
        self.max_model_len = num_blocks * block_size  # one request can always fit alone
        if not chunked:
            max_num_batched_tokens = max(max_num_batched_tokens, self.max_model_len)
        self.scheduler = make_scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            scheduling_policy=policy,
            enable_chunked_prefill=chunked,
        )
        self.runner = FakeRunner(self.scheduler)
        self.reference = KVReference(self.scheduler.kv_cache_manager)
        for spec in first_requests:
            self._add(spec)

    # ------------------------------------------------------------- helpers

    def _step(self) -> None:
        assert self.scheduler is not None
        scheduler_output = self.scheduler.schedule()
        self._observe(scheduler_output)
        self.reference.check()
        runner_output = self.runner.execute(scheduler_output)
        for output in self.scheduler.update_from_output(scheduler_output, runner_output):
            if output.finish_reason == "stop":
                SEEN["stopped by EOS"] += 1
            elif output.finish_reason == "length":
                SEEN["length capped"] += 1
        self._forget_freed()

    def _observe(self, scheduler_output: SchedulerOutput) -> None:
        """Update the outside record from what the runner is told, nothing else."""
        assert self.scheduler is not None
        scheduler = self.scheduler
        block_size = scheduler.kv_cache_manager.block_size
        total = scheduler_output.total_num_scheduled_tokens
        assert total <= scheduler.max_num_batched_tokens, f"{total} tokens over the budget"
        assert sum(scheduler_output.num_scheduled_tokens.values()) == total
        assert len(scheduler.running) <= scheduler.max_num_seqs, f"{len(scheduler.running)} running sequences"
        for request_id in scheduler_output.preempted_req_ids:
            SEEN["preempted"] += 1
            assert request_id not in scheduler_output.num_scheduled_tokens
            self.reference.on_freed(request_id)
        allocations = []
        for cached in scheduler_output.scheduled_cached_reqs:
            request = scheduler.requests[cached.req_id]
            num_hit_blocks = 0
            if cached.resumed_from_preemption:
                SEEN["resumed"] += 1
                num_hit_blocks = self._hit_blocks(request, cached.num_computed_tokens, block_size)
            block_ids = list(cached.new_block_ids)
            allocations.append((request, block_ids[:num_hit_blocks], block_ids[num_hit_blocks:]))
        for new in scheduler_output.scheduled_new_reqs:
            request = scheduler.requests[new.req_id]
            num_hit_blocks = self._hit_blocks(request, new.num_computed_tokens, block_size)
            allocations.append((request, list(new.block_ids[:num_hit_blocks]), list(new.block_ids[num_hit_blocks:])))
        self.reference.on_step_allocated(allocations)
        for request_id, num_new_tokens in scheduler_output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            end = request.num_computed_tokens
            self.reference.on_computed(request, end - num_new_tokens, end)
            if end < request.num_tokens:
                SEEN["chunked prefill"] += 1

    def _hit_blocks(self, request: Request, num_computed_tokens: int, block_size: int) -> int:
        assert num_computed_tokens % block_size == 0, "a prefix hit covers whole blocks"
        assert num_computed_tokens <= request.num_tokens - 1, "a hit must leave the last position to compute"
        if num_computed_tokens:
            SEEN["prefix hit"] += 1
            SEEN["salted hit"] += request.cache_salt is not None
        return num_computed_tokens // block_size

    def _forget_freed(self) -> None:
        assert self.scheduler is not None
        running_ids = {request.request_id for request in self.scheduler.running}
        for request_id in list(self.reference.tables):
            if request_id not in running_ids:
                self.reference.on_freed(request_id)

    def _add(self, spec: RequestSpec) -> None:
        assert self.scheduler is not None
        request_id = f"r{len(self.added)}"
        self.clock += 1.0
        request = Request(
            request_id,
            spec.prompt[: self.max_model_len - 1],  # the engine refuses longer prompts
            SamplingParams(temperature=0.0, max_tokens=spec.max_tokens),
            EOS,
            arrival_time=self.clock,
            priority=spec.priority,
            cache_salt=spec.salt,
        )
        self.added[request_id] = request
        self.runner.scripts[request_id] = spec.script
        self.scheduler.add_request(request)

    def _drain(self) -> None:
        assert self.scheduler is not None
        scheduler = self.scheduler
        for _ in range(MAX_DRAIN_STEPS):
            if not scheduler.has_unfinished_requests():
                break
            self._step()
            self.check_scheduler_state()
        else:
            raise AssertionError(
                f"not drained after {MAX_DRAIN_STEPS} steps: {scheduler.running} {list(scheduler.waiting)}"
            )
        manager = scheduler.kv_cache_manager
        assert manager.num_free_blocks == manager.num_blocks and manager.usage == 0.0
        assert manager.req_to_blocks == {}
        for request_id, request in self.added.items():
            if request_id in self.aborted:
                assert request.status == RequestStatus.FINISHED_ABORTED
                continue
            output, reason = expected_output(request, self.runner.scripts[request_id], self.max_model_len)
            assert (request.output_token_ids, request.get_finished_reason()) == (output, reason), (
                f"{request_id} ended with {request.output_token_ids} ({request.get_finished_reason()}), "
                f"its script gives {output} ({reason})"
            )

    # --------------------------------------------------------------- rules

    @precondition(lambda self: self.scheduler is not None)
    @rule(specs=st.lists(request_specs, min_size=1, max_size=4))
    def add_requests(self, specs: list[RequestSpec]) -> None:
        """A burst of arrivals (several clients, or one prompt with n > 1)."""
        for spec in specs:
            self._add(spec)

    @precondition(
        lambda self: self.scheduler is not None and self.scheduler.policy == "priority" and self.scheduler.running
    )
    @rule(spec=request_specs)
    def add_urgent_request(self, spec: RequestSpec) -> None:
        """Under the priority policy, an urgent arrival runs after less urgent
        ones already run, so a preemption can pick a victim it already
        scheduled in the same step (its tokens go back to the budget)."""
        self._add(spec._replace(priority=-1))

    @precondition(lambda self: self.scheduler is not None and self.scheduler.requests)
    @rule(pick=st.integers(0, 63))
    def abort(self, pick: int) -> None:
        assert self.scheduler is not None
        live = sorted(self.scheduler.requests)
        request = self.scheduler.requests[live[pick % len(live)]]
        SEEN["abort running" if request.status == RequestStatus.RUNNING else "abort waiting"] += 1
        [finished] = self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        assert finished is request and request.status == RequestStatus.FINISHED_ABORTED
        self.aborted.add(request.request_id)
        self._forget_freed()

    @precondition(lambda self: self.scheduler is not None and self.scheduler.has_unfinished_requests())
    @rule(num_steps=st.integers(1, 8))
    def step(self, num_steps: int) -> None:
        # Several steps per rule: otherwise adds and aborts outpace the steps.
        assert self.scheduler is not None
        for _ in range(num_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            self._step()
            self.check_scheduler_state()

    @precondition(lambda self: self.scheduler is not None)
    @rule(drain=st.sampled_from((False, False, True)))
    def reset_prefix_cache(self, drain: bool) -> None:
        """Refused while any request holds blocks; after a drain it forgets every hash."""
        assert self.scheduler is not None
        if drain:
            self._drain()
        pool = self.scheduler.kv_cache_manager.block_pool
        num_cached = sum(1 for block in pool.blocks if block.block_hash is not None)
        expected = not self.scheduler.running
        assert self.scheduler.kv_cache_manager.reset_prefix_cache() is expected, (
            f"reset_prefix_cache() must be {expected} with {len(self.scheduler.running)} running"
        )
        if not expected:
            SEEN["reset refused"] += 1
            return
        SEEN["reset with cached blocks"] += num_cached > 0
        assert pool.cached_block_hash_to_block == {}
        assert all(block.block_hash is None for block in pool.blocks)

    # ----------------------------------------------------------- invariant

    @invariant()
    def check_scheduler_state(self) -> None:
        if self.scheduler is None:
            return
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        self.reference.check()
        running_ids = [request.request_id for request in scheduler.running]
        waiting_ids = [request.request_id for request in scheduler.waiting]
        assert len(set(running_ids)) == len(running_ids), f"a request twice in running: {running_ids}"
        assert len(set(waiting_ids)) == len(waiting_ids), f"a request twice in waiting: {waiting_ids}"
        both = set(running_ids) & set(waiting_ids)
        assert not both, f"both running and waiting: {both}"
        assert set(scheduler.requests) == set(running_ids) | set(waiting_ids), (
            f"live requests {sorted(scheduler.requests)} are not running {running_ids} + waiting {waiting_ids}"
        )
        assert set(self.reference.tables) == set(running_ids), "only running requests hold blocks"
        assert len(running_ids) <= scheduler.max_num_seqs
        for request in scheduler.running:
            assert request.status == RequestStatus.RUNNING, request
            assert 0 < request.num_computed_tokens <= request.num_tokens, request
        for request in scheduler.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert (request.status == RequestStatus.PREEMPTED) == (request.num_preemptions > 0), request
            assert request.num_computed_tokens == 0 and manager.get_block_ids(request.request_id) == [], request
        for request_id, request in self.added.items():
            assert request.num_output_tokens <= MAX_TOKENS
            if request_id not in scheduler.requests:
                assert request.is_finished(), request
                assert manager.get_block_ids(request_id) == [], f"finished {request_id} still holds blocks"

    def teardown(self) -> None:
        # Every program ends drained: nothing stalls and nothing leaks.
        # NOTE: Hypothesis calls teardown in a `finally`; after a failed step
        # the drain would only bury that failure under a second one.
        if self.scheduler is None or sys.exc_info()[0] is not None:
            return
        self._drain()
        SEEN["drained at teardown"] += 1


def test_random_programs_keep_every_scheduler_invariant() -> None:
    SEEN.clear()
    run_state_machine_as_test(SchedulerMachine, settings=stateful_settings(150, 50))
    missing = [situation for situation in MUST_SEE if SEEN[situation] == 0]
    assert not missing, f"the random programs never reached {missing}; seen: {dict(SEEN)}"


def test_the_outside_checks_catch_a_planted_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    """An aborted request that keeps its blocks (the planted bug) must fail the
    run, with the manager's own checker switched off."""
    monkeypatch.setattr(KVCacheManager, "check_invariants", lambda self, live_requests=None: None)
    original_free = KVCacheManager.free

    def free(self: KVCacheManager, request: Request) -> None:
        if request.status != RequestStatus.FINISHED_ABORTED:
            original_free(self, request)

    monkeypatch.setattr(KVCacheManager, "free", free)
    with pytest.raises(AssertionError, match="manager holds tables of"):
        run_state_machine_as_test(
            SchedulerMachine,
            settings=stateful_settings(200, 40, phases=[Phase.generate], report_multiple_bugs=False, print_blob=False),
        )
