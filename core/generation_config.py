"""A model's generation config as sampling defaults and stop tokens (vLLM's
`get_diff_sampling_param` and `update_from_generation_config`).

`generation_config.json` (Hugging Face's GenerationConfig, saved beside
config.json) recommends sampling values and lists every end-of-sequence id.
The values below become the defaults of the fields a request leaves unset;
the request's own values always win. `model.override_generation_config`
is merged over the file's values (and applies with `generation_config="vllm"`
too, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.core.int_limits import INT64_MAX
from pagedllm.core.sampling_params import SamplingParams

# The generation-config keys that become sampling defaults (vLLM's set);
# Hugging Face's max_new_tokens is vLLM's max_tokens.
SAMPLING_DEFAULT_KEYS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


class GenerationDefaults(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the engine core tells the front ends about the generation config."""

    # SamplingParams field -> default for requests that leave it unset.
    sampling: dict[str, float | int] = {}
    # Every end-of-sequence id besides the primary one (config.json's first
    # eos_token_id): the rest of config.json's list and the generation
    # config's. Each stops generation unless ignore_eos.
    extra_eos_token_ids: list[int] = []


def sampling_defaults(values: Mapping[str, Any], source: str) -> dict[str, float | int]:
    """The sampling defaults among a generation config's `values` (None
    values are unset), checked as SamplingParams checks a request; a bad one
    is a ConfigError naming `source`.key, the value and the limit."""
    defaults = {key: values[key] for key in SAMPLING_DEFAULT_KEYS if values.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    for key, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}.{_hf_name(key)}", value, "a number")
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as exc:
        raise ConfigError(f"{source}.{_hf_name(exc.field)}", exc.value, exc.limit) from None
    return defaults


def eos_token_ids(value: Any, source: str) -> list[int]:
    """An `eos_token_id` entry (an id, a list of ids, or None) as a list."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= INT64_MAX:
            raise ConfigError(f"{source}.eos_token_id", value, "a token id or a list of token ids (integers >= 0)")
    return list(ids)


def _hf_name(field: str) -> str:
    return "max_new_tokens" if field == "max_tokens" else field
