"""The no_repeat_ngram processor: hand-computed bans, exact logits rows, the
conformance suite, and a served-like run through the entry point."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.logits_processors.interface import AddedRequest, BatchUpdate, MovedRequest

from pagedllm_example_logitsproc import ARG, PROCESSOR_NAME
from pagedllm_example_logitsproc.processor import NoRepeatNGramLogitsProcessor, banned_tokens


def test_banned_tokens_complete_an_earlier_ngram() -> None:
    # Bigrams so far: (1,2) (2,3) (3,1) (1,2); the last token is 2 -> 3 would repeat (2,3).
    assert banned_tokens([1, 2, 3, 1, 2], 2) == {3}
    # Trigram prefix (1, 2) occurred once before, followed by 3.
    assert banned_tokens([1, 2, 3, 1, 2], 3) == {3}
    # Prefix (3, 1, 2) never occurred before.
    assert banned_tokens([1, 2, 3, 1, 2], 4) == set()
    # Size 1: every token seen.
    assert banned_tokens([4, 4, 7], 1) == {4, 7}
    # Too short to hold an n-gram yet.
    assert banned_tokens([5], 3) == set()
    # The prefix (5, 5) occurs at 0 and 1: both followers are banned.
    assert banned_tokens([5, 5, 6, 5, 5, 5], 3) == {5, 6}


def _processor_with(rows: list[tuple[dict[str, int] | None, list[int], list[int]]]) -> NoRepeatNGramLogitsProcessor:
    processor = NoRepeatNGramLogitsProcessor(EngineConfig(), torch.device("cpu"))
    added = [
        AddedRequest(i, SamplingParams(extra_args=args), prompt, output)
        for i, (args, prompt, output) in enumerate(rows)
    ]
    processor.update_state(BatchUpdate(len(rows), added=added))
    return processor


def test_apply_bans_exactly_the_completing_tokens_of_active_rows() -> None:
    processor = _processor_with([
        ({ARG: 2}, [1, 2, 3], [1, 2]),  # bans 3
        (None, [1, 2, 3], [1, 2]),  # no argument: untouched
        ({ARG: 3}, [0, 4], [5, 0, 4]),  # (0, 4) was followed by 5: bans 5
    ])
    logits = torch.zeros(3, 8)
    out = processor.apply(logits.clone())
    expected = torch.zeros(3, 8)
    expected[0, 3] = float("-inf")
    expected[2, 5] = float("-inf")
    assert torch.equal(out, expected)


def test_rows_move_with_their_requests_and_outputs_are_read_live() -> None:
    output = [1, 2]
    processor = _processor_with([(None, [9], []), ({ARG: 2}, [1, 2, 3], output)])
    # Row 0 leaves; row 1 moves to 0.
    processor.update_state(BatchUpdate(1, removed=[0], moved=[MovedRequest(1, 0)]))
    assert torch.equal(processor.apply(torch.zeros(1, 8))[0].isinf().nonzero().flatten(), torch.tensor([3]))
    output.append(4)  # sampled: (2, 4) is new, the last token 4 has no follower yet
    processor.update_state(None)
    assert not processor.apply(torch.zeros(1, 8)).isinf().any()


def test_validate_params_refuses_sizes_outside_the_range() -> None:
    NoRepeatNGramLogitsProcessor.validate_params(SamplingParams(extra_args={ARG: 3}))
    for bad in (0, 65, "2", 2.5, True):
        with pytest.raises(ValueError, match=ARG):
            NoRepeatNGramLogitsProcessor.validate_params(SamplingParams(extra_args={ARG: bad}))


def _installed() -> None:
    from pagedllm.plugins import get_plugin_manager

    get_plugin_manager().load()
    if PROCESSOR_NAME not in get_plugin_manager().logits_processors:
        pytest.skip("the package is not installed (pip install -e examples/plugins/pagedllm-example-logitsproc)")


def test_conformance_suite() -> None:
    _installed()
    from pagedllm.testing import run_suite

    run_suite("logits_processor", PROCESSOR_NAME)


def test_engine_output_has_no_repeated_ngram_and_matches_a_step_by_step_reference() -> None:
    _installed()
    from pagedllm import LLM

    prompts = [[11, 12, 13, 11, 12, 13, 11], [40, 41, 40, 41, 40]]
    size, max_tokens = 2, 10
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args={ARG: size})
    plain_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(model="tiny", dtype="float32", num_kv_blocks=64, logits_processors=[PROCESSOR_NAME])
    requests = [{"prompt_token_ids": p} for p in prompts]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(requests + requests, [params] * 2 + [plain_params] * 2,
                                                               use_tqdm=False)]
    # Reference: one token at a time from the plain engine, the banned tokens biased by -100.
    plain = LLM(model="tiny", dtype="float32", num_kv_blocks=64)
    for prompt, output in zip(prompts, got[:2], strict=True):
        tokens = list(prompt)
        for _ in range(max_tokens):
            bias = {t: -100.0 for t in banned_tokens(tokens, size)} or None
            step = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logit_bias=bias)
            tokens.append(plain.generate([{"prompt_token_ids": tokens}], step, use_tqdm=False)[0].outputs[0].token_ids[0])
        assert output == tokens[len(prompt):]
        bigrams = list(zip(tokens, tokens[1:], strict=False))
        assert len(set(bigrams[len(prompt) - 1 :])) == len(bigrams[len(prompt) - 1 :])
    assert got[:2] != got[2:]  # the plain outputs repeat bigrams: the processor had work to do
    # The requests without the argument are the plain engine's.
    assert got[2:] == [list(o.outputs[0].token_ids) for o in plain.generate(requests, plain_params, use_tqdm=False)]
