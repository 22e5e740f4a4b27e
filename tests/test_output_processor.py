"""OutputProcessor: detokenization, stop strings, logprobs, n > 1, metrics."""

from __future__ import annotations

import pytest

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler_output import LogprobEntry
from pagedllm.engine.input_processor import make_request
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.outputs import Logprob, RequestOutputKind
from pagedllm.engine.stop_strings import check_stop_strings
from pagedllm.model_registry.tiny import get_tokenizer_dir

PROMPT_IDS = [10, 11, 12]


def add(processor, request_id, prompt, prompt_token_ids, params, arrival_time=None, output_kind=None):
    """Track a request as a front end does: fanned out by the input processor."""
    request = make_request(request_id, prompt, prompt_token_ids, params, arrival_time)
    processor.add_request(request, output_kind)
    return request


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_tokenizer_dir())


def run_tokens(processor, request_id, token_ids, *, finish_reason="length", stop_reason=None, now0=100.0):
    """Feed one token per step; the last step carries the engine's finish."""
    outputs, aborted = [], []
    for step, token_id in enumerate(token_ids):
        last = step == len(token_ids) - 1
        engine_output = EngineCoreOutput(
            request_id=request_id,
            new_token_ids=[token_id],
            finish_reason=finish_reason if last else None,
            stop_reason=stop_reason if last else None,
            num_cached_tokens=0,
            first_scheduled_time=now0,
        )
        processed = processor.process_outputs([engine_output], now=now0 + 1 + step)
        outputs += processed.request_outputs
        aborted += processed.reqs_to_abort
        if processed.reqs_to_abort:
            break
    return outputs, aborted


def test_final_only_output_has_text_tokens_and_metrics(tokenizer):
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode("Hello, world! ✓")
    add(processor, "r", "prompt", PROMPT_IDS, SamplingParams(max_tokens=len(ids)), arrival_time=50.0)
    outputs, aborted = run_tokens(processor, "r", ids)
    assert aborted == []
    (output,) = outputs  # FINAL_ONLY: one output, at the end
    assert output.request_id == "r" and output.prompt == "prompt" and output.prompt_token_ids == PROMPT_IDS
    assert output.finished
    (completion,) = output.outputs
    assert completion.index == 0
    assert completion.text == "Hello, world! ✓"
    assert completion.token_ids == ids
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.logprobs is None and completion.cumulative_logprob is None
    metrics = output.metrics
    assert (metrics.arrival_time, metrics.first_scheduled_time, metrics.first_token_time) == (50.0, 100.0, 101.0)
    assert metrics.finished_time == metrics.last_token_time == 100.0 + len(ids)
    assert not processor.has_unfinished_requests()


@pytest.mark.parametrize(("include", "expected"), [(False, "abc "), (True, "abc STOP")])
def test_stop_string_across_tokens_truncates_and_aborts(tokenizer, include, expected):
    processor = OutputProcessor(tokenizer)
    # Byte-by-byte tokens so "STOP" spans four steps.
    ids = [tokenizer.convert_tokens_to_ids(ch) for ch in "abc STOP def"]
    ids[3] = tokenizer.encode(" ")[0]
    params = SamplingParams(max_tokens=50, stop=["xyz", "STOP"], include_stop_str_in_output=include)
    add(processor, "r", None, PROMPT_IDS, params)
    outputs, aborted = run_tokens(processor, "r", ids)
    assert aborted == ["r"]
    (completion,) = outputs[-1].outputs
    assert completion.text == expected
    assert completion.finish_reason == "stop" and completion.stop_reason == "STOP"
    assert completion.token_ids == ids[: len("abc STOP")]  # tokens up to the match are kept
    assert not processor.has_unfinished_requests()


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_a_multi_token_step_ends_the_tokens_where_it_completed(tokenizer, include):
    """A step that brings several tokens (accepted drafts) and completes a
    stop string in their middle keeps the tokens, and their logprobs, up to
    the one that completed it: what one token per step gives."""
    ids = [tokenizer.convert_tokens_to_ids(ch) for ch in "abc STOP def"]
    ids[3] = tokenizer.encode(" ")[0]
    params = SamplingParams(max_tokens=50, stop=["STOP"], include_stop_str_in_output=include, logprobs=0)
    one_by_one = OutputProcessor(tokenizer)
    add(one_by_one, "r", None, PROMPT_IDS, SamplingParams(max_tokens=50, stop=["STOP"],
                                                         include_stop_str_in_output=include))
    expected = run_tokens(one_by_one, "r", ids)[0][-1].outputs[0]
    processor = OutputProcessor(tokenizer)
    add(processor, "r", None, PROMPT_IDS, params)
    steps = [ids[:2], ids[2:7], ids[7:]]  # "STOP" completes at the 8th token, inside no step's end
    outputs, aborted = [], []
    for step, token_ids in enumerate(steps):
        logprobs = [LogprobEntry([t], [-0.5 - i], 1) for i, t in enumerate(token_ids)]
        processed = processor.process_outputs([EngineCoreOutput(
            request_id="r", new_token_ids=token_ids, new_logprobs=logprobs, num_cached_tokens=0,
            first_scheduled_time=100.0)], now=101.0 + step)
        outputs += processed.request_outputs
        aborted += processed.reqs_to_abort
    assert aborted == ["r"]
    (completion,) = outputs[-1].outputs
    assert completion.token_ids == expected.token_ids == ids[: len("abc STOP")]
    assert completion.text == expected.text and completion.finish_reason == "stop"
    assert [next(iter(entry)) for entry in completion.logprobs] == completion.token_ids


