"""Random programs against the KV cache manager alone (Hypothesis state machine).

Each program builds a small pool (8-24 blocks of 2-4 tokens) and runs up to 40
of: admit a new request (salted or not, prompts sharing a few prefixes so hits
happen), admit a waiting one, grow a running one by a prefill chunk or 1-3
decode tokens, finish one, preempt one (free, back to waiting, recompute
later), schedule one and preempt it before its step ran, drain and reset the
prefix cache. After every step `KVReference.check()` (tests/helpers) compares
the manager with an outside record of every block table and block content, and
the free queue's order is compared with a reference list (pop the head, freed
blocks to the tail in reverse table order, a hit takes its block out).

Rerun longer with PAGEDLLM_STATEFUL_SCALE=20 (multiplies the programs); a
failure prints a @reproduce_failure line to put on KVCacheManagerMachine.
"""

from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

import pytest
from helpers.kv_reference import KVReference
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

from pagedllm.core.kv_cache import KVCacheBlock, KVCacheManager, hashing
from pagedllm.core.kv_cache.block_pool import BlockPool
from pagedllm.core.request import Request

PARAMS = SimpleNamespace(prompt_logprobs=None, structured_outputs=None)

prompts = st.builds(
    lambda prefix, tail: [*prefix, *tail],
    st.sampled_from(PREFIXES),
    st.lists(st.sampled_from(TAIL_TOKENS), max_size=6),
).filter(bool)
picks = st.integers(0, 63)  # index into a list, modulo its length
lookaheads = st.sampled_from((0, 0, 0, 1, 2))  # draft slots, sometimes

