"""Structured output units: the request API, the Grammar contract that
speculative decoding relies on (validate_tokens / rollback) on real grammars,
the compile manager (cache, WAITING_FOR_FSM without stalling the batch), the
bitmask helper, and the out-of-tree `guidance` backend chosen by config or
per request."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from helpers.json_schemas import MAX_TOKENS, SCHEMAS
from helpers.tiny_models import cached_tiny_model

from pagedllm.core.config import EngineConfig, StructuredOutputConfig
from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.sampling_params import StructuredOutputsParams as SO
from pagedllm.engine.input_processor import make_request
from pagedllm.engine.llm import LLM
from pagedllm.engine.wire import AddRequests, CoreInputDecoder, CoreInputEncoder
from pagedllm.model_registry.tokenizer import load_tokenizer
from pagedllm.plugins import GRAMMAR_BACKEND, get_plugin_manager, hookimpl
from pagedllm.structured_output.bitmask import allocate_token_bitmask, unpack_bitmask
from pagedllm.structured_output.interface import GrammarBackend, StructuredOutputKind
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.xgrammar_backend import XgrammarBackend


def _guidance() -> Any:
    """The out-of-tree backend: only the tests that use it skip when its package is absent."""
    return pytest.importorskip("pagedllm_example_grammar.backend",
                               reason="pip install -e examples/plugins/pagedllm-example-grammar")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=5)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(str(model_dir))


# ------------------------------------------------------------- request API


def test_exactly_one_spec_is_required() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one of json, json_object, regex"):
        SO()
    with pytest.raises(InvalidRequestError, match=r"\['json', 'regex'\]"):
        SO(json={"type": "string"}, regex="a+")
    assert SO(json_object=False, regex="a").kind_name == "regex"  # False means unset


@pytest.mark.parametrize(("fields", "field", "problem"), [
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json", "JSON object"),
    ({"regex": ""}, "structured_outputs.regex", "non-empty string"),
    ({"choice": []}, "structured_outputs.choice", "non-empty list of strings"),
    ({"choice": ["a", 1]}, "structured_outputs.choice", "non-empty list of strings"),
    ({"grammar": 5}, "structured_outputs.grammar", "non-empty string"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace", "true or false"),
])
def test_bad_fields_name_the_field(fields: dict[str, Any], field: str, problem: str) -> None:
    with pytest.raises(InvalidRequestError, match=problem) as info:
        SO(**fields)
    assert info.value.field == field


def test_structured_outputs_cross_the_engine_wire_as_themselves() -> None:
    params = SamplingParams(max_tokens=5, structured_outputs=SO(json=SCHEMAS["ref_defs"], backend="guidance"))
    request = make_request("r", None, [1, 2], params, 1.0)
    message = CoreInputDecoder().decode(CoreInputEncoder().encode(AddRequests(request.engine_requests())))
    assert isinstance(message, AddRequests)
    rebuilt = message.requests[0].sampling_params
    assert type(rebuilt.structured_outputs) is SO and rebuilt.structured_outputs == params.structured_outputs
    assert rebuilt.structured_outputs.grammar_spec() == params.structured_outputs.grammar_spec()


def test_structured_outputs_given_as_a_dict_are_validated_as_one() -> None:
    assert SamplingParams(structured_outputs={"regex": "a"}).structured_outputs == SO(regex="a")
    with pytest.raises(InvalidRequestError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(InvalidRequestError, match=r"regexp.*unknown fields"):
        SamplingParams(structured_outputs={"regexp": "a"})


def test_config_section_defaults_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig().structured_output.backend == "xgrammar"
    monkeypatch.setenv("PAGEDLLM_STRUCTURED_OUTPUT__BACKEND", "guidance")
    assert EngineConfig().structured_output.backend == "guidance"
    assert EngineConfig.from_flat(structured_outputs_config={"cache_size": 3}).structured_output.cache_size == 3


# ------------------------------------------------------- Grammar contract


def _backend(name: str, tokenizer: Any) -> GrammarBackend:
    cls = XgrammarBackend if name == "xgrammar" else _guidance().GuidanceBackend
    return cls(tokenizer, len(tokenizer), tokenizer.eos_token_id, StructuredOutputConfig())


def _mask(grammar: Any, vocab_size: int) -> torch.Tensor:
    bitmask = allocate_token_bitmask(1, vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, vocab_size)[0]


@pytest.mark.parametrize("backend_name", ["xgrammar", "guidance"])
def test_validate_tokens_returns_the_valid_prefix_without_advancing(backend_name: str, tokenizer: Any) -> None:
    backend = _backend(backend_name, tokenizer)
    grammar = backend.compile(StructuredOutputKind.REGEX, "SELECT [a-z]{1,6} FROM t[0-9];")
    valid = tokenizer.encode("SELECT name FROM t1;", add_special_tokens=False)
    invalid = tokenizer.encode("!!", add_special_tokens=False)
    before = _mask(grammar, len(tokenizer))
    assert grammar.validate_tokens(valid + invalid + valid) == valid
    assert grammar.validate_tokens(invalid) == []
    assert torch.equal(_mask(grammar, len(tokenizer)), before)  # nothing advanced
    assert grammar.accept_tokens("r", valid[:2])
    assert grammar.validate_tokens(valid) == []  # the state moved on
    assert grammar.validate_tokens(valid[2:]) == valid[2:]


@pytest.mark.parametrize("backend_name", ["xgrammar", "guidance"])
def test_rollback_restores_the_mask_and_termination(backend_name: str, tokenizer: Any) -> None:
    backend = _backend(backend_name, tokenizer)
    grammar = backend.compile(StructuredOutputKind.JSON, json.dumps(SCHEMAS["flat_object"]), any_whitespace=False)
    # Without free whitespace xgrammar separates with ", " and ": ", llguidance with "," and ":".
    text = '{"name": "ab", "age": 7}' if backend_name == "xgrammar" else '{"name":"ab","age":7}'
    tokens = tokenizer.encode(text, add_special_tokens=False)
    vocab_size, eos = len(tokenizer), tokenizer.eos_token_id
    masks = [_mask(grammar, vocab_size)]
    for token in tokens:
        assert grammar.accept_tokens("r", [token])
        masks.append(_mask(grammar, vocab_size))
    assert masks[-1][eos] and not masks[1][eos]  # EOS only where the grammar can end
    assert not grammar.is_terminated()
    assert grammar.accept_tokens("r", [eos]) and grammar.is_terminated()
    grammar.rollback(1)
    assert not grammar.is_terminated()
    grammar.rollback(3)
    assert torch.equal(_mask(grammar, vocab_size), masks[len(tokens) - 3])
    # Drafts: accept several, roll the rejected ones back, continue correctly.
    assert grammar.accept_tokens("r", tokens[-3:])
    assert torch.equal(_mask(grammar, vocab_size), masks[-1])
    assert not grammar.accept_tokens("r", tokenizer.encode("x", add_special_tokens=False))
    forked = grammar.fork()
    grammar.reset()
    assert torch.equal(_mask(grammar, vocab_size), masks[0])
    assert torch.equal(_mask(forked, vocab_size), masks[-1])  # fork is independent


def test_bitmask_masks_tokens_past_the_tokenizer(tokenizer: Any) -> None:
    # The model's vocab may be padded past the tokenizer's: those ids are never allowed.
    model_vocab = len(tokenizer) + 40
    backend = XgrammarBackend(tokenizer, model_vocab, tokenizer.eos_token_id, StructuredOutputConfig())
    grammar = backend.compile(StructuredOutputKind.JSON_OBJECT, "")
    bitmask = backend.allocate_bitmask(1, model_vocab)
    grammar.fill_bitmask(bitmask, 0)
    assert not unpack_bitmask(bitmask, model_vocab)[0, len(tokenizer):].any()


def test_apply_bitmask_torch_and_xgrammar_kernels_agree() -> None:
    import pagedllm.worker.grammar_bitmask as bitmask_module

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 4), dtype=torch.int32, generator=generator)
    results = []
    for kernel in (None, False):  # None: xgrammar's kernel; False: plain torch
        bitmask_module._xgrammar_apply = kernel
        out = logits.clone()
        bitmask_module.apply_token_bitmask_inplace(out, bitmask, [1, 4])
        results.append(out)
    bitmask_module._xgrammar_apply = None
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0][[0, 2, 3]], logits[[0, 2, 3]])  # other rows untouched
    allowed = unpack_bitmask(bitmask, 100)
    assert torch.equal(torch.isinf(results[0][[1, 4]]), ~allowed)


# ----------------------------------------------------------- the manager


def _manager(tokenizer: Any, **config: Any) -> StructuredOutputManager:
    return StructuredOutputManager(StructuredOutputConfig(**config), vocab_size=len(tokenizer),
                                   tokenizer=tokenizer, eos_token_id=tokenizer.eos_token_id, max_num_rows=8)


def _request(request_id: str, structured: SO | None) -> Request:
    return Request(request_id, [5, 6], SamplingParams(structured_outputs=structured), eos_token_id=1)


def test_cache_hits_repeated_specs_and_evicts_least_recently_used(tokenizer: Any) -> None:
    manager = _manager(tokenizer, cache_size=2)
    specs = [SO(regex="a+"), SO(regex="b+"), SO(regex="a+"), SO(regex="c+"), SO(regex="b+"), SO(regex="a+")]
    requests = [_request(str(i), spec) for i, spec in enumerate(specs)]
    for request in requests:
        manager.grammar_init(request)
    # a miss, b miss, a hit, c miss (evicts b), b miss (evicts a), a miss
    assert (manager.stats.hits, manager.stats.misses) == (1, 5)
    for request in requests:
        request.structured_output_request.future.result(timeout=30)
        assert request.structured_output_request.is_ready() and request.structured_output_request.grammar
    # Each request owns its own matcher state.
    assert requests[0].structured_output_request.grammar is not requests[2].structured_output_request.grammar
    assert SO(regex="a+", disable_any_whitespace=True).grammar_spec() == SO(regex="a+").grammar_spec()
    manager.close()


class _GatedBackend(XgrammarBackend):
    """xgrammar, but compile() waits for a test's signal."""

    gate = threading.Event()
    name = "gated"

    def compile(self, kind: StructuredOutputKind, spec: str, *, any_whitespace: bool = True) -> Any:
        assert self.gate.wait(30)
        return super().compile(kind, spec, any_whitespace=any_whitespace)


