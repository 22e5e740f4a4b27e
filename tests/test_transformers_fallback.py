"""The Transformers fallback (`model_impl`): architectures with no native file
run through transformers' own modeling code over the paged KV cache, with
greedy tokens equal to transformers' `generate` (float32).

GPT-NeoX (parallel residual, partial rotary, fused interleaved qkv, an
`embed_out` head renamed at load) and Starcoder2 (GQA, biases, LayerNorm, a
4-token sliding window, shorter than every prompt) run through one engine
each, with prefill chunks of at most 16 tokens mixed with decodes and a
second batch that hits the prefix cache. The same Llama checkpoint gives the
same tokens natively and through the fallback; an n-gram drafter on the
fallback changes no token; -tp 2 follows transformers' TP plan. Each
refusal is a typed error naming its field.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError, UnknownComponentError
from pagedllm.model_registry.model_impl import UnsupportedArchitectureError
from pagedllm.model_registry.models.llama import LlamaForCausalLM
from pagedllm.model_registry.transformers_fallback.model import TransformersForCausalLM
from pagedllm.plugins import get_plugin_manager
from pagedllm.worker.worker import plan_ranks

NUM_NEW_TOKENS = 12
BLOCK_SIZE = 4
TOKEN_BUDGET = 16  # every prompt below is prefilled in chunks beside decodes
PROMPT_LENS = [7, 19, 26]
SHARED_PREFIX_LEN = 12  # three blocks: the second batch's prefix-cache hit
SIZES: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
)
# Larger random weights than transformers' 0.02: greedy tokens that vary
# from step to step, so a wrong attention row changes them.
FALLBACK_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.5, initializer_range=0.2)),
    "starcoder2": ("Starcoder2Config", dict(num_key_value_heads=2, sliding_window=4, initializer_range=0.2)),
}


def _tokenizer_files(path: Path) -> None:
    from pagedllm.model_registry.tiny import get_tokenizer_dir

    for item in Path(get_tokenizer_dir()).iterdir():
        if item.is_file():
            shutil.copy(item, path / item.name)


def _save_checkpoint(config: Any, path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    _tokenizer_files(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import transformers

    root = tmp_path_factory.mktemp("fallback")
    return {
        name: _save_checkpoint(getattr(transformers, config_cls)(**SIZES, **extra), root / name)
        for name, (config_cls, extra) in FALLBACK_CONFIGS.items()
    }


def _prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(8, SIZES["vocab_size"]) for _ in range(n)] for n in lengths]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' own generate, one prompt at a time, with its KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        output = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
        results.append(output[0, len(prompt):].tolist())
    return results


def _driver_worker(llm: LLM) -> Any:
    return llm.engine_core.engine_core.model_executor.driver_worker


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(FALLBACK_CONFIGS))
def test_fallback_greedy_tokens_equal_transformers_generate(arch: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[arch]
    llm = LLM(model=str(path), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=96,
              max_num_batched_tokens=TOKEN_BUDGET, enforce_eager=True)
    worker = _driver_worker(llm)
    assert type(worker.model) is TransformersForCausalLM
    assert worker.model_facts.model_impl.reason == "fallback: no plugin registers the architecture"
    # The TP plan applies at one rank too: the linear layers are pagedllm's (the platform's GEMMs).
    assert {type(m).__name__ for m in worker.model.modules()} >= {
        "FallbackColumnParallelLinear", "FallbackRowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead"}

    first = _prompts(1, PROMPT_LENS)
    assert _tokens(_generate(llm, first)) == hf_greedy(path, first)
    # A second batch over the first prompt's first three blocks: a prefix-cache hit.
    second = _prompts(2, [5, 9], prefix=first[1][:SHARED_PREFIX_LEN])
    outputs = _generate(llm, second)
    assert [output.num_cached_tokens for output in outputs] == [SHARED_PREFIX_LEN, SHARED_PREFIX_LEN]
    assert _tokens(outputs) == hf_greedy(path, second)


def _llama_path() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=1234, initializer_range=0.2)


@pytest.mark.slow
def test_llama_gives_the_same_tokens_natively_and_through_the_fallback_with_and_without_a_grammar() -> None:
    prompts = _prompts(3, [6, 21, 30])
    kwargs: dict[str, Any] = dict(dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=96,
                                  max_num_batched_tokens=TOKEN_BUDGET, enforce_eager=True)
    native = LLM(model=str(_llama_path()), model_impl="native", **kwargs)
    assert type(_driver_worker(native).model) is LlamaForCausalLM
    fallback = LLM(model=str(_llama_path()), model_impl="transformers", **kwargs)
    worker = _driver_worker(fallback)
    assert type(worker.model) is TransformersForCausalLM
    assert worker.model_facts.model_impl.reason == (
        "forced by model_impl='transformers' over the registered native class"
    )
    assert _tokens(_generate(fallback, prompts)) == _tokens(_generate(native, prompts))
    # Structured output masks the fallback's logits as it masks the native model's.
    from pagedllm import SamplingParams
    from pagedllm.core.sampling_params import StructuredOutputsParams

    words = "[a-z]{2,6}( [a-z]{2,6}){1,3}"
    constrained = SamplingParams(temperature=0.0, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(regex=words))
    texts = {name: [o.outputs[0].text for o in engine.generate([{"prompt_token_ids": p} for p in prompts],
                                                                constrained, use_tqdm=False)]
             for name, engine in (("native", native), ("fallback", fallback))}
    assert texts["fallback"] == texts["native"]
    assert all(re.fullmatch(words, text) for text in texts["fallback"])


@pytest.mark.slow
def test_fallback_takes_each_layers_soft_cap_window_and_scale_from_transformers(tmp_path: Path) -> None:
    """Gemma 2 forced through the fallback: its modules pass an attention
    soft-cap (1.0: clips), a 4-token window on every other layer and a
    query_pre_attn_scalar scale; the LM head's final soft-cap (2.0) is applied
    by compute_logits. All must reach the paged layers for the tokens to match."""
    from transformers import Gemma2Config

    path = _save_checkpoint(Gemma2Config(
        **SIZES, num_key_value_heads=2, head_dim=16, sliding_window=4, attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0, query_pre_attn_scalar=24, initializer_range=0.2,
    ), tmp_path / "gemma2")
    llm = LLM(model=str(path), dtype="float32", model_impl="transformers", block_size=BLOCK_SIZE, num_kv_blocks=96,
              max_num_batched_tokens=TOKEN_BUDGET, enforce_eager=True)
    model = _driver_worker(llm).model
    assert type(model) is TransformersForCausalLM
    prompts = _prompts(5, PROMPT_LENS)
    assert _tokens(_generate(llm, prompts)) == hf_greedy(path, prompts)
    # The soft-caps may leave greedy tokens alone (tanh is monotonic): the logprobs show them.
    from transformers import AutoModelForCausalLM

    hf_logits = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)(torch.tensor([prompts[0]])).logits
    expected = torch.log_softmax(hf_logits[0, -1], dim=-1)
    output = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3),
                          use_tqdm=False)[0].outputs[0]
    for token_id, entry in output.logprobs[0].items():
        assert entry.logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
    layers = model.get_attention_layers()
    assert [(layer.sliding_window, layer.impl.logits_soft_cap, layer.impl.scale) for layer in layers] == [
        (4, 1.0, 24**-0.5), (None, 1.0, 24**-0.5)]


@pytest.mark.slow
def test_ngram_drafts_on_the_fallback_change_no_token(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["gpt_neox"]
    # A repeated span in every prompt: the n-gram drafter proposes from it.
    prompts = [span * 3 for span in _prompts(4, [5, 7])]
    plain = _tokens(_generate(LLM(model=str(path), dtype="float32", num_kv_blocks=96, enforce_eager=True), prompts))
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=96, enforce_eager=True, speculative_config=speculative)
    assert _tokens(_generate(llm, prompts)) == plain
    assert llm.engine_core.engine_core.scheduler.total_spec_decoding_stats.num_draft_tokens > 0


@pytest.mark.slow
def test_fallback_follows_transformers_tp_plan_at_tp_2(checkpoints: dict[str, Path]) -> None:
    """Starcoder2's plan: q/k/v and c_fc column-, o_proj and c_proj row-parallel,
    the embedding and LM head by vocabulary; each rank holds 2 query heads and
    1 KV head of the paged cache."""
    path = checkpoints["starcoder2"]
    llm = LLM(model=str(path), dtype="float32", tensor_parallel_size=2, block_size=BLOCK_SIZE, num_kv_blocks=96,
              max_num_batched_tokens=TOKEN_BUDGET, enforce_eager=True)
    prompts = _prompts(1, PROMPT_LENS)
    assert _tokens(_generate(llm, prompts)) == hf_greedy(path, prompts)


# ---- refusals: typed errors with the field and the value ----------------------------------------


def _config_only(path: Path, architecture: str, config: Any) -> Path:
    """A model folder with a config.json only (refusals come before any weight is read)."""
    path.mkdir(parents=True, exist_ok=True)
    values = config.to_dict()
    values["architectures"] = [architecture]
    (path / "config.json").write_text(json.dumps(values))
    return path


def _plan(path: Path, **flat: Any) -> Any:
    return plan_ranks(EngineConfig.from_flat(model=str(path), **flat), get_plugin_manager())


def test_native_impl_for_an_unregistered_architecture_is_a_config_error(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="GPTNeoXForCausalLM, which no plugin registers") as excinfo:
        _plan(checkpoints["gpt_neox"], model_impl="native")
    assert (excinfo.value.key, excinfo.value.value) == ("model.model_impl", "native")


def test_tensor_parallel_without_a_transformers_tp_plan_is_a_config_error(tmp_path: Path) -> None:
    from transformers import StableLmConfig

    path = _config_only(tmp_path / "m", "StableLmForCausalLM", StableLmConfig(**SIZES))
    with pytest.raises(ConfigError, match="StableLmForCausalLM runs on the Transformers fallback, and transformers "
                       "declares no tensor-parallel plan") as excinfo:
        _plan(path, tensor_parallel_size=2)
    assert (excinfo.value.key, excinfo.value.value) == ("parallel.tensor_parallel_size", 2)


def test_tensor_parallel_with_heads_that_do_not_split_is_a_config_error(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="GPTNeoXForCausalLM's attention heads") as excinfo:
        _plan(checkpoints["gpt_neox"], tensor_parallel_size=3)
    assert (excinfo.value.key, excinfo.value.value) == ("parallel.tensor_parallel_size", 3)


def test_quantization_on_the_fallback_is_a_config_error(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        _plan(checkpoints["gpt_neox"], quantization="int8")
    assert (excinfo.value.key, excinfo.value.value) == ("model.quantization", "int8")


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
@pytest.mark.parametrize("architecture", ["BertForMaskedLM", "NoSuchModelForCausalLM"])
def test_an_encoder_or_unknown_architecture_is_refused(tmp_path: Path, architecture: str, model_impl: str) -> None:
    from transformers import BertConfig

    path = _config_only(tmp_path / "m", architecture, BertConfig(**{k: SIZES[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}))
    with pytest.raises(UnsupportedArchitectureError, match="decoder-only causal LM that transformers knows") as excinfo:
        _plan(path, model_impl=model_impl)
    error = excinfo.value
    assert (error.key, error.value) == ("model.architecture", architecture)
    assert isinstance(error, ConfigError) and isinstance(error, UnknownComponentError)  # as before the fallback
    assert (error.kind, error.name) == ("model", architecture)


def test_a_model_whose_attention_takes_no_custom_implementation_is_refused(tmp_path: Path) -> None:
    from transformers import StableLmConfig

    path = _config_only(tmp_path / "m", "StableLmForCausalLM", StableLmConfig(**SIZES))
    with pytest.raises(ConfigError, match="_supports_attention_backend") as excinfo:
        LLM(model=str(path), dtype="float32", num_kv_blocks=16, load_format="dummy", enforce_eager=True)
    assert (excinfo.value.key, excinfo.value.value) == ("model.architecture", "StableLmForCausalLM")


def test_a_config_that_needs_remote_code_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "my_custom_decoder", "architectures": ["MyCustomForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_custom.MyConfig", "AutoModelForCausalLM": "modeling_custom.MyModel"},
    }))
    from pagedllm.model_registry.remote_code import RemoteCodeError

    with pytest.raises(RemoteCodeError, match=r"imports only with --trust-remote-code"):
        _plan(path)


def test_env_says_which_implementation_serves_the_model(
    checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedllm.entrypoints.cli import main

    cases = [
        (checkpoints["gpt_neox"], "auto", "transformers", "fallback: no plugin registers the architecture"),
        (_llama_path(), "auto", "native", "registered architecture"),
        (_llama_path(), "transformers", "transformers",
         "forced by model_impl='transformers' over the registered native class"),
    ]
    for path, model_impl, impl, reason in cases:
        assert main(["env", "--json", "--model", str(path), "--model-impl", model_impl]) == 0
        payload = json.loads(capsys.readouterr().out)
        assert (payload["model_impl"], payload["model_impl_reason"]) == (impl, reason)


def test_fallback_layers_that_disagree_with_the_kv_cache_are_a_load_error() -> None:
    from types import SimpleNamespace

    from pagedllm.model_registry.loader import ModelLoadError
    from pagedllm.worker.worker import check_fallback_attention_layers

    layers = [SimpleNamespace(num_kv_heads=2, head_size=16)]
    model: Any = SimpleNamespace(get_attention_layers=lambda: layers)
    facts: Any = SimpleNamespace(path="/m", architecture="XForCausalLM", head_size=16)
    check_fallback_attention_layers(model, facts, 2)
    layers.append(SimpleNamespace(num_kv_heads=2, head_size=32))
    with pytest.raises(ModelLoadError, match="layer 1 attends with 2 KV heads of size 32"):
        check_fallback_attention_layers(model, facts, 2)
    with pytest.raises(ModelLoadError, match="layer 0 attends with 2 KV heads of size 16 on this rank, the KV "
                       "cache is sized for 1"):
        check_fallback_attention_layers(model, facts, 1)
