"""generation_config.json (vLLM's --generation-config / --override-generation-config):
its sampling values are the defaults of the fields a request leaves unset,
and every EOS id it and config.json list stops generation.

References: a +100 logit bias forces the token that must stop the request
(a token no list names runs on to max_tokens); the engine's own greedy run,
which sampling at temperature 0.9 equals only when the file's top_k=1 applies.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from helpers.server import ServerProcess, start_server
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig, ModelConfig
from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.cli import build_parser, serve_config
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.model_registry.generation_config import generation_sampling_defaults, load_generation_defaults

PRIMARY_EOS = 1  # the shipped tokenizer's eos, config.json's first
GENERATION_EOS = 4242  # generation_config.json's second eos id
CONFIG_EOS = 4100  # config.json's second eos id
PLAIN_TOKEN = 77  # in no EOS list
FILE = {"bos_token_id": 1, "eos_token_id": [PRIMARY_EOS, GENERATION_EOS], "temperature": 0.9, "top_k": 1,
        "max_new_tokens": 5}
DEFAULTS = {"temperature": 0.9, "top_k": 1, "max_tokens": 5}
PROMPT = [5, 6, 7, 8]
VOCAB_SIZE = 8192


def _write_json(path: Path, values: dict[str, Any]) -> None:
    path.write_text(json.dumps(values), encoding="utf-8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("genconfig") / "model"
    shutil.copytree(cached_tiny_model("llama", with_tokenizer=True, seed=7), folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["eos_token_id"] == PRIMARY_EOS and config["vocab_size"] == VOCAB_SIZE
    _write_json(folder / "config.json", {**config, "eos_token_id": [PRIMARY_EOS, CONFIG_EOS]})
    _write_json(folder / "generation_config.json", FILE)
    return folder


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64)


def _one(llm: LLM, params: SamplingParams | None) -> Any:
    return llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]


# -------------------------------------------------------------- offline LLM


@pytest.mark.parametrize("eos", [GENERATION_EOS, CONFIG_EOS], ids=["generation-config", "config-json-list"])
def test_every_listed_eos_id_stops_with_finish_reason_stop(llm: LLM, eos: int) -> None:
    forced = _one(llm, SamplingParams(max_tokens=4, logit_bias={eos: 100.0}))
    assert (list(forced.token_ids), forced.finish_reason, forced.stop_reason) == ([eos], "stop", eos)
    plain = _one(llm, SamplingParams(max_tokens=4, logit_bias={PLAIN_TOKEN: 100.0}))
    assert (list(plain.token_ids), plain.finish_reason) == ([PLAIN_TOKEN] * 4, "length")


def test_min_tokens_holds_back_every_eos_id_and_ignore_eos_ignores_them(llm: LLM) -> None:
    held = _one(llm, SamplingParams(max_tokens=6, min_tokens=2, logit_bias={GENERATION_EOS: 100.0}))
    assert len(held.token_ids) == 3 and held.token_ids[-1] == GENERATION_EOS and held.finish_reason == "stop"
    assert not {PRIMARY_EOS, GENERATION_EOS, CONFIG_EOS} & set(held.token_ids[:2])
    ignored = _one(llm, SamplingParams(max_tokens=3, ignore_eos=True, logit_bias={CONFIG_EOS: 100.0}))
    assert (list(ignored.token_ids), ignored.finish_reason) == ([CONFIG_EOS] * 3, "length")


def test_generate_without_params_takes_the_files_defaults(llm: LLM) -> None:
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens, defaults.top_p) == (0.9, 1, 5, 1.0)
    greedy = _one(llm, SamplingParams(temperature=0.0, max_tokens=5))
    assert len(greedy.token_ids) == 5  # no EOS on the way, so the comparison covers 5 sampled tokens
    # top_k=1 from the file: sampling at temperature 0.9 is greedy, 5 tokens long.
    assert list(_one(llm, None).token_ids) == list(greedy.token_ids)
    # Explicit params are used as given (as vLLM): no top_k, so sampling differs.
    explicit = SamplingParams(temperature=0.9, max_tokens=5, seed=3)
    assert list(_one(llm, explicit).token_ids) != list(greedy.token_ids)
    assert explicit.stop_token_ids == []  # the EOS ids went into a copy


# ------------------------------------------------- reading the config (no engine)

HF_CONFIG = SimpleNamespace(eos_token_id=[PRIMARY_EOS, CONFIG_EOS])


def test_vllm_ignores_the_files_sampling_values_but_not_its_eos_ids(model_dir: Path) -> None:
    auto = load_generation_defaults(str(model_dir), ModelConfig(), HF_CONFIG, VOCAB_SIZE)
    assert (auto.sampling, auto.extra_eos_token_ids) == (DEFAULTS, [CONFIG_EOS, GENERATION_EOS])
    engine = load_generation_defaults(str(model_dir), ModelConfig(generation_config="vllm"), HF_CONFIG, VOCAB_SIZE)
    assert (engine.sampling, engine.extra_eos_token_ids) == ({}, [CONFIG_EOS, GENERATION_EOS])


def test_override_wins_over_the_file_and_applies_with_vllm(model_dir: Path) -> None:
    override = {"temperature": 0.5, "max_new_tokens": 9, "top_k": None, "min_p": 0.1, "do_sample": True}
    merged = load_generation_defaults(
        str(model_dir), ModelConfig(override_generation_config=override), HF_CONFIG, VOCAB_SIZE
    )
    assert merged.sampling == {"temperature": 0.5, "min_p": 0.1, "max_tokens": 9}  # top_k: None unsets it
    alone = load_generation_defaults(
        str(model_dir), ModelConfig(generation_config="vllm", override_generation_config={"top_p": 0.7}),
        HF_CONFIG, VOCAB_SIZE,
    )
    assert alone.sampling == {"top_p": 0.7}


def test_a_folder_gives_its_own_file(model_dir: Path, tmp_path: Path) -> None:
    _write_json(tmp_path / "generation_config.json", {"top_p": 0.8, "eos_token_id": 4000, "repetition_penalty": 1.1})
    folder = load_generation_defaults(
        str(model_dir), ModelConfig(generation_config=str(tmp_path)), HF_CONFIG, VOCAB_SIZE
    )
    # The model folder's file (and its 4242) is not read; config.json's list still counts.
    assert (folder.sampling, folder.extra_eos_token_ids) == ({"top_p": 0.8, "repetition_penalty": 1.1},
                                                             [CONFIG_EOS, 4000])


def test_bad_sources_and_values_are_config_errors_naming_the_field(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as missing:
        EngineConfig.from_flat(generation_config=str(tmp_path / "nowhere"))
    assert missing.value.key == "model.generation_config"
    for override, key, value in [({"temperature": -1.0}, "temperature", -1.0), ({"top_k": "many"}, "top_k", "many"),
                                 ({"max_new_tokens": 0}, "max_new_tokens", 0)]:
        with pytest.raises(ConfigError) as bad:
            generation_sampling_defaults(str(model_dir), ModelConfig(override_generation_config=override))
        assert (bad.value.key, bad.value.value) == (f"model.override_generation_config.{key}", value)
    with pytest.raises(ConfigError) as before_start:  # checked before any engine starts
        LLM(model=str(model_dir), override_generation_config={"top_p": 0.0})
    assert before_start.value.key == "model.override_generation_config.top_p"
    for values, key in [({"top_p": 1.5}, "top_p"), ({"eos_token_id": ["x"]}, "eos_token_id")]:
        _write_json(tmp_path / "generation_config.json", values)
        with pytest.raises(ConfigError) as bad_file:
            load_generation_defaults(str(model_dir), ModelConfig(generation_config=str(tmp_path)), HF_CONFIG,
                                     VOCAB_SIZE)
        assert bad_file.value.key == f"{tmp_path}/generation_config.json.{key}"


def test_flags_reach_the_model_section() -> None:
    args = build_parser().parse_args(["serve", "tiny", "--generation-config", "vllm",
                                      "--override-generation-config", '{"temperature": 0.5}'])
    model = serve_config(args).model
    assert (model.generation_config, model.override_generation_config) == ("vllm", {"temperature": 0.5})


def test_a_requests_own_values_win_and_unset_ones_take_the_defaults() -> None:
    completion = CompletionRequest(prompt="hi", temperature=0.3)
    params = completion.sampling_params(completion.requested_max_tokens(DEFAULTS), None, None, defaults=DEFAULTS)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 1, 5)
    explicit = CompletionRequest(prompt="hi", top_k=4, max_tokens=None)
    params = explicit.sampling_params(explicit.requested_max_tokens(DEFAULTS), None, None, defaults=DEFAULTS)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.9, 4, 5)
    assert CompletionRequest(prompt="hi").requested_max_tokens({}) == 16
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert (chat.requested_max_tokens(DEFAULTS), chat.requested_max_tokens({})) == (5, None)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=7)
    assert chat.requested_max_tokens(DEFAULTS) == 7


# ------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with start_server(model_dir, "--num-kv-blocks", "64", "--max-model-len", "256") as srv:
        yield srv


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_server_shows_the_defaults_and_applies_them(server: ServerProcess) -> None:
    info = httpx.get(f"{server.base_url}/server_info", timeout=10).json()
    assert info["default_sampling_params"] == DEFAULTS
    assert ("Default sampling parameters have been overridden by the model's generation_config.json: "
            "{'temperature': 0.9, 'top_k': 1, 'max_tokens': 5}") in server.log()
    models = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    greedy = _post(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0.0, "max_tokens": 5})
    unset = _post(server, "/v1/completions", {"prompt": PROMPT})  # temperature 0.9, top_k 1, max_tokens 5
    assert unset["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert unset["usage"]["completion_tokens"] == 5 and unset["choices"][0]["finish_reason"] == "length"


def test_server_stops_at_every_eos_id(server: ServerProcess) -> None:
    completion = _post(server, "/v1/completions",
                       {"prompt": PROMPT, "max_tokens": 4, "logit_bias": {str(GENERATION_EOS): 100}})
    choice = completion["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], completion["usage"]["completion_tokens"]) == (
        "stop", GENERATION_EOS, 1)
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  "logit_bias": {str(CONFIG_EOS): 100}})
    choice = chat["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], chat["usage"]["completion_tokens"]) == (
        "stop", CONFIG_EOS, 1)
