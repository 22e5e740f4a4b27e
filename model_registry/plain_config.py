"""config.json of a known architecture, read without transformers.

transformers' AutoConfig costs ~2 s of an engine core's start (its lazy
import machinery, the configuration module's own imports); the engine core
needs only the values. For the model types here, `read_plain_config` gives
what AutoConfig would: config.json over the architecture's defaults (copied
from transformers' configuration class; tests/test_plain_config.py compares
every attribute with AutoConfig's), with the same derived fields. Anything
transformers rewrites in ways not mirrored here (legacy `rope_scaling`, a
rope type other than the default, custom code, quantization configs) returns
None, and the caller uses AutoConfig.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# transformers' LlamaConfig field defaults (transformers 5).
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "head_dim": None,
}
KNOWN_DEFAULTS: dict[str, dict[str, Any]] = {"llama": LLAMA_DEFAULTS}
# transformers' default rotary base when config.json gives none.
DEFAULT_ROPE_THETA = 10000.0
# Keys whose presence means transformers does more than this module mirrors.
UNMIRRORED_KEYS = frozenset({"rope_scaling", "auto_map", "quantization_config", "text_config"})


class PlainConfig:
    """A stand-in for a transformers config: the values as attributes."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    @property
    def name_or_path(self) -> str:
        return str(self.__dict__.get("_name_or_path", ""))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"PlainConfig({self.__dict__!r})"


def read_plain_config(model_path: str | Path) -> PlainConfig | None:
    """config.json of `model_path` as AutoConfig would read it, or None when
    its model type or contents need transformers."""
    path = Path(model_path)
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # AutoConfig reports it
    if not isinstance(raw, dict) or UNMIRRORED_KEYS & raw.keys():
        return None
    defaults = KNOWN_DEFAULTS.get(raw.get("model_type", ""))
    rope = raw.get("rope_parameters")
    default_rope = rope is None or (isinstance(rope, dict) and rope.get("rope_type", "default") == "default")
    if defaults is None or not default_rope:
        return None
    values: dict[str, Any] = {"architectures": None, **defaults, **raw, "_name_or_path": str(path)}
    values["dtype"] = _torch_dtype(values.pop("torch_dtype", None) if values.get("dtype") is None else values["dtype"])
    values.pop("torch_dtype", None)
    rope_theta = values.pop("rope_theta", None)
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta or DEFAULT_ROPE_THETA, **(rope or {})}
    if values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values["hidden_size"] % values["num_attention_heads"]:
        # transformers' own check (LlamaConfig.validate_architecture)
        raise ValueError(
            f"The hidden size ({values['hidden_size']}) is not a multiple of the number of attention "
            f"heads ({values['num_attention_heads']})."
        )
    return PlainConfig(values)


def _torch_dtype(name: Any) -> Any:
    """config.json's dtype name as a torch dtype (transformers does the same)."""
    if not isinstance(name, str):
        return name
    import torch

    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else name
