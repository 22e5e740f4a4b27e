"""Logits processors (plugin kind ``logits_processor``): the rows they are
told about, per-request activation, speculative decoding, the server's
``vllm_xargs`` and the conformance suite.

The processor under test is the test plugin's ``ban_recent``
(tests/plugins/pagedllm-test-plugin): a request with
``extra_args={"ban_recent_tokens": k}`` never samples one of its last k
tokens. Its reference is a plain greedy loop over the Hugging Face model of
the same checkpoint with the same rule.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import torch
from helpers.server import ServerProcess, start_server
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.logits_processors.interface import AddedRequest, BatchUpdate, LogitsProcessor, MovedRequest
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl
from pagedllm.testing import ConformanceError, run_suite
from pagedllm.worker.logits_processor_rows import LogitsProcessorRows
from pagedllm.worker.persistent_batch import CachedRequestState
from pagedllm.worker.sampler import Sampler, SamplingMetadata

BAN = "ban_recent_tokens"


def _model_path() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=1234)


# ---------------------------------------------------------------- batch rows


def test_batch_update_remap_drops_removed_rows_and_rekeys_moved_ones() -> None:
    update = BatchUpdate(3, removed=[1], moved=[MovedRequest(0, 2), MovedRequest(2, 0)])
    assert update.remap({0: "a", 1: "b", 2: "c", 3: "d"}) == {2: "a", 0: "c", 3: "d"}


class RecordingProcessor(LogitsProcessor):
    def __init__(self, config: EngineConfig | None = None, device: torch.device | None = None) -> None:
        self.updates: list[BatchUpdate | None] = []

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def _state(req_id: str, prompt: list[int], output: list[int]) -> CachedRequestState:
    state = CachedRequestState(req_id, len(prompt), prompt + output, SamplingParams(), None)
    state.output_token_ids.extend(output)
    return state


def test_rows_report_adds_removes_and_moves_between_steps() -> None:
    processor = RecordingProcessor()
    rows = LogitsProcessorRows([processor])
    a, b, c, d = _state("a", [1], []), _state("b", [2], [5]), _state("c", [3], []), _state("d", [4], [])
    rows.update([a, b, c], None)
    first = processor.updates[-1]
    assert first is not None and first.batch_size == 3 and not first.removed and not first.moved
    assert [(r.row_index, list(r.prompt_token_ids), r.output_token_ids) for r in first.added] == [
        (0, [1], []), (1, [2], [5]), (2, [3], [])
    ]
    assert first.added[1].output_token_ids is b.output_token_ids  # the live list
    rows.update([a, b, c], None)
    assert processor.updates[-1] is None  # nothing changed
    # b finished, c moved to the front, d joined at the end.
    rows.update([c, a, d], None)
    second = processor.updates[-1]
    assert second is not None and second.batch_size == 3
    assert list(second.removed) == [1]
    assert sorted(second.moved) == [MovedRequest(0, 1), MovedRequest(2, 0)]
    assert [(r.row_index, list(r.prompt_token_ids)) for r in second.added] == [(2, [4])]
    # A new request under a finished one's id is a new row, not the old one.
    rows.update([c, _state("a", [9], []), d], None)
    third = processor.updates[-1]
    assert third is not None and list(third.removed) == [1] and [r.row_index for r in third.added] == [1]


def test_draft_positions_are_rows_that_see_the_drafts_before_them() -> None:
    processor = RecordingProcessor()
    rows = LogitsProcessorRows([processor])
    a, b = _state("a", [1, 2], [7]), _state("b", [3], [])
    rows.update([a, b], [[10, 11], []])
    first = processor.updates[-1]
    assert first is not None and first.batch_size == 4
    assert [(r.row_index, list(r.output_token_ids)) for r in first.added] == [
        (0, [7]), (1, [7, 10]), (2, [7, 10, 11]), (3, [])
    ]
    second_row_outputs = first.added[1].output_token_ids
    # a accepted 10 and got 12; its one new draft is 13: row (a, 2) goes, b moves up.
    a.output_token_ids.extend([10, 12])
    rows.update([a, b], [[13], []])
    second = processor.updates[-1]
    assert second is not None and second.batch_size == 3
    assert list(second.removed) == [2] and list(second.moved) == [MovedRequest(3, 2)] and not second.added
    assert list(second_row_outputs) == [7, 10, 12, 13]  # the same list, rewritten in place


def test_greedy_rows_take_the_argmax_after_the_processor_and_logit_bias_comes_first() -> None:
    class Halve(RecordingProcessor):
        """Halves row 0 (an argmax-changing processor: the bias below then loses)."""

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            logits[0] = torch.where(logits[0] > 0, logits[0] / 8, logits[0])
            return logits

    logits = torch.tensor([[1.0, 4.0, 3.0, 0.0], [1.0, 4.0, 3.0, 0.0]])
    params = [SamplingParams(temperature=0.0, logit_bias={2: 2.0}), SamplingParams(temperature=0.0)]
    metadata = SamplingMetadata.build(params, [[], []], [[], []], {}, 4, "cpu")
    metadata.logits_processors = [Halve()]
    # Row 0: bias -> [1, 4, 5, 0], halved by 8 -> [0.125, 0.5, 0.625, 0]: token 2. Row 1 untouched: token 1.
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [2, 1]
    assert logits.tolist() == [[1.0, 4.0, 3.0, 0.0], [1.0, 4.0, 3.0, 0.0]]  # the raw logits are left alone


def test_argmax_invariant_processors_run_only_for_random_rows_after_the_temperature() -> None:
    class KeepTopTwo(RecordingProcessor):
        """Top-2 truncation: never changes the argmax."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[torch.Tensor] = []

        def is_argmax_invariant(self) -> bool:
            return True

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            self.seen.append(logits.clone())
            kth = logits.topk(2, dim=-1).values[:, -1:]
            return logits.masked_fill(logits < kth, float("-inf"))

    logits = torch.tensor([[1.0, 4.0, 3.0, 0.0], [2.0, 0.0, 6.0, 5.0]])
    processor = KeepTopTwo()
    greedy = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 2, [[], []], [[], []], {}, 4, "cpu")
    greedy.logits_processors = [processor]
    assert Sampler()(logits, greedy).sampled_token_ids.tolist() == [1, 2]
    assert processor.seen == []  # all greedy: never asked
    params = [SamplingParams(temperature=0.5, seed=1), SamplingParams(temperature=2.0, seed=2)]
    generators = {i: torch.Generator().manual_seed(p.seed or 0) for i, p in enumerate(params)}
    mixed = SamplingMetadata.build(params, [[], []], [[], []], generators, 4, "cpu")
    mixed.logits_processors = [processor]
    probs = Sampler.compute_probs(logits, mixed)
    assert torch.equal(processor.seen[0], logits / torch.tensor([[0.5], [2.0]]))
    # Only the top two tokens of each row keep probability: softmax over them.
    expected = torch.zeros(2, 4)
    expected[0, [1, 2]] = torch.tensor([8.0, 6.0]).softmax(-1)
    expected[1, [2, 3]] = torch.tensor([3.0, 2.5]).softmax(-1)
    assert torch.allclose(probs, expected)