class _GatedPlugin:
    @hookimpl
    def register_grammar_backends(self, register: Any) -> None:
        register("gated", _GatedBackend)


@pytest.fixture
def gated_backend() -> Any:
    pm = get_plugin_manager()
    plugin = _GatedPlugin()
    pm.register(plugin, name="test-gated-grammar")
    _GatedBackend.gate.clear()
    try:
        assert "gated" in pm.registry(GRAMMAR_BACKEND)
        yield _GatedBackend.gate
    finally:
        _GatedBackend.gate.set()
        pm.unregister(plugin)


def test_a_compiling_grammar_does_not_stall_the_batch(model_dir: Path, gated_backend: threading.Event) -> None:
    llm = LLM(str(model_dir), num_kv_blocks=64, max_model_len=256)
    core = llm.engine_core.engine_core
    core.add_request(Request("waits", [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=SO(regex="[0-9]{3}", backend="gated")), eos_token_id=1))
    core.add_request(Request("runs", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), eos_token_id=1))
    tokens: dict[str, list[int]] = {"waits": [], "runs": []}
    finished: set[str] = set()
    while "runs" not in finished:
        for output in core.step().outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                finished.add(output.request_id)
    assert len(tokens["runs"]) == 4 and tokens["waits"] == []
    assert core.scheduler.requests["waits"].status == RequestStatus.WAITING_FOR_FSM
    gated_backend.set()
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            tokens[output.request_id] += output.new_token_ids
    assert llm.tokenizer.decode(tokens["waits"][:-1]).isdigit()
    assert len(llm.tokenizer.decode(tokens["waits"][:-1])) == 3