# Situations a run must reach, or it proves little.
SEEN: Counter[str] = Counter()
MUST_SEE = (
    "allocation refused",
    "evicted cached block",
    "revived freed block",
    "shared live block",
    "salted hit",
    "uncomputed cached block dropped",
    "reset with cached blocks",
    "reset refused",
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager | None = None
        self.running: list[Request] = []
        self.waiting: list[Request] = []  # never admitted, or preempted
        self.num_requests = 0

    @initialize(num_blocks=st.integers(8, 24), block_size=st.integers(2, 4))
    def make_manager(self, num_blocks: int, block_size: int) -> None:
        self.manager = KVCacheManager(num_blocks, block_size, enable_caching=True, debug_checks=False)
        self.reference = KVReference(self.manager)
        # Reference free queue, head (evicted first) to tail.
        self.free_order = list(range(num_blocks))

    # ------------------------------------------------------------- helpers

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        hit_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        assert self.manager is not None
        manager, pool, block_size = self.manager, self.manager.block_pool, self.manager.block_size
        hit_blocks = hit_blocks or []
        hit_ids = [block.block_id for block in hit_blocks]
        num_hit_tokens = len(hit_blocks) * block_size
        table = self.reference.tables.get(request.request_id, [])
        num_needed = (
            cdiv(request.num_computed_tokens + num_hit_tokens + num_new_tokens + num_lookahead_tokens, block_size)
            - len(table)
            - len(hit_ids)
        )
        num_revivable = sum(1 for block_id in hit_ids if block_id in self.free_order)
        hashes_before = [block.block_hash for block in pool.blocks]
        refs_before = [block.ref_cnt for block in pool.blocks]

        new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hit_blocks, num_lookahead_tokens)

        if new_blocks is None:
            SEEN["allocation refused"] += 1
            assert num_needed > len(self.free_order) - num_revivable, (
                f"allocation of {num_needed} blocks refused with {len(self.free_order)} free"
            )
            # A refused allocation changes nothing.
            assert [block.block_hash for block in pool.blocks] == hashes_before
            assert [block.ref_cnt for block in pool.blocks] == refs_before
            assert manager.get_block_ids(request.request_id) == table
            return None
        # Hits leave the free queue wherever they sit; new blocks pop its head.
        self.free_order = [block_id for block_id in self.free_order if block_id not in hit_ids]
        new_ids = [block.block_id for block in new_blocks]
        assert new_ids == self.free_order[: max(0, num_needed)], (
            f"new blocks {new_ids}, expected the free queue's head {self.free_order[: max(0, num_needed)]}"
        )
        del self.free_order[: len(new_ids)]
        SEEN["revived freed block"] += num_revivable
        SEEN["shared live block"] += len(hit_ids) - num_revivable
        SEEN["evicted cached block"] += sum(1 for block_id in new_ids if hashes_before[block_id] is not None)
        self.reference.on_allocated(request, hit_ids, new_ids)
        return new_ids

    def _compute(self, request: Request, num_new_tokens: int) -> None:
        start = request.num_computed_tokens
        self.reference.on_computed(request, start, start + num_new_tokens)
        request.num_computed_tokens = start + num_new_tokens

    def _admit(self, request: Request, chunk: int, num_lookahead_tokens: int) -> None:
        assert self.manager is not None
        expected_hit_blocks = self.reference.expected_hit_blocks(request)
        hit_blocks, num_hit_tokens = self.manager.get_computed_blocks(request)
        assert num_hit_tokens == len(hit_blocks) * self.manager.block_size
        assert num_hit_tokens <= request.num_tokens - 1, "a hit must leave the last position to compute"
        assert len(hit_blocks) == expected_hit_blocks, (
            f"{request.request_id} (salt {request.cache_salt!r}) hit {len(hit_blocks)} blocks; "
            f"the cached contents give {expected_hit_blocks}"
        )
        num_new_tokens = min(chunk, request.num_tokens - num_hit_tokens)
        if self._allocate(request, num_new_tokens, hit_blocks, num_lookahead_tokens) is None:
            self.waiting.append(request)
            return
        if hit_blocks and request.cache_salt is not None:
            SEEN["salted hit"] += 1
        request.num_computed_tokens = num_hit_tokens
        self._compute(request, num_new_tokens)
        self.running.append(request)

    def _free(self, request: Request) -> None:
        assert self.manager is not None
        table = self.reference.tables[request.request_id]
        self.manager.free(request)
        self.reference.on_freed(request.request_id)
        still_held = {block_id for other in self.reference.tables.values() for block_id in other}
        # Freed blocks go to the tail, the request's last block first.
        self.free_order.extend(block_id for block_id in reversed(table) if block_id not in still_held)

    def _next_tokens(self, request: Request, num_tokens: int, tokens: list[int]) -> int:
        """Tokens to schedule next; a fully computed request first samples 1-3."""
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(tokens[: min(num_tokens, len(tokens))])
        return min(num_tokens, request.num_tokens - request.num_computed_tokens)

    # --------------------------------------------------------------- rules

    @precondition(lambda self: self.manager is not None)
    @rule(prompt=prompts, salt=st.sampled_from(SALTS), chunk=st.integers(1, 12), lookahead=lookaheads)
    def add_request(self, prompt: list[int], salt: str | None, chunk: int, lookahead: int) -> None:
        request = Request(f"r{self.num_requests}", prompt, PARAMS, eos_token_id=None, cache_salt=salt)  # type: ignore[arg-type]
        self.num_requests += 1
        self._admit(request, chunk, lookahead)

    @precondition(lambda self: self.waiting)
    @rule(pick=picks, chunk=st.integers(1, 12), lookahead=lookaheads)
    def admit_waiting(self, pick: int, chunk: int, lookahead: int) -> None:
        self._admit(self.waiting.pop(pick % len(self.waiting)), chunk, lookahead)

    @precondition(lambda self: self.running)
    @rule(
        pick=picks,
        num_tokens=st.integers(1, 6),
        tokens=st.lists(st.sampled_from(TAIL_TOKENS), min_size=3, max_size=3),
        lookahead=lookaheads,
    )
    def grow(self, pick: int, num_tokens: int, tokens: list[int], lookahead: int) -> None:
        """The next prefill chunk, or 1-3 sampled tokens (a draft-verify step)."""
        request = self.running[pick % len(self.running)]
        num_new_tokens = self._next_tokens(request, num_tokens, tokens)
        if self._allocate(request, num_new_tokens, num_lookahead_tokens=lookahead) is not None:
            self._compute(request, num_new_tokens)

    @precondition(lambda self: self.running)
    @rule(pick=picks)
    def finish(self, pick: int) -> None:
        self._free(self.running.pop(pick % len(self.running)))

    @precondition(lambda self: self.running)
    @rule(pick=picks)
    def preempt(self, pick: int) -> None:
        request = self.running.pop(pick % len(self.running))
        self._free(request)
        request.num_computed_tokens = 0
        self.waiting.append(request)

    @precondition(lambda self: self.running)
    @rule(pick=picks, num_tokens=st.integers(1, 8),
          tokens=st.lists(st.sampled_from(TAIL_TOKENS), min_size=3, max_size=3))
    def preempt_before_step_ran(self, pick: int, num_tokens: int, tokens: list[int]) -> None:
        """Scheduled (slots allocated, full blocks cached) but preempted before
        the step computed them: those blocks must not stay hittable."""
        assert self.manager is not None
        request = self.running[pick % len(self.running)]
        num_new_tokens = self._next_tokens(request, num_tokens, tokens)
        if self._allocate(request, num_new_tokens) is None:
            return
        first_uncomputed = request.num_computed_tokens // self.manager.block_size
        table = self.manager.get_blocks(request.request_id)
        SEEN["uncomputed cached block dropped"] += sum(
            1 for block in table[first_uncomputed:] if block.block_hash is not None and block.ref_cnt == 1
        )
        self.running.remove(request)
        self._free(request)
        request.num_computed_tokens = 0
        self.waiting.append(request)

    @precondition(lambda self: self.manager is not None)
    @rule(drain=st.booleans())
    def reset_prefix_cache(self, drain: bool) -> None:
        """Refused while any block is in use; after draining it forgets every hash."""
        assert self.manager is not None
        if drain:
            while self.running:
                self._free(self.running.pop())
        pool = self.manager.block_pool
        num_cached = sum(1 for block in pool.blocks if block.block_hash is not None)
        expected = not self.reference.tables
        assert self.manager.reset_prefix_cache() is expected, (
            f"reset_prefix_cache() must be {expected} with {len(self.reference.tables)} live block tables"
        )
        if not expected:
            SEEN["reset refused"] += 1
            assert sum(1 for block in pool.blocks if block.block_hash is not None) == num_cached
            return
        SEEN["reset with cached blocks"] += num_cached > 0
        assert pool.cached_block_hash_to_block == {}
        assert all(block.block_hash is None for block in pool.blocks)

    # ----------------------------------------------------------- invariant

    @invariant()
    def block_accounting_holds(self) -> None:
        if self.manager is None:
            return
        self.reference.check()
        assert self.reference.free_block_ids() == self.free_order, "free queue order differs from the reference"
        for request in self.waiting:
            assert self.manager.get_block_ids(request.request_id) == [], f"waiting {request.request_id} holds blocks"


