"""A config's RoPE parameters, read without torch (worker/model_facts.py
asks for the positions a model covers before anything is built).
layers/rotary.py computes the tables from them."""

from __future__ import annotations

from typing import Any

from pagedllm.core.errors import ConfigError

# rope types that read original_max_position_embeddings (transformers moves a
# top-level one of the config, Phi-3's, into the rope parameters).
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")


def get_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """rope_theta and scaling from either config layout.

    transformers 5 keeps them in ``rope_parameters`` ({rope_type, rope_theta,
    ...}); older configs use ``rope_theta`` plus an optional ``rope_scaling``.
    The legacy name "su" reads as "longrope"; a top-level
    ``partial_rotary_factor`` or ``original_max_position_embeddings`` joins
    the parameters as transformers' standardization does.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "su":
        params["rope_type"] = "longrope"
    partial_rotary_factor = getattr(hf_config, "partial_rotary_factor", None)
    if partial_rotary_factor is not None:
        params.setdefault("partial_rotary_factor", partial_rotary_factor)
    if params["rope_type"] in _ORIGINAL_LENGTH_TYPES:
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        elif getattr(hf_config, "max_position_embeddings", None) is not None:
            params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return params


def required_rope_parameter(rope_parameters: dict[str, Any], key: str) -> Any:
    value = rope_parameters.get(key)
    if value is None:
        rope_type = rope_parameters["rope_type"]
        raise ConfigError(f"rope_parameters.{key}", value, f"a value (rope_type {rope_type!r} needs it)")
    return value


def rope_position_limit(hf_config: Any) -> int | None:
    """The positions the model's rotary table covers: max_position_embeddings,
    times `factor` for dynamic NTK (whose point is to go past it)."""
    max_position = getattr(hf_config, "max_position_embeddings", None)
    if max_position is None:
        return None
    params = get_rope_parameters(hf_config)
    if params["rope_type"] == "dynamic":
        return int(max_position * required_rope_parameter(params, "factor"))
    return int(max_position)
