"""Random-weight Hugging Face checkpoints for the model suite, built from a
config.json: the architecture's own (``MODEL_CONFIGS``) or transformers'
config class for it shrunk to a few layers of width 64."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

# Small sizes every transformers config understands (through its attribute
# map where it names them otherwise, like GPT-2's n_embd).
TINY_SIZES: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)

# architecture -> a whole config.json, for architectures whose transformers
# defaults the shrinking above does not fit (plugin authors add theirs).
MODEL_CONFIGS: dict[str, dict[str, Any]] = {}

# architecture -> values over transformers' defaults besides TINY_SIZES:
# a few experts instead of 128, a window shorter than the suite's prompts,
# mechanisms that the defaults switch off (Granite's multipliers default to 1).
CONFIG_OVERRIDES: dict[str, dict[str, Any]] = {
    "GptOssForCausalLM": dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "Qwen3MoeForCausalLM": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
    ),
    "Qwen2MoeForCausalLM": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
    ),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
    "GraniteForCausalLM": dict(
        embedding_multiplier=8.0, residual_multiplier=0.3, attention_multiplier=1.5, logits_scaling=5.0
    ),
    # Latent attention of a few dims (defaults: 512 + 64), a dense first layer, 4 experts;
    # transformers' MLA takes num_key_value_heads as a GQA ratio: as many as the heads.
    "DeepseekV2ForCausalLM": dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, head_dim=8,  # transformers rotates head_dim dims: the RoPE part's
    ),
    "DeepseekV3ForCausalLM": dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=2, topk_group=1, head_dim=8,
    ),
}


def model_type_of(architecture: str) -> str | None:
    """The transformers model_type whose causal-LM class is ``architecture``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    candidates = [t for t, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if class_name == architecture]
    # Several model types may share a class (llama's); its own is the one it is named after.
    own = [t for t in candidates if architecture.lower().startswith(t.replace("_", "").replace("-", ""))]
    return next(iter(own or candidates), None)


def config_json(architecture: str, sizes: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The config.json of a small random model of ``architecture`` (of
    ``sizes`` instead of TINY_SIZES where given, and then from transformers'
    config class even if MODEL_CONFIGS lists it); None when neither
    MODEL_CONFIGS nor transformers knows the architecture."""
    if architecture in MODEL_CONFIGS and sizes is None:
        return dict(MODEL_CONFIGS[architecture])
    model_type = model_type_of(architecture)
    if model_type is None:
        return None
    from transformers import AutoConfig, AutoTokenizer

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(str(get_tokenizer_dir()))
    defaults = AutoConfig.for_model(model_type)
    # Only the sizes the architecture has: a stray num_key_value_heads would
    # be read by pagedllm and ignored by transformers. An override wins over a size.
    overrides = CONFIG_OVERRIDES.get(architecture, {})
    sizes = {key: value for key, value in (sizes or TINY_SIZES).items() if hasattr(defaults, key)
             and key not in overrides}
    config = AutoConfig.for_model(
        model_type, **sizes, **overrides, vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        # The tokenizer's, not a default past the small vocabulary (Phi-3's 32000).
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = [architecture]
    return config.to_dict()


def save_random_checkpoint(config: dict[str, Any], path: Path, seed: int = 0) -> Path:
    """transformers' model of ``config`` with random weights (float32,
    safetensors) and the shipped tokenizer, saved under ``path``."""
    import torch
    import transformers
    from transformers import AutoConfig

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    path.mkdir(parents=True, exist_ok=True)
    for item in Path(get_tokenizer_dir()).iterdir():
        if item.is_file():
            shutil.copy(item, path / item.name)
    (path / "config.json").write_text(json.dumps(config))
    hf_config = AutoConfig.from_pretrained(str(path))
    torch.manual_seed(seed)
    # The architecture's own class: several share a model_type's config.
    model_cls = getattr(transformers, config["architectures"][0])
    model = model_cls(hf_config).to(torch.float32)
    # Random but not tiny: layer norms' weights away from 1, so a norm that is skipped shows.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def hf_greedy(path: Path, prompt: list[int], num_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers, whole sequence each step (no cache), float32."""
    import torch
    import transformers

    config = json.loads((path / "config.json").read_text())
    model_cls = getattr(transformers, config["architectures"][0])
    model = model_cls.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num_new_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()
