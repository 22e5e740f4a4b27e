"""Reading a model's generation_config.json (vLLM's `try_get_generation_config`).

    defaults = load_generation_defaults(model_folder, config.model, hf_config, vocab_size)
    defaults.sampling              # {"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}
    defaults.extra_eos_token_ids   # [128008, 128009]: stop besides config.json's first EOS

`model.generation_config` names the file: "auto" and "vllm" the model
folder's (with "vllm" only its eos ids count), else the folder given. The
values are checked where they enter (core/generation_config.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.generation_config import GenerationDefaults, eos_token_ids, sampling_defaults
from pagedllm.model_registry.tokenizer import config_eos_token_id

if TYPE_CHECKING:
    from pagedllm.core.config import ModelConfig

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"


def generation_config_folder(model_folder: str, setting: str) -> str:
    """The folder whose generation_config.json applies."""
    return model_folder if setting in ("auto", "vllm") else setting


def read_generation_config(folder: str, required: bool) -> dict[str, Any]:
    """The file's values; {} when the folder has none (unless `required`:
    a ConfigError naming model.generation_config)."""
    path = Path(folder) / GENERATION_CONFIG_FILE
    if not path.is_file():
        if required:
            raise ConfigError("model.generation_config", folder, f"a folder holding a {GENERATION_CONFIG_FILE}")
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError("model.generation_config", str(path), f"a readable JSON file ({exc})") from None
    if not isinstance(values, dict):
        raise ConfigError("model.generation_config", str(path), "a JSON object of generation settings")
    return values


def generation_sampling_defaults(model_folder: str, model_config: ModelConfig) -> dict[str, float | int]:
    """The sampling defaults: the file's values under the overrides (the
    overrides alone with "vllm"). A bad value is a ConfigError naming the
    file or model.override_generation_config, and the key. The front ends
    call it before the engine core starts, so a mistake fails at once."""
    setting = model_config.generation_config
    file_values = {} if setting == "vllm" else _file_values(model_folder, setting)
    sampling_defaults(file_values, _source(model_folder, setting))
    sampling_defaults(model_config.override_generation_config, "model.override_generation_config")
    return sampling_defaults({**file_values, **model_config.override_generation_config},
                             "model.override_generation_config")


def load_generation_defaults(
    model_folder: str, model_config: ModelConfig, hf_config: Any, vocab_size: int
) -> GenerationDefaults:
    """The sampling defaults and every EOS id past config.json's first one."""
    setting = model_config.generation_config
    sampling = generation_sampling_defaults(model_folder, model_config)
    file_values = _file_values(model_folder, setting)
    source = _source(model_folder, setting)
    primary = config_eos_token_id(hf_config)
    candidates = [
        *eos_token_ids(getattr(hf_config, "eos_token_id", None), "config.json"),
        *eos_token_ids(file_values.get("eos_token_id"), source),
    ]
    extra: list[int] = []
    for token_id in candidates:
        if token_id == primary or token_id in extra:
            continue
        if token_id >= vocab_size:  # never sampled: nothing to stop on
            logger.warning("EOS id %d is outside the vocabulary (%d tokens); ignored", token_id, vocab_size)
            continue
        extra.append(token_id)
    return GenerationDefaults(sampling=sampling, extra_eos_token_ids=extra)


def _file_values(model_folder: str, setting: str) -> dict[str, Any]:
    return read_generation_config(generation_config_folder(model_folder, setting),
                                  required=setting not in ("auto", "vllm"))


def _source(model_folder: str, setting: str) -> str:
    return f"{generation_config_folder(model_folder, setting)}/{GENERATION_CONFIG_FILE}"



def log_generation_defaults(model_config: ModelConfig, sampling: dict[str, float | int]) -> None:
    """One start-up line when the defaults differ from the engine's (as vLLM's)."""
    if not sampling:
        return
    setting = model_config.generation_config
    source = {"auto": "the model's generation_config.json", "vllm": "override_generation_config"}.get(
        setting, f"{setting}/{GENERATION_CONFIG_FILE}"
    )
    hint = "" if setting == "vllm" else "; start with --generation-config vllm for the engine's own defaults"
    logger.info("Default sampling parameters have been overridden by %s: %s%s", source, sampling, hint)