# ---------------------------------------------------------------- engine


def _hf_greedy_banning_recent(prompt: list[int], max_tokens: int, ban: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(_model_path()), dtype=torch.float32).eval()
    token_ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([token_ids])).logits[0, -1].float()
            logits[torch.tensor(token_ids[-ban:])] = float("-inf")
            token_ids.append(int(logits.argmax()))
    return token_ids[len(prompt) :]


def _prompts(num_prompts: int, seed: int) -> list[list[int]]:
    """Repeated spans, so that n-gram lookup drafts and the model repeats."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        span = [rng.randrange(8, 400) for _ in range(rng.randrange(2, 5))]
        prompts.append([rng.randrange(8, 400)] + span * rng.randrange(2, 4))
    return prompts


def _greedy(max_tokens: int, ban: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=None if ban is None else {BAN: ban})


def _generate(llm: LLM, prompts: list[list[int]], params: Sequence[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], list(params), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _llm(**kwargs: Any) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(model=str(_model_path()), dtype="float32", **kwargs)


def _without_args(params: Sequence[SamplingParams]) -> list[SamplingParams]:
    return [_greedy(p.max_tokens or 0) for p in params]


# Several requests, three of them with the processor's argument, of different lengths.
MIXED_PARAMS = [_greedy(12, ban=3), _greedy(9), _greedy(16, ban=6), _greedy(14), _greedy(7, ban=2)]


@pytest.fixture(scope="module")
def mixed_reference() -> list[list[int]]:
    """Each request alone through the HF model (banned rows) or a plain engine."""
    prompts = _prompts(len(MIXED_PARAMS), seed=3)
    plain = _generate(_llm(), prompts, _without_args(MIXED_PARAMS))
    return [
        plain[i] if params.extra_args is None
        else _hf_greedy_banning_recent(prompts[i], params.max_tokens or 0, params.extra_args[BAN])
        for i, params in enumerate(MIXED_PARAMS)
    ]


def test_a_processor_changes_only_the_requests_that_pass_its_args(mixed_reference: list[list[int]]) -> None:
    prompts = _prompts(len(MIXED_PARAMS), seed=3)
    plain = _generate(_llm(), prompts, _without_args(MIXED_PARAMS))
    got = _generate(_llm(logits_processors=["ban_recent"]), prompts, MIXED_PARAMS)
    assert got == mixed_reference
    num_changed = 0
    for i, params in enumerate(MIXED_PARAMS):
        if params.extra_args is not None:
            ban = params.extra_args[BAN]
            assert _follows_ban(prompts[i], got[i], ban)
            if not _follows_ban(prompts[i], plain[i], ban):
                num_changed += 1
                assert got[i] != plain[i]
    assert num_changed >= 2  # the ban had something to do


def _follows_ban(prompt: list[int], output: list[int], ban: int) -> bool:
    sequence = prompt + output
    return all(sequence[p] not in sequence[p - ban : p] for p in range(len(prompt), len(sequence)))


@pytest.mark.parametrize("engine_kwargs", [
    {"async_scheduling": True},
    {"max_num_batched_tokens": 8, "max_num_seqs": 3},  # chunked prefill, requests join and leave
    {"num_kv_blocks": 4, "max_model_len": 32},  # preemption: requests leave and come back
], ids=["async-scheduling", "chunked-prefill", "preemption"])
def test_rows_follow_the_batch_as_it_changes(mixed_reference: list[list[int]], engine_kwargs: dict[str, Any]) -> None:
    prompts = _prompts(len(MIXED_PARAMS), seed=3)
    llm = _llm(logits_processors=["ban_recent"], **engine_kwargs)
    assert _generate(llm, prompts, MIXED_PARAMS) == mixed_reference
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine_core.engine_core.scheduler.num_preemptions > 0


_eagle_dir: list[Path] = []


def _drafter_config(method: str) -> dict[str, Any]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if not _eagle_dir:
        from pagedllm.training.train_eagle import save_random_eagle_head

        folder = Path(tempfile.mkdtemp(prefix="pagedllm-eagle-")) / "head"
        _eagle_dir.append(save_random_eagle_head(str(_model_path()), folder))
    return {"method": "eagle", "num_speculative_tokens": 3, "model": str(_eagle_dir[0])}


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_greedy_output_with_drafts_equals_the_output_without(method: str) -> None:
    prompts = _prompts(8, seed=11)
    params = [_greedy(20, ban=(2, 4, None, 3)[i % 4]) for i in range(len(prompts))]
    expected = _generate(_llm(logits_processors=["ban_recent"]), prompts, params)
    assert expected != _generate(_llm(), prompts, [_greedy(20) for _ in prompts])
    llm = _llm(logits_processors=["ban_recent"], speculative_config=_drafter_config(method))
    assert _generate(llm, prompts, params) == expected
    stats = llm.engine_core.engine_core.scheduler.total_spec_decoding_stats
    assert stats.num_draft_tokens > 0


def test_unknown_processor_name_is_a_config_error_listing_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match=r"model.logits_processors='nope'.*ban_recent"):
        _llm(logits_processors=["nope"])


class StrictProcessor(RecordingProcessor):
    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        if (params.extra_args or {}).get("strict_arg") == "bad":
            raise ValueError("strict_arg must not be 'bad'")  # not InvalidRequestError: still a 400


class ExtraProcessorPlugin:
    """Processors registered in this process only: one loaded, one never."""

    @hookimpl
    def register_logits_processors(self, register: RegisterFn) -> None:
        register("test_unloaded", RecordingProcessor, args=["unloaded_arg"])
        register("test_strict", StrictProcessor, args=["strict_arg"])


@pytest.fixture
def extra_processor() -> Iterator[None]:
    pm = get_plugin_manager()
    pm.register(ExtraProcessorPlugin(), name="test-extra-logits-processor")
    try:
        yield
    finally:
        pm.unregister(name="test-extra-logits-processor")


def test_bad_args_and_args_of_a_processor_not_loaded_are_refused(extra_processor: None) -> None:
    llm = _llm(logits_processors=["ban_recent", "test_strict"], num_kv_blocks=32)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    with pytest.raises(InvalidRequestError, match=r"refused by logits processor 'test_strict': strict_arg must not"):
        llm.generate(prompt, SamplingParams(extra_args={"strict_arg": "bad"}), use_tqdm=False)
    for bad in (0, 65, "3", 2.0, True):
        with pytest.raises(InvalidRequestError, match=f"extra_args.{BAN}"):
            llm.generate(prompt, SamplingParams(extra_args={BAN: bad}), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"logits processor 'test_unloaded'.*does not load"):
        llm.generate(prompt, SamplingParams(extra_args={"unloaded_arg": 1}), use_tqdm=False)
    # Keys no processor declares are other plugins' business: accepted.
    assert llm.generate(prompt, SamplingParams(max_tokens=2, extra_args={"other": 1}), use_tqdm=False)


# ---------------------------------------------------------------- server

MODEL_NAME = "tiny-logitsprocs"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with start_server(_model_path(), "--num-kv-blocks", "64", "--max-model-len", "256", "--dtype", "float32",
                      "--served-model-name", MODEL_NAME, "--logits-processors", "ban_recent") as srv:
        yield srv


def _post(server: ServerProcess, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.slow
def test_server_applies_vllm_xargs_and_refuses_bad_ones(server: ServerProcess) -> None:
    import openai

    prompt = _prompts(1, seed=3)[0]
    expected = _hf_greedy_banning_recent(prompt, 8, 3)
    base = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    completion = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0.0,
        extra_body={"ignore_eos": True, "vllm_xargs": {BAN: 3}},
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(_model_path()))
    assert completion.choices[0].text == tokenizer.decode(expected)
    plain = _post(server, base)
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] != completion.choices[0].text
    for xargs, param in [
        ({BAN: 0}, f"vllm_xargs.{BAN}"),
        ({BAN: "3"}, f"vllm_xargs.{BAN}"),
        ({BAN: 10**30}, f"vllm_xargs.{BAN}"),
        ({f"k{i}": 1 for i in range(65)}, "vllm_xargs"),
        ([1, 2], "vllm_xargs"),
    ]:
        response = _post(server, {**base, "vllm_xargs": xargs})
        assert response.status_code == 400, (xargs, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (xargs, error)
    chat = _post(server, {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0.0,
                          "messages": [{"role": "user", "content": "hi"}], "vllm_xargs": {BAN: -1}},
                 "/v1/chat/completions")
    assert chat.status_code == 400 and chat.json()["error"]["param"] == f"vllm_xargs.{BAN}"


# ---------------------------------------------------------------- conformance


@pytest.mark.parametrize("name", ["ban_recent", "no_repeat_ngram"])
def test_conformance_suite_passes(name: str) -> None:
    if name not in get_plugin_manager().logits_processors:
        pytest.skip(f"{name} is not installed (make install)")
    run_suite("logits_processor", name)


class ForgetsMoves(LogitsProcessor):
    """Broken on purpose: ignores removed and moved rows."""

    example_args: ClassVar[dict[str, int]] = {"forget": 1}

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.rows: set[int] = set()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            self.rows |= {a.row_index for a in batch_update.added if a.params.extra_args}

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row in self.rows:
            if row < logits.shape[0]:
                logits[row, 0] = float("-inf")
        return logits


class TouchesEveryRow(ForgetsMoves):
    """Broken on purpose: changes rows without arguments too."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            self.rows = set(range(batch_update.batch_size))