# -------------------------------------------------- the example backend


def test_guidance_backend_selected_by_config_and_per_request(model_dir: Path) -> None:
    _guidance()
    schema = SCHEMAS["array_of_objects"]
    llm = LLM(str(model_dir), num_kv_blocks=128, max_model_len=512,
              structured_outputs_config={"backend": "guidance"})
    by_config = SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS,
                               structured_outputs=SO(json=schema, disable_any_whitespace=True))
    per_request_xgrammar = SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS,
                                          structured_outputs=SO(json=schema, disable_any_whitespace=True,
                                                                backend="xgrammar"))
    regex = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(regex=r"[a-z]{2,4}-[0-9]{2}"))
    outputs = llm.generate(["a", "b", "c"], [by_config, per_request_xgrammar, regex], use_tqdm=False)
    for output in outputs[:2]:
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    assert __import__("re").fullmatch(r"[a-z]{2,4}-[0-9]{2}", outputs[2].outputs[0].text)
    manager = llm.engine_core.engine_core.structured_output_manager
    assert set(manager._backends) == {"guidance", "xgrammar"}
    # The engine default is xgrammar; a request names guidance.
    llm_default = LLM(str(model_dir), num_kv_blocks=64, max_model_len=512)
    per_request = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=SO(
        json=SCHEMAS["one_of_tagged"], disable_any_whitespace=True, backend="guidance"))
    text = llm_default.generate("x", per_request, use_tqdm=False)[0].outputs[0].text
    jsonschema.validate(json.loads(text), SCHEMAS["one_of_tagged"])
    with pytest.raises(InvalidRequestError, match="does not support structural_tag"):
        llm_default.generate("x", SamplingParams(structured_outputs=SO(
            structural_tag={"type": "structural_tag"}, backend="guidance")), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"registered grammar backends: .*guidance.*xgrammar"):
        llm_default.generate("x", SamplingParams(structured_outputs=SO(regex="a", backend="nope")), use_tqdm=False)


