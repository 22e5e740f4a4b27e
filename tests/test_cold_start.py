"""`pagedllm serve` starts without the imports it does not need. The engine
core reads the shipped model's config.json without transformers (AutoConfig
costs ~2 s). The API process starts the engine core without importing
torch (issue 17 point 4): torch costs ~0.85 s here, and the engine core
process imports it anyway, so importing it first only delays the start.
Checked in a fresh interpreter: the server's modules, resolving the shipped
model's name (what the API process does before it starts the core), and
loading its tokenizer (transformers' generic fast tokenizer, loaded without
AutoTokenizer, whose config machinery imports torch)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import pagedllm.entrypoints.cli
import pagedllm.entrypoints.openai.api_server
import pagedllm.engine.async_llm
from pagedllm.model_registry.model_source import resolve_model_path
from pagedllm.plugins import get_plugin_manager

print(resolve_model_path("tiny", get_plugin_manager()))
heavy = sorted(name for name in ("torch", "transformers", "xgrammar") if name in sys.modules)
print("heavy:", heavy)

from pagedllm.model_registry.tokenizer import load_tokenizer

tokenizer = load_tokenizer("tiny")
print(type(tokenizer).__name__, tokenizer.eos_token_id)
heavy = sorted(
    name for name in ("torch", "xgrammar", "transformers.configuration_utils", "transformers.models.auto")
    if name in sys.modules
)
print("heavy after the tokenizer:", heavy)
"""


def test_the_api_process_starts_the_engine_core_without_torch() -> None:
    completed = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    folder, heavy, tokenizer, heavy_after = completed.stdout.strip().splitlines()[-4:]
    assert folder.endswith("pagedllm-tiny")
    assert heavy == "heavy: []"
    assert tokenizer == "TokenizersBackend 1"
    assert heavy_after == "heavy after the tokenizer: []"


CORE_CHECK = """
import sys
from pagedllm.core.config import EngineConfig
from pagedllm.engine.core_proc import _build_engine, ready_message

parts = _build_engine(EngineConfig.from_flat(model="tiny", num_kv_blocks=64).model_dump_json(exclude={"server"}))
print(ready_message(parts).eos_token_id, type(parts.model.hf_config).__name__)
heavy = sorted(name for name in ("transformers", "xgrammar") if name in sys.modules)
print("heavy:", heavy)
parts.executor.shutdown()
"""


def test_the_engine_core_builds_the_shipped_model_without_transformers() -> None:
    # Its config.json is read directly (model_registry/plain_config.py), not by AutoConfig.
    completed = subprocess.run([sys.executable, "-c", CORE_CHECK], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    ready, heavy = completed.stdout.strip().splitlines()[-2:]
    assert ready == "1 PlainConfig"
    assert heavy == "heavy: []"


SERVE_ORDER_CHECK = """
import sys
import pagedllm.engine.core_start as core_start
from pagedllm.core.errors import PagedLLMError
from pagedllm.entrypoints.cli import main


def record(config, **kwargs):
    print("http stack imported:", sorted(name for name in ("fastapi", "uvicorn", "starlette") if name in sys.modules))
    raise PagedLLMError("stopped after the start of the engine core")


core_start.start_async_engine_core = record
print("exit code", main(["serve", "tiny", "--port", "0"]))
"""


def test_serve_starts_the_engine_core_before_importing_its_http_stack() -> None:
    # The core imports torch and loads the model while this process imports fastapi and uvicorn.
    completed = subprocess.run([sys.executable, "-c", SERVE_ORDER_CHECK], capture_output=True, text=True, timeout=120)
    assert completed.stdout.strip().splitlines()[-2:] == ["http stack imported: []", "exit code 1"], completed.stderr
    assert "stopped after the start of the engine core" in completed.stderr
