"""transformers' side of the fallback's decisions (transformers imported when called): whether
transformers knows an architecture as a causal LM, and its config."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def transformers_config(hf_config: Any) -> PretrainedConfig:
    """A private transformers config for building the model (transformers
    writes dtype and attention implementation into it): a copy of
    `hf_config`, or AutoConfig's for a plain config read without transformers."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(hf_config, PretrainedConfig):
        return copy.deepcopy(hf_config)
    # NOTE: a plain config never has an auto_map (plain_config.UNMIRRORED_KEYS),
    # so no remote code is needed here, and none is ever imported.
    return AutoConfig.from_pretrained(hf_config.name_or_path, local_files_only=True, trust_remote_code=False)


def causal_lm_class(architecture: str) -> type[PreTrainedModel] | None:
    """transformers' class for `architecture` when it is a causal LM
    transformers knows (a decoder with an LM head), else None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if architecture not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return None
    import transformers

    return cast("type[PreTrainedModel] | None", getattr(transformers, architecture, None))
