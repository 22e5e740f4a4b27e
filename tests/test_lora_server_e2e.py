"""LoRA adapters through a real `pagedllm serve` (127.0.0.1, a free port,
stopped by pid): greedy tokens of start-up and runtime-loaded adapters
equal transformers + PEFT in float32, also three adapters and the base
model at once, and other weights loaded under a name used before never
hit the old weights' cached KV."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.lora_adapters import peft_greedy, write_peft_adapter
from helpers.server import ServerProcess, start_server

from pagedllm.testing.checkpoints import config_json, save_random_checkpoint

API_KEY = "e2e-key"
BLOCK_SIZE = 4
PROMPT = [5, 17, 99, 3, 42, 8, 61, 27, 14, 33]  # two full blocks before the last token
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_checkpoint(config_json("LlamaForCausalLM"), tmp_path_factory.mktemp("lora-e2e") / "base")


@pytest.fixture(scope="module")
def adapters(base: Path) -> dict[str, Path]:
    root = base.parent
    return {
        "sql": write_peft_adapter(base, root / "sql", rank=4, target_modules=["q_proj", "v_proj"], seed=1),
        "chat": write_peft_adapter(base, root / "chat", rank=8, target_modules=["o_proj", "down_proj"], seed=2),
        "retrained": write_peft_adapter(base, root / "retrained", rank=8, target_modules=["o_proj", "down_proj"],
                                        seed=3),
    }


@pytest.fixture(scope="module")
def server(base: Path, adapters: dict[str, Path]) -> Iterator[ServerProcess]:
    with start_server(
        base, "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "64", "--enable-lora",
        "--max-loras", "3", "--max-lora-rank", "8", "--allow-runtime-lora-updating",
        "--lora-modules", f"sql={adapters['sql']}", api_key=API_KEY,
    ) as srv:
        yield srv


def _complete(server: ServerProcess, model: str) -> dict[str, Any]:
    response = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
        "skip_special_tokens": False,
    })
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _text(body: dict[str, Any]) -> str:
    return str(body["choices"][0]["text"])


def _peft_text(base: Path, adapter: Path | None) -> str:
    """transformers + PEFT's greedy continuation, as text."""
    from transformers import AutoTokenizer

    tokens = peft_greedy(base, adapter, [PROMPT], MAX_TOKENS)[0]
    return str(AutoTokenizer.from_pretrained(str(base)).decode(tokens, skip_special_tokens=False))


def _cached(body: dict[str, Any]) -> int:
    return int(((body.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _post(server: ServerProcess, path: str, body: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", headers=server.headers, json=body, timeout=60)


def test_startup_adapter_and_base_match_peft(server: ServerProcess, base: Path, adapters: dict[str, Path]) -> None:
    assert _text(_complete(server, "sql")) == _peft_text(base, adapters["sql"])
    base_body = _complete(server, server_model(server))
    assert _text(base_body) == _peft_text(base, None)
    assert _cached(base_body) == 0  # the adapter's blocks are not the base model's


def test_reloading_other_weights_under_a_name_never_hits_the_old_kv(
    server: ServerProcess, base: Path, adapters: dict[str, Path]
) -> None:
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "tmp", "lora_path": str(adapters["chat"])}).is_success
    first = _complete(server, "tmp")
    again = _complete(server, "tmp")
    assert _text(first) == _text(again) == _peft_text(base, adapters["chat"])
    assert _cached(again) == 2 * BLOCK_SIZE  # the same adapter hits its own blocks
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "tmp"}).is_success
    assert _post(server, "/v1/load_lora_adapter",
                 {"lora_name": "tmp", "lora_path": str(adapters["retrained"])}).is_success
    reloaded = _complete(server, "tmp")
    assert _cached(reloaded) == 0
    assert _text(reloaded) == _peft_text(base, adapters["retrained"])


def test_three_adapters_and_the_base_at_once_match_peft(
    server: ServerProcess, base: Path, adapters: dict[str, Path]
) -> None:
    for name in ("chat-c", "retrained-c"):
        path = adapters[name.removesuffix("-c")]
        assert _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}).is_success
    models = ["sql", "chat-c", "retrained-c", server_model(server)]
    with ThreadPoolExecutor(len(models)) as pool:  # concurrent: the engine batches them together
        texts = list(pool.map(lambda model: _text(_complete(server, model)), models))
    assert texts == [_peft_text(base, adapters["sql"]), _peft_text(base, adapters["chat"]),
                     _peft_text(base, adapters["retrained"]), _peft_text(base, None)]
    for name in ("chat-c", "retrained-c"):
        assert _post(server, "/v1/unload_lora_adapter", {"lora_name": name}).is_success


def server_model(server: ServerProcess) -> str:
    models = httpx.get(f"{server.base_url}/v1/models", headers=server.headers, timeout=30).json()["data"]
    return str(next(card["id"] for card in models if card.get("lora_digest") is None))