def test_earliest_stop_string_wins():
    assert check_stop_strings("xx ab cd", 8, ["cd", "ab"], False) == ("ab", 3)
    assert check_stop_strings("xx ab cd", 8, ["cd", "ab"], True) == ("ab", 5)
    # Only matches ending in the new characters count.
    assert check_stop_strings("ab cd", 2, ["ab"], False) is None
    assert check_stop_strings("ab cd", 4, ["ab"], False) == ("ab", 0)


def test_streamed_deltas_never_show_a_partial_stop_string(tokenizer):
    processor = OutputProcessor(tokenizer)
    text = "one two STOP three"
    ids = [tokenizer.convert_tokens_to_ids(ch) if ch != " " else tokenizer.encode(" ")[0] for ch in text]
    params = SamplingParams(max_tokens=50, stop=["STOP"])
    add(processor, "r", None, PROMPT_IDS, params, output_kind=RequestOutputKind.DELTA)
    outputs, aborted = run_tokens(processor, "r", ids)
    assert aborted == ["r"]  # finished here by the stop string: the core must stop it
    deltas = [output.outputs[0].text for output in outputs]
    assert "".join(deltas) == "one two "
    assert all("S" not in delta for delta in deltas)
    # One output per step, each with only its new token.
    assert [output.outputs[0].token_ids for output in outputs] == [[t] for t in ids[: len("one two STOP")]]
    assert [output.finished for output in outputs] == [False] * (len("one two STOP") - 1) + [True]
    # Up to 3 held-back chars ("ST" here) are released only when decided.
    assert deltas[: len("one two ")] == ["", "", "", "o", "n", "e", " ", "t"]


def test_cumulative_outputs_repeat_everything_so_far(tokenizer):
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode("a b c")
    add(processor, "r", None, PROMPT_IDS, SamplingParams(max_tokens=9), output_kind=RequestOutputKind.CUMULATIVE)
    outputs, _ = run_tokens(processor, "r", ids)
    assert [o.outputs[0].token_ids for o in outputs] == [ids[: i + 1] for i in range(len(ids))]
    assert [o.outputs[0].text for o in outputs] == [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]


def test_stop_token_text_is_not_in_the_output(tokenizer):
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode("yes.")
    stop_id = ids[-1]
    add(processor, "r", None, PROMPT_IDS, SamplingParams(stop_token_ids=[stop_id]))
    outputs, aborted = run_tokens(processor, "r", ids, finish_reason="stop", stop_reason=stop_id)
    assert aborted == []  # the engine core already finished it
    completion = outputs[-1].outputs[0]
    assert completion.text == tokenizer.decode(ids[:-1])
    assert completion.token_ids == ids
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)


def test_eos_finish_with_special_token_skipped(tokenizer):
    processor = OutputProcessor(tokenizer)
    ids = [*tokenizer.encode("done"), tokenizer.eos_token_id]
    add(processor, "r", None, PROMPT_IDS, SamplingParams(include_stop_str_in_output=True))
    outputs, _ = run_tokens(processor, "r", ids, finish_reason="stop", stop_reason=None)
    completion = outputs[-1].outputs[0]
    assert completion.text == "done"
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)


