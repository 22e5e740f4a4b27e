"""EAGLE-3 (Li et al., 2025): an EAGLE head that reads features from several
target layers and predicts over its own (smaller) draft vocabulary.

At position p the head reads the token at p + 1 and the target's hidden
states entering layers l_1..l_n (the residual stream, before each layer):

    g_p = fc([a_p^{l_1}; ...; a_p^{l_n}])                  # [n*H] -> [H]
    x_p = [input_norm(embed(token_{p+1})); hidden_norm(g_p)]   # [2H]
    r_p = o_proj(Attention(q/k/v_proj(x_p))) + g_p           # q/k/v read 2H
                                        # (+ hidden_norm(g_p) with norm_before_residual)
    f_p = mlp(post_attention_norm(r_p)) + r_p              # fed back as the next g
    logits_{p+2} = scatter_{d2t}(lm_head(norm(f_p)))         # draft vocab -> target vocab

and drafts further by feeding f_p (before the final norm) back in place of
g. The layers l default to (2, L // 2, L - 3) for a target of L layers, as
in vLLM; a checkpoint's `eagle_config.eagle_aux_hidden_state_layer_ids`
(or the same key at the top level of config.json) chooses others.

Checkpoints are vLLM's / SpecForge's layout (`LlamaForCausalLMEagle3`,
config.json in Llama form with `draft_vocab_size`): `fc.weight` [H, n*H],
`midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v}_proj.weight` [*, 2H], `midlayer.self_attn.o_proj`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight`
[draft_vocab, H], `d2t` [draft_vocab] (target id = draft id + d2t[draft id];
required when the draft vocabulary is smaller than the target's), and
optionally `t2d` (ignored) and `embed_tokens.weight` (used when present,
else the target's embedding is shared). A "model." prefix is accepted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.layers.linear import QKVParallelLinear, ReplicatedLinear
from pagedllm.model_registry.layers.norm import RMSNorm
from pagedllm.model_registry.layers.rotary import RotaryEmbedding, get_rope_parameters
from pagedllm.model_registry.loader import ModelLoadError, iterate_safetensors
from pagedllm.model_registry.models.llama import LlamaDecoderLayer, LlamaFlags
from pagedllm.spec_decode.draft_vocab import check_d2t, draft_vocab_size, to_target_logits
from pagedllm.spec_decode.eagle import EagleDrafter, load_head_weight, target_embedding
from pagedllm.spec_decode.model_drafter import ModelDrafter, load_draft_hf_config

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata
    from pagedllm.core.config import SpeculativeConfig
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.model_registry.layers.attention import Attention
    from pagedllm.spec_decode.interface import DrafterContext, TargetStep


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice: an early, a middle and a late layer."""
    return (2, num_layers // 2, num_layers - 3)


def aux_layer_ids(hf_config: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads (checked against the target)."""
    eagle_config = getattr(hf_config, "eagle_config", None) or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") or getattr(
        hf_config, "eagle_aux_hidden_state_layer_ids", None
    )
    layer_ids = tuple(int(i) for i in ids) if ids else default_aux_layer_ids(num_target_layers)
    if not all(0 <= i < num_target_layers for i in layer_ids):
        raise ConfigError(
            "speculative.model (eagle_aux_hidden_state_layer_ids)", list(layer_ids),
            f"layer ids in [0, {num_target_layers}) of the target",
        )
    return layer_ids


class Eagle3Head(nn.Module):
    d2t: torch.Tensor  # [draft_vocab] long buffer: target id - draft id

    def __init__(
        self, hf_config: Any, num_aux_layers: int, attn_backend: type[AttentionBackend],
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        hidden_size = hf_config.hidden_size
        eps = hf_config.rms_norm_eps
        self.vocab_size = hf_config.vocab_size
        self.draft_vocab_size = draft_vocab_size(hf_config)
        # vLLM's option: the attention's residual is the normed feature.
        self.norm_before_residual = bool(getattr(hf_config, "norm_before_residual", False))
        self.fc = ReplicatedLinear(num_aux_layers * hidden_size, hidden_size, bias=False)
        layer = LlamaDecoderLayer(hf_config, LlamaFlags(), 0, attn_backend)
        attn = layer.self_attn
        # q/k/v read the embedding and the feature side by side.
        attn.add_module("qkv_proj", QKVParallelLinear(
            2 * hidden_size, attn.head_dim, hf_config.num_attention_heads,
            getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            bool(getattr(hf_config, "attention_bias", False)),
        ))
        layer.add_module("hidden_norm", RMSNorm(hidden_size, eps=eps))
        self.midlayer = layer
        self.norm = RMSNorm(hidden_size, eps=eps)
        self.lm_head = ReplicatedLinear(hidden_size, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: nn.Embedding | None = None  # set when the checkpoint has its own
        self.rotary_emb = RotaryEmbedding(attn.head_dim, hf_config.max_position_embeddings,
                                          get_rope_parameters(hf_config))
        self.to(dtype)

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, n*H] target features -> [T, H]."""
        return self.fc(aux_hidden_states)

    def forward(
        self,
        input_embeds: torch.Tensor,  # [T, H] embedding of the next tokens
        hidden_states: torch.Tensor,  # [T, H] combined target features, or the previous f
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(f), f), [T, H] each
        layer = cast(Any, self.midlayer)
        hidden_states = hidden_states.to(input_embeds.dtype)
        normed_hidden = layer.hidden_norm(hidden_states)
        x = torch.cat([layer.input_layernorm(input_embeds), normed_hidden], dim=-1)
        cos, sin = self.rotary_emb(positions)
        # NOTE: residual sums spelled out: a fused norm may update its residual in place.
        residual = layer.self_attn(x, cos, sin, attn_metadata) + (
            normed_hidden if self.norm_before_residual else hidden_states
        )
        features = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.norm(features), features

    def compute_draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, H] -> float32 logits over the draft vocabulary [N, draft_vocab]."""
        return self.lm_head(normed).float()

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[N, draft_vocab] -> [N, vocab]: -inf where no draft token maps."""
        if self.draft_vocab_size == self.vocab_size and not bool(self.d2t.any()):
            return draft_logits
        targets = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        return to_target_logits(draft_logits, targets, self.vocab_size)

    def get_attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def load_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]], model_path: str) -> None:
        """Strict: every parameter loaded, nothing unknown; d2t required
        when the draft vocabulary is smaller than the target's."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
                continue
            if name in ("d2t", "embed_tokens.weight"):
                self._load_extra(name, tensor, model_path)
                loaded.add(name)
                continue
            param_name = load_head_weight(params, name, tensor, model_path)
            if param_name is None:
                unexpected.append(name)
            else:
                loaded.add(param_name)
        missing = set(params) - loaded
        if self.draft_vocab_size != self.vocab_size and "d2t" not in loaded:
            missing.add("d2t")
        if missing or unexpected:
            raise ModelLoadError(model_path, missing=missing, unexpected=unexpected)
        check_d2t(self.d2t, self.draft_vocab_size, self.vocab_size, model_path)

    def _load_extra(self, name: str, tensor: torch.Tensor, model_path: str) -> None:
        if name == "d2t":
            check_d2t(tensor, self.draft_vocab_size, self.vocab_size, model_path)
            self.d2t.copy_(tensor.to(torch.long))
            return
        embed = nn.Embedding(tensor.shape[0], tensor.shape[1], device=self.d2t.device, dtype=self.fc.weight.dtype)
        embed.weight.data.copy_(tensor)
        self.embed_tokens = embed.requires_grad_(False)


class Eagle3Drafter(EagleDrafter):
    method = "eagle3"

    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        ModelDrafter.__init__(self, config, context)
        path, hf_config = load_draft_hf_config(config, self.method)
        target = context.target_model
        self.target = cast("ModelForCausalLM", target)
        self.embed_tokens = self._check_target(config, hf_config, target)
        layer_ids = aux_layer_ids(hf_config, len(cast(Any, target).model.layers))
        try:
            self.target.set_aux_hidden_state_layers(layer_ids)
        except NotImplementedError:  # the interface's default: the model keeps none
            raise ConfigError(
                "speculative.method", "eagle3",
                f"a target model that keeps auxiliary hidden states (Llama family; not {type(target).__name__})",
            ) from None
        with torch.device(context.device):
            self.eagle3_head = Eagle3Head(hf_config, len(layer_ids), context.attn_backend, dtype=context.dtype)
        self.eagle3_head.load_checkpoint(iterate_safetensors(path), path)
        self.eagle3_head.eval()
        if self.eagle3_head.embed_tokens is not None:
            self.embed_tokens = self.eagle3_head.embed_tokens
        self.kv_caches = self._allocate_kv_caches(self.eagle3_head)
        self.draft_feature_size = hf_config.hidden_size

    def _check_target(self, config: SpeculativeConfig, hf_config: Any, target: nn.Module) -> Any:
        """The target's embedding, after checking the head fits the target."""
        embed = target_embedding(config, hf_config, target, "EAGLE-3 head")
        draft_vocab = getattr(hf_config, "draft_vocab_size", None) or hf_config.vocab_size
        if hf_config.vocab_size != self.context.vocab_size or draft_vocab > hf_config.vocab_size:
            raise ConfigError(
                "speculative.model", config.model,
                f"an EAGLE-3 head for vocab size {self.context.vocab_size} with draft_vocab_size <= it "
                f"(this one: vocab_size {hf_config.vocab_size}, draft_vocab_size {draft_vocab})",
            )
        return embed

    def _target_features(self, step: TargetStep, rows: torch.Tensor) -> torch.Tensor:
        if step.aux_hidden_states is None:
            raise ValueError("the eagle3 drafter needs the target's auxiliary hidden states")
        return self.eagle3_head.combine_hidden_states(step.aux_hidden_states[rows])

    def _run_head(
        self, tokens: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.eagle3_head(self.embed_tokens(tokens), hidden_states, positions, attn_metadata)

    def _compute_logits(self, outputs: torch.Tensor) -> torch.Tensor:
        head = self.eagle3_head
        return head.to_target_logits(head.compute_draft_logits(outputs))
