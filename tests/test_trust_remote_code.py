"""A checkpoint's own Python code (auto_map in config.json or
tokenizer_config.json) is never imported without --trust-remote-code, and
the refusal names the flag; with it, transformers imports the code."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.loader import load_hf_config
from pagedllm.model_registry.remote_code import RemoteCodeError
from pagedllm.model_registry.tiny import get_tokenizer_dir
from pagedllm.model_registry.tokenizer import load_tokenizer

# A module that records its own import in the file SENTINEL names, then defines the class.
SENTINEL_MODULE = """
from pathlib import Path
Path({sentinel!r}).write_text("imported")
import transformers
class {name}(transformers.{base}):
    {body}
"""


@pytest.fixture(autouse=True)
def _own_modules_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers copies remote code into its modules cache: a fresh one
    per test, off the user's home, and sys.path as it was."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))


def _remote_config_checkpoint(folder: Path, sentinel: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "sentinel_lm", "architectures": ["SentinelForCausalLM"], "hidden_size": 64,
        "auto_map": {"AutoConfig": "configuration_sentinel.SentinelConfig"},
    }))
    (folder / "configuration_sentinel.py").write_text(SENTINEL_MODULE.format(
        sentinel=str(sentinel), name="SentinelConfig", base="PretrainedConfig", body='model_type = "sentinel_lm"'))
    return folder


def _remote_tokenizer_checkpoint(folder: Path, sentinel: Path) -> Path:
    shutil.copytree(get_tokenizer_dir(), folder)
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.update(tokenizer_class="SentinelTokenizer",
                            auto_map={"AutoTokenizer": [None, "tokenization_sentinel.SentinelTokenizer"]})
    config_path.write_text(json.dumps(tokenizer_config))
    (folder / "tokenization_sentinel.py").write_text(SENTINEL_MODULE.format(
        sentinel=str(sentinel), name="SentinelTokenizer", base="PreTrainedTokenizerFast", body="pass"))
    return folder


def test_config_code_is_not_imported_without_the_flag(tmp_path: Path) -> None:
    sentinel = tmp_path / "sentinel"
    checkpoint = _remote_config_checkpoint(tmp_path / "ckpt", sentinel)
    with pytest.raises(RemoteCodeError) as info:
        load_hf_config(checkpoint)
    assert "--trust-remote-code" in str(info.value) and "LLM(trust_remote_code=True)" in str(info.value)
    assert not sentinel.exists()
    config = load_hf_config(checkpoint, trust_remote_code=True)
    assert type(config).__name__ == "SentinelConfig" and sentinel.read_text() == "imported"


def test_tokenizer_code_is_not_imported_without_the_flag(tmp_path: Path) -> None:
    sentinel = tmp_path / "sentinel"
    checkpoint = _remote_tokenizer_checkpoint(tmp_path / "tok", sentinel)
    with pytest.raises(RemoteCodeError) as info:
        load_tokenizer(str(checkpoint))
    assert "--trust-remote-code" in str(info.value)
    assert not sentinel.exists()
    tokenizer = load_tokenizer(str(checkpoint), trust_remote_code=True)
    assert type(tokenizer).__name__ == "SentinelTokenizer" and sentinel.read_text() == "imported"


def test_llm_flag_reaches_the_engine_that_reads_the_checkpoint(tmp_path: Path) -> None:
    from pagedllm.engine.llm import LLM
    from pagedllm.model_registry.model_impl import UnsupportedArchitectureError

    sentinel = tmp_path / "sentinel"
    checkpoint = _remote_config_checkpoint(tmp_path / "ckpt", sentinel)
    with pytest.raises(RemoteCodeError):
        LLM(model=str(checkpoint))
    assert not sentinel.exists()
    # Trusted, the config's code runs; the architecture it names has no implementation here.
    with pytest.raises(UnsupportedArchitectureError) as info:
        LLM(model=str(checkpoint), trust_remote_code=True)
    assert sentinel.exists()
    assert isinstance(info.value, ConfigError) and info.value.value == "SentinelForCausalLM"