def test_random_programs_keep_every_kv_invariant() -> None:
    SEEN.clear()
    run_state_machine_as_test(KVCacheManagerMachine, settings=stateful_settings(200, 50))
    missing = [situation for situation in MUST_SEE if SEEN[situation] == 0]
    assert not missing, f"the random programs never reached {missing}; seen: {dict(SEEN)}"


def _skip_shared_decrement(monkeypatch: pytest.MonkeyPatch) -> None:
    original = BlockPool.free_blocks

    def free_blocks(self: BlockPool, ordered_blocks: object) -> None:
        # The planted bug: a block another request still holds keeps this
        # request's reference too.
        original(self, [block for block in ordered_blocks if block.ref_cnt == 1])  # type: ignore[attr-defined]

    monkeypatch.setattr(BlockPool, "free_blocks", free_blocks)


def _drop_salt_from_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "generate_block_hash_extra_keys", lambda request, block_index: None)


@pytest.mark.parametrize(
    ("plant_bug", "expected_message"),
    [
        (_skip_shared_decrement, r"ref counts|reset_prefix_cache"),
        (_drop_salt_from_hash, r"salt"),
    ],
    ids=["skipped-ref-count-decrement", "salt-left-out-of-block-hash"],
)
def test_the_outside_checks_catch_a_planted_bug(
    monkeypatch: pytest.MonkeyPatch, plant_bug: object, expected_message: str
) -> None:
    # Only the outside checks: the manager's own checker is switched off.
    monkeypatch.setattr(KVCacheManager, "check_invariants", lambda self, live_requests=None: None)
    plant_bug(monkeypatch)  # type: ignore[operator]
    with pytest.raises(AssertionError) as excinfo:
        run_state_machine_as_test(
            KVCacheManagerMachine,
            settings=stateful_settings(200, 40, phases=[Phase.generate], report_multiple_bugs=False, print_blob=False),
        )
    assert re.search(expected_message, str(excinfo.value)), str(excinfo.value)
