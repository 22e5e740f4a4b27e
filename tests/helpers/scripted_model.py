"""A checkpoint of the test plugin's scripted model (TestScriptedForCausalLM,
tests/plugins/pagedllm-test-plugin/pagedllm_test_plugin/scripted.py) with
the shipped tokenizer plus added tokens (``<think>``, ``</think>``, ...).

    chain = encode("<think>Let me think.</think>hello")
    path = build_scripted_model(tmp, ["<think>", "</think>"], script={...}, default=[...])

The script maps a token id to its preferred next ids; `chain_script` turns a
sequence of distinct ids into such a table.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from helpers.tiny_models import build_tiny_model


def scripted_tokenizer(path: Path, added_tokens: Sequence[str]) -> Any:
    """The shipped tokenizer with `added_tokens` (not special: they stay in
    decoded text), saved under `path`."""
    from transformers import AutoTokenizer

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    path.mkdir(parents=True, exist_ok=True)
    for item in Path(get_tokenizer_dir()).iterdir():
        if item.is_file():
            shutil.copy(item, path / item.name)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens(list(added_tokens))
    tokenizer.save_pretrained(str(path))
    return tokenizer


def chain_script(token_ids: Sequence[int], end: Sequence[int]) -> dict[int, list[int]]:
    """Each token of `token_ids` -> the next one; the last -> `end`. The ids
    must be distinct (the script is keyed by the current token only)."""
    assert len(set(token_ids)) == len(token_ids), f"a scripted chain needs distinct tokens: {list(token_ids)}"
    script = {token: [following] for token, following in itertools.pairwise(token_ids)}
    script[token_ids[-1]] = list(end)
    return script


def build_scripted_model(
    path: Path, added_tokens: Sequence[str], script: dict[int, list[int]], default: Sequence[int]
) -> Path:
    tokenizer = scripted_tokenizer(path, added_tokens)
    build_tiny_model(
        "llama", path, num_hidden_layers=1, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["TestScriptedForCausalLM"]
    config["script"] = {str(token): choices for token, choices in script.items()}
    config["script_default"] = list(default)
    config_path.write_text(json.dumps(config, indent=2))
    return path