class CopiesOutputs(ForgetsMoves):
    """Broken on purpose: bans each active row's last output token, from a
    copy of the output taken when the row was added."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            last = {a.row_index: list(a.output_token_ids)[-1:] for a in batch_update.added if a.params.extra_args}
            self.last = {**batch_update.remap(getattr(self, "last", {})), **last}

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, tokens in self.last.items():
            logits[row, tokens] = float("-inf")
        return logits


class BrokenProcessorsPlugin:
    @hookimpl
    def register_logits_processors(self, register: RegisterFn) -> None:
        register("test_forgets_moves", ForgetsMoves)
        register("test_touches_every_row", TouchesEveryRow)
        register("test_copies_outputs", CopiesOutputs)


@pytest.mark.parametrize(("name", "rule"), [
    ("test_forgets_moves", "rows-follow-adds-removes-moves"),
    ("test_touches_every_row", "untouched-without-args"),
    ("test_copies_outputs", "reads-output-tokens-live"),
])
def test_a_broken_processor_fails_the_rule_it_breaks(name: str, rule: str) -> None:
    pm = get_plugin_manager()
    pm.register(BrokenProcessorsPlugin(), name="test-broken-logits-processors")
    try:
        with pytest.raises(ConformanceError) as excinfo:
            run_suite("logits_processor", name)
    finally:
        pm.unregister(name="test-broken-logits-processors")
    assert excinfo.value.rule == rule


def test_added_request_unpacks_like_vllms_tuple() -> None:
    params = SamplingParams()
    index, got_params, prompt, output = AddedRequest(2, params, [1], [3])
    assert (index, got_params, prompt, output) == (2, params, [1], [3])