def test_bitmask_pack_and_unpack_round_trip() -> None:
    from pagedllm.structured_output.bitmask import pack_bitmask

    allowed = torch.rand(77, generator=torch.Generator().manual_seed(0)) > 0.5
    allowed[31] = allowed[63] = True  # bit 31 of a word: the int32 sign bit
    packed = pack_bitmask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (3,)
    assert torch.equal(unpack_bitmask(packed[None], 77)[0], allowed)


def test_json_grammars_never_offer_raw_control_characters(tokenizer: Any) -> None:
    # xgrammar alone accepts "\x06" and "\t" inside a length-bounded string.
    backend = _backend("xgrammar", tokenizer)
    schema = json.dumps({"type": "object", "properties": {"nick": {"type": "string", "minLength": 1, "maxLength": 6}},
                         "required": ["nick"]})
    grammar = backend.compile(StructuredOutputKind.JSON, schema, any_whitespace=True)
    assert grammar.accept_tokens("r", tokenizer.encode('{"nick": "', add_special_tokens=False))
    control = [t for t in range(len(tokenizer)) if tokenizer.decode([t]) in ("\x06", "\t", "\x1d")]
    letter = tokenizer.encode("a", add_special_tokens=False)
    assert len(control) == 3 and len(letter) == 1
    mask = _mask(grammar, len(tokenizer))
    assert not mask[control].any() and mask[letter[0]]
    assert grammar.validate_tokens(control[:1]) == [] and grammar.validate_tokens(letter) == letter
    # Other kinds are left as xgrammar makes them: a regex may want a tab.
    regex = backend.compile(StructuredOutputKind.REGEX, "a\tb")
    assert regex.accept_tokens("r", letter) and _mask(regex, len(tokenizer))[control[1:2]].all()


@pytest.mark.parametrize("kind,spec", [(StructuredOutputKind.JSON_OBJECT, ""), (StructuredOutputKind.REGEX, ".{0,40}")])
def test_special_tokens_are_never_text_but_eos_still_ends_the_grammar(
    tokenizer: Any, kind: StructuredOutputKind, spec: str
) -> None:
    # "<|im_end|>" inside a JSON string would vanish from the text (or stop a chat).
    backend = _backend("xgrammar", tokenizer)
    grammar = backend.compile(kind, spec, any_whitespace=False)
    prefix = tokenizer.encode('{"' if kind is StructuredOutputKind.JSON_OBJECT else "ab", add_special_tokens=False)
    assert grammar.accept_tokens("r", prefix)
    added = {t for t, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    specials = sorted((set(tokenizer.all_special_ids) | added) - {tokenizer.eos_token_id})
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in specials
    mask = _mask(grammar, len(tokenizer))
    assert not mask[specials].any()
    assert grammar.validate_tokens(specials[:1]) == []
    if kind is StructuredOutputKind.REGEX:
        assert mask[tokenizer.eos_token_id]  # "ab" is a whole match: EOS may end it
