"""vLLM's serving flags: --chat-template, --served-model-name A B, and
their config / LLM(...) spellings, through the HTTP layer of a fake engine
(fast) and one tiny LLM."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.fake_engine import FakeEngine
from helpers.tiny_models import cached_tiny_model

from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.cli import build_parser, serve_config
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.model_registry.chat_template import MissingChatTemplateError, load_chat_template

# Renders each message as [content] and nothing else: unlike any model's template.
BRACKETS_TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


def _serve_args(*argv: str) -> Any:
    return build_parser().parse_args(["serve", *argv])


def test_serve_flags_set_chat_template_names_and_remote_code(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(BRACKETS_TEMPLATE)
    config = serve_config(_serve_args("--chat-template", str(template), "--served-model-name", "a", "b/c",
                                      "--trust-remote-code", "--chat-template-timeout-s", "2"))
    assert config.server.chat_template == str(template)
    assert config.server.chat_template_timeout_s == 2.0
    assert config.server.served_model_name == ["a", "b/c"]
    assert config.model.trust_remote_code is True
    assert serve_config(_serve_args()).model.trust_remote_code is False


def test_one_served_name_as_a_string_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig.from_flat(served_model_name="m").server.served_model_name == ["m"]
    monkeypatch.setenv("PAGEDLLM_SERVER__SERVED_MODEL_NAME", "env-name")
    assert EngineConfig.load().server.served_model_name == ["env-name"]
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_flat(served_model_name=[])
    assert info.value.key == "server.served_model_name"


def test_chat_template_is_a_file_or_the_template_and_a_missing_path_is_an_error(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text(BRACKETS_TEMPLATE)
    assert load_chat_template(str(template)) == BRACKETS_TEMPLATE
    assert load_chat_template(BRACKETS_TEMPLATE) == BRACKETS_TEMPLATE
    assert load_chat_template("{{ 'a' }}\\n") == "{{ 'a' }}\n"  # inline escapes, as vLLM
    with pytest.raises(ConfigError) as info:
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert (info.value.key, info.value.value) == ("server.chat_template", str(tmp_path / "missing.jinja"))
    assert "looks like a path" in info.value.allowed


class _RecordingEngine(FakeEngine):
    """The fake engine, keeping the prompt ids each request reached it with."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.model_name = (config.server.served_model_name or ["fake"])[0]
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_token_ids: list[int], params: Any, request_id: str,
                       **kwargs: Any) -> AsyncGenerator[Any, None]:
        self.prompts.append(list(prompt_token_ids))
        async for output in super().generate(prompt_token_ids, params, request_id, **kwargs):
            yield output


def _requests(engine: FakeEngine, config: EngineConfig, calls: list[tuple[str, str, Any]]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(engine, config))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            return [await client.request(method, path, json=body) for method, path, body in calls]

    return asyncio.run(run())


def _chat(model: str | None = None, content: str = "hi") -> tuple[str, str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    return ("POST", "/v1/chat/completions", body if model is None else {**body, "model": model})


def test_chat_route_renders_the_operators_template() -> None:
    config = EngineConfig.load(server={"chat_template": BRACKETS_TEMPLATE})
    engine = _RecordingEngine(config)
    (response,) = _requests(engine, config, [_chat(content="hello")])
    assert response.status_code == 200, response.text
    assert engine.tokenizer.decode(engine.prompts[0]) == "[hello]"


def test_chat_without_any_template_is_a_400_naming_the_flag() -> None:
    config = EngineConfig.load()
    engine = _RecordingEngine(config)
    engine.tokenizer.chat_template = None
    response, completion = _requests(engine, config, [_chat(), ("POST", "/v1/completions", {"prompt": "hi"})])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template" and "--chat-template" in error["message"], error
    assert completion.status_code == 200 and engine.prompts  # completions need no template


def test_every_served_name_is_accepted_and_the_first_answers() -> None:
    config = EngineConfig.load(server={"served_model_name": ["first", "second"]})
    models, by_second, unknown = _requests(_RecordingEngine(config), config,
                                           [("GET", "/v1/models", None), _chat("second"), _chat("third")])
    assert [card["id"] for card in models.json()["data"]] == ["first", "second"]
    assert by_second.status_code == 200 and by_second.json()["model"] == "first"
    assert unknown.status_code == 404
    assert "`first`, `second`" in unknown.json()["error"]["message"]


def test_llm_chat_uses_llm_chat_template_and_refuses_without_any(tmp_path: Path) -> None:
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.engine.llm import LLM

    model = cached_tiny_model("llama", with_tokenizer=True, seed=1234)
    template = tmp_path / "brackets.jinja"
    template.write_text(BRACKETS_TEMPLATE)
    llm = LLM(model=str(model), dtype="float32", num_kv_blocks=32, chat_template=str(template))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    (output,) = llm.chat([{"role": "user", "content": "hey"}], params, use_tqdm=False)
    assert output.prompt == "[hey]"
    assert output.prompt_token_ids == llm.tokenizer.encode("[hey]", add_special_tokens=False)
    (own,) = llm.chat([{"role": "user", "content": "hey"}], params, use_tqdm=False, chat_template="<{{ 1 }}>")
    assert own.prompt == "<1>"
    llm.chat_template = None
    llm.tokenizer.chat_template = None
    with pytest.raises(MissingChatTemplateError) as info:
        llm.chat([{"role": "user", "content": "hey"}], params, use_tqdm=False)
    assert info.value.field == "chat_template" and "LLM(chat_template=...)" in info.value.limit
    with pytest.raises(ConfigError) as missing:
        LLM(model=str(model), chat_template=str(tmp_path / "nope.jinja"))
    assert missing.value.key == "chat_template"