def test_stop_strings_wait_for_min_tokens(tokenizer):
    processor = OutputProcessor(tokenizer)
    ids = [tokenizer.convert_tokens_to_ids(ch) for ch in "x.y.z"]
    add(processor, "r", None, PROMPT_IDS, SamplingParams(stop=["."], min_tokens=3, max_tokens=5))
    outputs, aborted = run_tokens(processor, "r", ids)
    assert aborted == ["r"]
    assert outputs[-1].outputs[0].text == "x.y"


def test_logprobs_become_dicts_with_ranks_and_decoded_tokens(tokenizer):
    processor = OutputProcessor(tokenizer)
    a, b, c = (tokenizer.convert_tokens_to_ids(ch) for ch in "abc")
    add(processor, "r", None, [a, b, c], SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=1))
    step1 = EngineCoreOutput(
        "r",
        [],
        new_prompt_logprobs=[None, LogprobEntry([b, a], [-1.5, -0.5], 2)],
    )
    step2 = EngineCoreOutput(
        "r",
        [c],
        new_logprobs=[LogprobEntry([c, c, a], [-0.25, -0.25, -2.0], 1)],
        new_prompt_logprobs=[LogprobEntry([c], [-3.0], 7)],
    )
    step3 = EngineCoreOutput(
        "r", [a], new_logprobs=[LogprobEntry([a, c, b], [-1.0, -0.5, -0.75], 3)], finish_reason="length"
    )
    outputs = [o for step in (step1, step2, step3) for o in processor.process_outputs([step]).request_outputs]
    (output,) = outputs
    assert output.prompt_logprobs == [
        None,
        {b: Logprob(-1.5, 2, "b"), a: Logprob(-0.5, 1, "a")},
        {c: Logprob(-3.0, 7, "c")},
    ]
    completion = output.outputs[0]
    assert completion.logprobs == [
        {c: Logprob(-0.25, 1, "c"), a: Logprob(-2.0, 2, "a")},
        {a: Logprob(-1.0, 3, "a"), c: Logprob(-0.5, 1, "c"), b: Logprob(-0.75, 2, "b")},
    ]
    assert completion.cumulative_logprob == -1.25
    assert completion.text == "ca"


def test_kept_logprobs_are_out_of_the_garbage_collectors_reach(tokenizer):
    # A non-streaming n=128 x 1,500-token x 20-logprob request keeps ~4M
    # entries until it ends; tracked, each full collection walked them all
    # and stalled the API server's event loop (and /health) for seconds.
    import gc

    processor = OutputProcessor(tokenizer)
    a, b = (tokenizer.convert_tokens_to_ids(ch) for ch in "ab")
    add(processor, "r", None, [a, b], SamplingParams(max_tokens=2, logprobs=1))
    step = EngineCoreOutput("r", [a], new_logprobs=[LogprobEntry([a, b], [-0.5, -1.5], 1)])
    processor.process_outputs([step])
    (state,) = processor.request_states.values()
    (pairs,) = state.logprobs.since()
    assert dict(pairs) == {a: Logprob(-0.5, 1, "a"), b: Logprob(-1.5, 1, "b")}
    gc.collect()
    gc.collect()  # the pairs are untracked by the first, the tuple of them by the second
    assert not gc.is_tracked(pairs[0][1])
    assert not gc.is_tracked(pairs)


def _scanned_items() -> int:
    """Items of the lists and tuples the garbage collector tracks: what a
    full collection walks one by one (after the collections that untrack
    nested tuples of untracked items, one level each at worst)."""
    import gc

    for _ in range(3):
        gc.collect()
    return sum(len(o) for o in gc.get_objects() if type(o) in (list, tuple))


def test_a_long_requests_kept_outputs_leave_the_collector_little_to_scan(tokenizer):
    # n=128 x 1,500 tokens with logprobs kept ~600k items in lists (token
    # ids twice, one dict per token) that every full collection walked,
    # holding the GIL for up to 150 ms in the API server.
    processor = OutputProcessor(tokenizer)
    a, b = (tokenizer.convert_tokens_to_ids(ch) for ch in "ab")
    add(processor, "r", None, [a, b], SamplingParams(max_tokens=2000, logprobs=1))
    before = _scanned_items()
    for position in range(1500):
        token = (a, b)[position % 2]
        processor.process_outputs([EngineCoreOutput("r", [token], new_logprobs=[
            LogprobEntry([token, a], [-0.5, -1.5], 1)])])
    assert _scanned_items() - before < 600  # the unsealed tails and the window: was > 4,500
    (state,) = processor.request_states.values()
    assert len(state.output_token_ids) == len(state.logprobs) == 1500
    assert state.output_token_ids.since(1498) == [a, b]
    assert state.detokenizer.output_text == "ab" * 750


