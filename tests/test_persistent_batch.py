"""The runner's persistent rows: what a step gathers from them is exactly the
batch the scheduler's numbers describe (hand-computed below, block size 2)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.worker.persistent_batch import PersistentBatch


def _batch() -> PersistentBatch:
    batch = PersistentBatch(max_num_reqs=2, max_model_len=16, block_size=2)
    batch.add_request("a", [11, 12, 13], [7, 4], num_computed=3)  # decodes next
    batch.add_request("b", [21, 22, 23, 24, 25], [5, 1, 8], num_computed=0)  # prefills
    return batch


def test_a_step_gathers_input_ids_block_tables_and_slots_from_the_rows() -> None:
    batch = _batch()
    batch.append_token_ids("a", [14])  # sampled last step
    batch.append_block_ids("a", [9])
    batch.set_num_computed_tokens("a", 3)
    step, input_ids = batch.prepare(["a", "b"], np.array([1, 3]), [[], []])
    assert input_ids.tolist() == [14, 21, 22, 23]
    np.testing.assert_array_equal(step.positions, [3, 0, 1, 2])
    np.testing.assert_array_equal(step.block_table, [[7, 4, 9], [5, 1, 8]])
    np.testing.assert_array_equal(step.slot_mapping, [4 * 2 + 1, 5 * 2 + 0, 5 * 2 + 1, 1 * 2 + 0])
    np.testing.assert_array_equal(step.seq_lens, [4, 3])


def test_batch_order_follows_the_schedule_not_the_rows() -> None:
    batch = _batch()
    batch.set_num_computed_tokens("a", 2)
    step, input_ids = batch.prepare(["b", "a"], np.array([2, 1]), [[], []])
    assert input_ids.tolist() == [21, 22, 13]
    np.testing.assert_array_equal(step.block_table, [[5, 1, 8], [7, 4, 0]])


def test_drafts_follow_the_known_tokens_and_sampled_tokens_overwrite_them() -> None:
    batch = _batch()
    batch.set_num_computed_tokens("a", 2)
    batch.append_block_ids("a", [9])
    step, input_ids = batch.prepare(["a"], np.array([3]), [[90, 91]])  # its last known token + 2 drafts
    assert input_ids.tolist() == [13, 90, 91]
    np.testing.assert_array_equal(step.positions, [2, 3, 4])
    batch.append_token_ids("a", [90, 55])  # one draft accepted, then the recovered token
    batch.set_num_computed_tokens("a", 4)
    _, input_ids = batch.prepare(["a"], np.array([1]), [[]])
    assert input_ids.tolist() == [55]


def test_a_preempted_request_keeps_its_tokens_and_resumes_on_new_blocks() -> None:
    batch = _batch()
    batch.set_block_ids("a", [])
    batch.set_block_ids("a", [3, 6])
    batch.set_num_computed_tokens("a", 0)
    step, input_ids = batch.prepare(["a"], np.array([3]), [[]])
    assert input_ids.tolist() == [11, 12, 13]
    np.testing.assert_array_equal(step.slot_mapping, [6, 7, 12])


def test_rows_are_reused_and_grow_past_the_initial_count() -> None:
    batch = PersistentBatch(max_num_reqs=1, max_model_len=4, block_size=2)
    for index in range(20):
        batch.add_request(f"r{index}", [index, index + 1], [index], num_computed=0)
    assert len(set(batch.row_of.values())) == 20
    row = batch.row_of["r3"]
    batch.remove_request("r3")
    batch.add_request("new", [99], [42], num_computed=0)
    assert batch.row_of["new"] == row
    batch.append_block_ids("new", [43, 44, 45])  # lookahead slots past max_model_len's 2 blocks
    step, input_ids = batch.prepare(["r19", "new"], np.array([2, 1]), [[], []])
    assert input_ids.tolist() == [19, 20, 99]
    np.testing.assert_array_equal(step.block_table, [[19, 0, 0, 0], [42, 43, 44, 45]])


def test_sampling_tensors_are_reused_while_the_same_requests_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.worker import sampler

    builds: list[int] = []
    build = sampler.SamplingMetadata.build.__func__  # type: ignore[attr-defined]

    def counting_build(cls: type, params: list[SamplingParams], *args: object, **kwargs: object) -> object:
        builds.append(len(params))
        return build(cls, params, *args, **kwargs)

    monkeypatch.setattr(sampler.SamplingMetadata, "build", classmethod(counting_build))
    llm = LLM(model="tiny", dtype="float32")
    prompts = [{"prompt_token_ids": [100, 101, 102]}, {"prompt_token_ids": [200, 201]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm.generate(prompts, greedy, use_tqdm=False)
    assert builds == [2]  # both prefill in one step, then 9 decode steps reuse it
    seeded = [SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=5, seed=8, max_tokens=4, ignore_eos=True)]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
    assert builds == [2, 2, 1]  # new requests, then one of them left
    fresh = LLM(model="tiny", dtype="float32")
    assert tokens == [o.outputs[0].token_ids for o in fresh.generate(prompts, seeded, use_tqdm=False)]


def test_tokens_sampled_past_max_model_len_widen_the_rows() -> None:
    # With drafts a step may sample up to 1 + k tokens; the scheduler keeps
    # only those below max_model_len, the runner records them all.
    batch = PersistentBatch(max_num_reqs=1, max_model_len=4, block_size=2)
    batch.add_request("a", [1, 2, 3], [0, 1], num_computed=3)
    batch.append_token_ids("a", [4, 5, 6])
    assert batch.token_ids[batch.row_of["a"]].tolist() == [1, 2, 3, 4, 5, 6]
