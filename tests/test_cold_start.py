"""`pagedllm serve`'s API process starts the engine core without importing
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
from pagedllm.engine.model_source import resolve_model_path
from pagedllm.plugins import get_plugin_manager

print(resolve_model_path("tiny", get_plugin_manager()))
heavy = sorted(name for name in ("torch", "transformers", "xgrammar") if name in sys.modules)
print("heavy:", heavy)

from pagedllm.engine.tokenizer import load_tokenizer

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
