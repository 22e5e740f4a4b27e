"""The OpenAI-compatible server through the real `openai` client, against the
offline LLM and Hugging Face transformers on the same tiny model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch
from helpers.server import ServerProcess, start_server
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams, __version__

MODEL_NAME = "tiny-llama"
NUM_KV_BLOCKS = 128
BLOCK_SIZE = 16
PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=11)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with start_server(model_dir, "--num-kv-blocks", str(NUM_KV_BLOCKS), "--served-model-name", MODEL_NAME) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), num_kv_blocks=NUM_KV_BLOCKS)


def stream_completion(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    return list(client.completions.create(model=MODEL_NAME, stream=True, **kwargs))


# ----------------------------------------------------------- completions


def test_greedy_streamed_equals_non_streamed_equals_offline(client: openai.OpenAI, offline: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    for prompt, reference in zip(PROMPTS, expected, strict=True):
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        chunks = stream_completion(client, prompt=prompt, max_tokens=12, temperature=0)
        streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        assert response.choices[0].text == streamed == reference.outputs[0].text
        assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
        assert response.usage.completion_tokens == len(reference.outputs[0].token_ids) == 12


def test_completion_response_shape(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, temperature=0)
    body = response.model_dump()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL_NAME
    assert isinstance(body["created"], int)
    choice = body["choices"][0]
    assert (choice["index"], choice["finish_reason"], choice["logprobs"]) == (0, "length", None)
    assert choice["stop_reason"] is None
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_several_prompts_and_token_id_prompts(client: openai.OpenAI, offline: LLM) -> None:
    token_ids = offline.tokenizer.encode(PROMPTS[1])
    response = client.completions.create(
        model=MODEL_NAME, prompt=[token_ids, offline.tokenizer.encode(PROMPTS[2])], max_tokens=5, temperature=0, n=1
    )
    expected = offline.generate(PROMPTS[1:], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [e.outputs[0].text for e in expected]
    assert response.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)


def test_stream_with_include_usage_ends_with_one_usage_chunk(client: openai.OpenAI) -> None:
    chunks = stream_completion(
        client, prompt="abc", max_tokens=6, temperature=0.8, seed=3, n=2, stream_options={"include_usage": True}
    )
    *content, last = chunks
    assert last.choices == []
    assert last.usage.completion_tokens == 12
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12
    assert all(chunk.usage is None for chunk in content)
    finishes = [(c.index, c.finish_reason) for chunk in content for c in chunk.choices if c.finish_reason]
    assert sorted(finishes) == [(0, "length"), (1, "length")]


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = stream_completion(client, prompt="abc", max_tokens=4, temperature=0)
    assert all(chunk.choices for chunk in chunks)
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]


def test_n2_gives_two_reproducible_samples(client: openai.OpenAI) -> None:
    def sample() -> list[str]:
        response = client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=8, n=2, seed=7,
                                             temperature=1.0)
        assert [c.index for c in response.choices] == [0, 1]
        assert response.usage.completion_tokens == 16
        return [c.text for c in response.choices]

    first = sample()
    assert sample() == first
    assert first[0] != first[1]  # children get seed + index


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def text(seed: int) -> str:
        response = client.completions.create(model=MODEL_NAME, prompt="seed", max_tokens=16, temperature=1.0,
                                             seed=seed)
        return response.choices[0].text

    assert text(123) == text(123)
    assert text(123) != text(124)
    streamed = "".join(c.choices[0].text for c in stream_completion(
        client, prompt="seed", max_tokens=16, temperature=1.0, seed=123) if c.choices)
    assert streamed == text(123)


def test_stop_string_truncates_and_reports_stop_reason(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    full_text = full.choices[0].text
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    assert stop.strip(), full_text
    expected = full_text[: full_text.index(stop)]
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                         stop=[stop])
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected, "stop", stop)
    chunks = stream_completion(client, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=stop)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    with_stop = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                          stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert with_stop.choices[0].text == expected + stop


def test_logprobs_match_offline(client: openai.OpenAI, offline: LLM) -> None:
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                         logprobs=3)
    reference = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3),
                                 use_tqdm=False)[0].outputs[0]
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for position, token_id in enumerate(reference.token_ids):
        expected = reference.logprobs[position]
        assert logprobs.tokens[position] == expected[token_id].decoded_token
        assert logprobs.token_logprobs[position] == pytest.approx(expected[token_id].logprob, abs=1e-4)
        top = logprobs.top_logprobs[position]
        # The chosen token plus the top 3 (the chosen greedy token is one of them).
        assert top == pytest.approx({lp.decoded_token: lp.logprob for lp in expected.values()}, abs=1e-4)
        assert max(top.values()) == pytest.approx(logprobs.token_logprobs[position], abs=1e-6)
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets


def test_echo_logprobs_on_token_ids_as_lm_eval_sends(server: ServerProcess, model_dir: Path, offline: LLM) -> None:
    token_ids = offline.tokenizer.encode("def fibonacci(n):\n    return")
    body = {"model": MODEL_NAME, "prompt": token_ids, "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(token_ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    # Reference: transformers' log-softmax of the same checkpoint.
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    expected = [log_probs[i - 1, token_ids[i]].item() for i in range(1, len(token_ids))]
    assert logprobs["token_logprobs"][1: len(token_ids)] == pytest.approx(expected, abs=1e-4)
    generated = int(log_probs[-1].argmax())
    assert logprobs["token_logprobs"][-1] == pytest.approx(log_probs[-1, generated].item(), abs=1e-4)
    for position in range(1, len(token_ids) + 1):
        top = logprobs["top_logprobs"][position]
        assert 1 <= len(top) <= 2  # the token itself and the top-1
        assert max(top.values()) == pytest.approx(log_probs[position - 1].max().item(), abs=1e-4)
    prompt_text = offline.tokenizer.decode(token_ids)
    assert choice["text"] == prompt_text + offline.tokenizer.decode([generated])
    assert "".join(logprobs["tokens"][: len(token_ids)]) == prompt_text


def test_prefix_cache_hit_is_reported_as_cached_tokens(client: openai.OpenAI) -> None:
    token_ids = list(range(100, 140))  # 40 tokens: two full blocks can be reused
    usages = [
        client.completions.create(model=MODEL_NAME, prompt=token_ids, max_tokens=2, temperature=0).usage
        for _ in range(2)
    ]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 2 * BLOCK_SIZE]


# ------------------------------------------------------------------ chat

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]


def test_chat_greedy_matches_offline_chat_and_streaming(client: openai.OpenAI, offline: LLM) -> None:
    end_of_turn = offline.tokenizer.convert_tokens_to_ids("<|im_end|>")
    reference = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[end_of_turn]),
                             use_tqdm=False)[0]
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    body = response.model_dump()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    message = response.choices[0].message
    assert (message.role, message.content) == ("assistant", reference.outputs[0].text)
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert response.usage.completion_tokens == len(reference.outputs[0].token_ids)

    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == reference.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == [
        response.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_chat_n2_and_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, n=2, seed=5,
                                              temperature=1.0, logprobs=True, top_logprobs=2)
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 4
        for entry in content:
            assert entry.bytes == list(entry.token.encode("utf-8"))
            top = [t.logprob for t in entry.top_logprobs]
            assert len(top) == 2 and top[0] >= top[1] and top[0] >= entry.logprob


def test_chat_stops_at_end_of_turn_token() -> None:
    # The reply ends at <|im_end|> (id 4 in the embedded tokenizer): the server
    # adds it to the request's stop_token_ids, keeping the client's own.
    from transformers import AutoTokenizer

    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedllm.model_registry.tiny import get_tokenizer_dir

    class Engine:
        tokenizer = AutoTokenizer.from_pretrained(str(get_tokenizer_dir()))
        model_name, max_model_len, vocab_size = MODEL_NAME, 512, 8192
        input_processor = SimpleNamespace(default_sampling_params={})

    serving = OpenAIServingChat(Engine())  # type: ignore[arg-type]
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "stop_token_ids": [7]})
    assert serving.build_sampling_params(request).stop_token_ids == [7, 4]


# ------------------------------------------------------------ other routes


def test_models_version_and_openapi(client: openai.OpenAI, server: ServerProcess) -> None:
    models = client.models.list().model_dump()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 512
    assert httpx.get(f"{server.base_url}/version").json() == {"version": __version__}
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/metrics"):
        assert path in schema["paths"]
    assert "CompletionRequest" in json.dumps(schema["components"])
    # The body models are documented even though the routes parse bodies themselves.
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    assert "prompt" in schema["components"]["schemas"]["CompletionRequest"]["required"]
    # No documentation page that loads its scripts from a CDN.
    assert httpx.get(f"{server.base_url}/docs").status_code == 404


def test_tokenize_and_detokenize_round_trip(server: ServerProcess, offline: LLM) -> None:
    url = server.base_url
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": PROMPTS[2]}).json()
    assert tokens == {"count": len(tokens["tokens"]), "max_model_len": 512,
                      "tokens": offline.tokenizer.encode(PROMPTS[2])}
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPTS[2]}
    chat_tokens = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    text = offline.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat_tokens == offline.tokenizer.encode(text, add_special_tokens=False)


def test_tokenize_and_detokenize_are_exact_on_hard_text(server: ServerProcess, offline: LLM) -> None:
    # Special-token strings inside the text (text, as a client wrote them),
    # non-ASCII, whitespace runs, a long text.
    from transformers import AutoTokenizer

    # A tokenizer of its own: split_special_tokens is a flag of the backend, not of one call.
    split_tokenizer = AutoTokenizer.from_pretrained(offline.tokenizer.name_or_path, split_special_tokens=True)
    texts = ["<|im_start|>user\nhi<|im_end|>", "héllo wörld — 日本語 🙂", "  a\n\n\tb  ", "word " * 2000]
    for text in texts:
        for add_special_tokens in (True, False):
            body = {"prompt": text, "add_special_tokens": add_special_tokens}
            tokens = httpx.post(f"{server.base_url}/tokenize", json=body).json()["tokens"]
            assert tokens == split_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    token_ids = list(range(0, 8192, 7))  # every kind of token, special ones included
    detokenized = httpx.post(f"{server.base_url}/detokenize", json={"tokens": token_ids}).json()
    assert detokenized == {"prompt": offline.tokenizer.decode(token_ids)}


def test_request_chat_template_and_kwargs_are_refused_unless_trusted(server: ServerProcess) -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    bodies = {
        "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 1},
        "/tokenize": {"messages": MESSAGES},
    }
    for path, body in bodies.items():
        for field, value in (("chat_template", template), ("chat_template_kwargs", {"flavour": "mint"})):
            response = httpx.post(f"{server.base_url}{path}", json={**body, field: value})
            assert response.status_code == 400, (path, field, response.text)
            error = response.json()["error"]
            assert (error["param"], error["type"]) == (field, "BadRequestError")
            assert "--trust-request-chat-template" in error["message"]
    # Without them the same requests are served.
    assert httpx.post(f"{server.base_url}/tokenize", json=bodies["/tokenize"]).status_code == 200