def test_n_samples_fan_out_and_come_back_as_one_output(tokenizer):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, seed=7, max_tokens=2)
    request = add(processor, "r", "p", PROMPT_IDS, params, arrival_time=1.0)
    assert [(rid, p.n, p.seed) for rid, p in request.samples] == [("0_r", 1, 7), ("1_r", 1, 8)]
    assert [(r.request_id, r.sampling_params.n, r.sampling_params.seed) for r in request.engine_requests()] == [
        ("0_r", 1, 7), ("1_r", 1, 8)
    ]
    x, y = tokenizer.encode("x")[0], tokenizer.encode("y")[0]

    def step(request_id, token_id, finished, cached, now):
        engine_output = EngineCoreOutput(
            request_id, [token_id], finish_reason="length" if finished else None,
            num_cached_tokens=cached, first_scheduled_time=now - 1,
        )
        return processor.process_outputs([engine_output], now=now).request_outputs

    assert step("0_r", x, False, 0, 10.0) == []
    assert step("1_r", y, False, 3, 11.0) == []
    assert step("1_r", y, True, 3, 12.0) == []  # FINAL_ONLY waits for every sample
    (output,) = step("0_r", x, True, 0, 13.0)
    assert output.request_id == "r" and output.finished
    assert [(c.index, c.text, c.token_ids) for c in output.outputs] == [(0, "xx", [x, x]), (1, "yy", [y, y])]
    assert output.num_cached_tokens == 0
    assert (output.metrics.first_scheduled_time, output.metrics.first_token_time) == (9.0, 10.0)
    assert output.metrics.finished_time == 13.0
    assert not processor.has_unfinished_requests() and not processor.parent_requests


def test_abort_parent_aborts_every_sample_and_ignores_late_outputs(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, "r", None, PROMPT_IDS, SamplingParams(n=3))
    add(processor, "s", None, PROMPT_IDS, SamplingParams())
    assert processor.abort_requests(["r", "unknown"]) == ["0_r", "1_r", "2_r"]
    assert processor.process_outputs([EngineCoreOutput("1_r", [5], finish_reason="length")]).request_outputs == []
    assert processor.abort_requests(["s"]) == ["s"]
    assert not processor.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, "r", None, PROMPT_IDS, SamplingParams())
    with pytest.raises(InvalidRequestError) as excinfo:
        add(processor, "r", None, PROMPT_IDS, SamplingParams())
    assert excinfo.value.field == "request_id"


def test_detokenize_false_gives_token_ids_only(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, "r", None, PROMPT_IDS, SamplingParams(detokenize=False, max_tokens=2))
    outputs, _ = run_tokens(processor, "r", [40, 41])
    assert (outputs[-1].outputs[0].text, outputs[-1].outputs[0].token_ids) == ("", [40, 41])


def test_num_cached_tokens_reported(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, "r", None, PROMPT_IDS, SamplingParams(max_tokens=1))
    engine_output = EngineCoreOutput("r", [40], finish_reason="length", num_cached_tokens=48)
    (output,) = processor.process_outputs([engine_output]).request_outputs
    assert output.num_cached_tokens == 48


def test_packed_logprobs_read_as_a_list_of_dicts():
    from pagedllm.engine.outputs import PackedLogprobs

    first, second = {3: Logprob(-0.5, 1, "a")}, {4: Logprob(-1.0, 2, "b"), 3: Logprob(-2.0, 3, "a")}
    packed = PackedLogprobs([None, tuple(first.items()), tuple(second.items())])
    assert len(packed) == 3
    assert packed[1] == first and packed[-1] == second and packed[0] is None
    assert list(packed[2].items()) == list(second.items())  # the order is kept: the sampled token first
    assert packed[1:] == [first, second]
    assert packed == [None, first, second] and [None, first, second] == packed
    assert packed != [None, first] and packed != "abc"
    assert list(packed) == [None, first, second]
