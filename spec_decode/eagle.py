"""EAGLE-1 (Li et al., 2024): a one-layer head that extrapolates the target's
features.

At position p the head reads the token at p + 1 and the target's last hidden
state (after its final norm) at p:

    x_p = fc([embed(token_{p+1}); h_p])            # [2H] -> [H]
    f_p = DecoderLayer(x_p)  (no input norm: h is already normalized)
    logits_{p+2} = target.lm_head(f_p)

and drafts further by feeding its own f_p back as the next h. The embedding
and lm_head are the target's. Checkpoints are Hugging Face EAGLE folders
(config.json in Llama form + safetensors): `fc.weight` [H, 2H] (`fc.bias`
optional), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight`,
`layers.0.post_attention_layernorm.weight`; an `embed_tokens.weight` or
`lm_head.weight` copy is ignored (the target's are used).

A head may score a reduced draft vocabulary (spec_decode/draft_vocab.py:
`draft_vocab_size` in config.json, a `d2t` tensor among its weights): its
draft logits are then the target's lm_head rows of those tokens only (a
copy gathered once at load, draft_vocab x H), FR-Spec's (Zhao et al., 2025)
cut of the lm_head, which is the largest part of a small head's draft step.

Like the draft model, the head keeps a paged KV cache with the target's
geometry, addressed by the same block tables, and mirrors every target row.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.input_batch import InputBatch
from pagedllm.model_registry.layers.linear import ReplicatedLinear
from pagedllm.model_registry.layers.rotary import RotaryEmbedding, get_rope_parameters
from pagedllm.model_registry.layers.vocab_parallel_embedding import ParallelLMHead
from pagedllm.model_registry.loader import ModelLoadError, default_weight_loader, iterate_safetensors
from pagedllm.model_registry.models.llama import LlamaDecoderLayer, LlamaFlags, LlamaForCausalLM
from pagedllm.spec_decode.draft_vocab import D2T, T2D, check_d2t, draft_vocab_size, to_target_logits
from pagedllm.spec_decode.model_drafter import DraftStart, ModelDrafter, load_draft_hf_config

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata
    from pagedllm.core.config import SpeculativeConfig
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.model_registry.layers.attention import Attention
    from pagedllm.spec_decode.interface import DrafterContext, DraftInputs, TargetStep

# Checkpoint entries that belong to the target (the head shares them).
_SHARED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")


class EagleHead(nn.Module):
    # [draft_vocab] long: target id - draft id (a reduced draft vocabulary only)
    d2t: torch.Tensor

    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend], dtype: torch.dtype = torch.float32):
        super().__init__()
        hidden_size = hf_config.hidden_size
        self.vocab_size = hf_config.vocab_size
        self.draft_vocab_size = draft_vocab_size(hf_config)
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError("speculative.model (draft_vocab_size)", self.draft_vocab_size,
                              f"at most the head's vocab_size {self.vocab_size}")
        # The target's lm_head rows of the draft vocabulary (set by
        # `set_draft_lm_head`); None: the target's whole lm_head scores drafts.
        self.lm_head: ReplicatedLinear | None = None
        if self.draft_vocab_size < self.vocab_size:
            self.lm_head = ReplicatedLinear(hidden_size, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        # A LinearBase, so the platform's GEMM (prepacked on a CPU) runs it.
        self.fc = ReplicatedLinear(2 * hidden_size, hidden_size, bias=bool(getattr(hf_config, "bias", False)))
        layers = [
            LlamaDecoderLayer(hf_config, LlamaFlags(), i, attn_backend) for i in range(hf_config.num_hidden_layers)
        ]
        # NOTE: EAGLE drops the first layer's input norm (its input is built
        # from the target's already normalized features).
        layers[0].add_module("input_layernorm", nn.Identity())
        self.layers = nn.ModuleList(layers)
        head_dim = layers[0].self_attn.head_dim
        self.rotary_emb = RotaryEmbedding(head_dim, hf_config.max_position_embeddings, get_rope_parameters(hf_config))
        self.to(dtype)

    def forward(
        self,
        input_embeds: torch.Tensor,  # [T, H] target embedding of the next tokens
        hidden_states: torch.Tensor,  # [T, H] target (or previous head) features
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = self.fc(torch.cat([input_embeds, hidden_states.to(input_embeds.dtype)], dim=-1))
        cos, sin = self.rotary_emb(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, cos, sin, attn_metadata, residual)
        return x if residual is None else x + residual

    def get_attention_layers(self) -> list[Attention]:
        return [cast(LlamaDecoderLayer, layer).self_attn.attn for layer in self.layers]

    def draft_target_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of each draft token."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_draft_lm_head(self, target_lm_head_weight: torch.Tensor) -> None:
        """Copy the target's lm_head rows [vocab, H] of the draft vocabulary."""
        assert self.lm_head is not None  # NOTE: only a head with a reduced draft vocabulary has one
        with torch.no_grad():
            self.lm_head.weight.copy_(target_lm_head_weight[self.draft_target_ids()])

    def compute_draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[N, H] -> float32 logits over the target vocabulary, -inf outside
        the draft vocabulary (only its rows of the lm_head are computed)."""
        assert self.lm_head is not None  # NOTE: only a head with a reduced draft vocabulary has one
        return to_target_logits(self.lm_head(features).float(), self.draft_target_ids(), self.vocab_size)

    def load_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]], model_path: str) -> None:
        """Strict: every parameter loaded, nothing unknown (shared and absent
        input norms aside); d2t required with a reduced draft vocabulary."""
        params = {name: p for name, p in self.named_parameters() if not name.startswith("lm_head.")}
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name in _SHARED_WEIGHTS or name == T2D or name.endswith("rotary_emb.inv_freq"):
                continue
            if name == D2T and self.lm_head is not None:
                check_d2t(tensor, self.draft_vocab_size, self.vocab_size, model_path)
                self.d2t.copy_(tensor.to(torch.long))
                loaded.add(name)
                continue
            param_name = load_head_weight(params, name, tensor, model_path)
            if param_name is None:
                unexpected.append(name)
            else:
                loaded.add(param_name)
        missing = set(params) - loaded
        if self.lm_head is not None and D2T not in loaded:
            missing.add(D2T)
        if missing or unexpected:
            raise ModelLoadError(model_path, missing=missing, unexpected=unexpected)


def load_head_weight(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, model_path: str) -> str | None:
    """One checkpoint tensor of an EAGLE head (Llama names) into its
    parameter, through the parameter's weight loader (a tensor-parallel
    layer narrows the tensor to its rank's slice): the parameter's name, or
    None when the head has none such."""
    param_name, shard_id = LlamaForCausalLM.checkpoint_to_param_name(name)
    param = params.get(param_name)
    if param is None:
        return None
    try:
        if shard_id is None:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
    except ValueError as err:
        raise ModelLoadError(model_path, detail=f"{name}: {err}") from err
    return param_name


def target_embedding(config: SpeculativeConfig, hf_config: Any, target: nn.Module, head: str) -> nn.Embedding:
    """The target's token embedding, which an EAGLE head shares, after
    checking the target has one and an LM head, and the head its width."""
    embed = getattr(getattr(target, "model", None), "embed_tokens", None)
    if embed is None or not hasattr(target, "compute_logits"):
        raise ConfigError(
            "speculative.method", config.method,
            "a target model with model.embed_tokens and compute_logits (Llama family)",
        )
    if hf_config.hidden_size != embed.embedding_dim:
        raise ConfigError(
            "speculative.model", config.model,
            f"an {head} for hidden size {embed.embedding_dim} (this one has {hf_config.hidden_size})",
        )
    return cast(nn.Embedding, embed)


def target_lm_head_weight(config: SpeculativeConfig, hf_config: Any, target: ModelForCausalLM) -> torch.Tensor:
    """The target's whole lm_head weight [vocab, H] (a tensor-parallel
    target's vocabulary shards gathered), which a head with a reduced draft
    vocabulary takes its rows of, after checking the head fits it."""
    lm_head = getattr(target, "lm_head", None)
    if not isinstance(lm_head, ParallelLMHead) or lm_head.num_embeddings != hf_config.vocab_size:
        raise ConfigError(
            "speculative.model", config.model,
            f"an EAGLE head with draft_vocab_size for a target with a ParallelLMHead lm_head of its "
            f"vocab_size {hf_config.vocab_size} (the target: {type(target).__name__}, "
            f"{getattr(lm_head, 'num_embeddings', None)} tokens)",
        )
    weight: torch.Tensor = lm_head.weight
    if lm_head.tp_size > 1:
        weight = lm_head.tp_group.all_gather(weight, dim=0)[: lm_head.num_embeddings]
    return weight


class EagleDrafter(ModelDrafter):
    method = "eagle"

    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        super().__init__(config, context)
        path, hf_config = load_draft_hf_config(config, self.method)
        target = context.target_model
        self.embed_tokens = target_embedding(config, hf_config, target, "EAGLE head")
        self.target = cast("ModelForCausalLM", target)
        with torch.device(context.device):
            self.head = EagleHead(hf_config, context.attn_backend, dtype=context.dtype)
        self.head.load_checkpoint(iterate_safetensors(path), path)
        if self.head.lm_head is not None:
            self.head.set_draft_lm_head(target_lm_head_weight(config, hf_config, self.target))
        self.head.eval()
        self.kv_caches = self._allocate_kv_caches(self.head)
        self.draft_feature_size = hf_config.hidden_size

    def _catch_up(self, inputs: DraftInputs, step: TargetStep, drafting: list[int]) -> DraftStart | None:
        device = self.context.device
        num_batch = len(step.req_ids)
        # The target's kept rows, each with the token after it.
        query_lens = np.diff(step.query_start_loc) - step.num_rejected
        kept = np.concatenate(
            [np.arange(step.query_start_loc[b], step.query_start_loc[b] + query_lens[b]) for b in range(num_batch)]
        ).astype(np.int64)
        kept_t = torch.from_numpy(kept).to(device)
        last_rows = np.cumsum(query_lens) - 1  # [B] last kept row of each request, in the catch-up batch
        # Shift by one: row i reads the token of row i + 1; each request's last
        # row reads its next token.
        next_ids = torch.empty(len(kept), dtype=torch.long, device=device)
        next_ids[:-1] = step.input_ids[kept_t[1:]]
        next_ids[torch.from_numpy(last_rows).to(device)] = torch.from_numpy(step.next_token_ids).to(device)
        batch = InputBatch.from_positions(step.positions[kept], query_lens, step.block_table, self.context.block_size)
        target_features = self._target_features(step, kept_t)
        # Draft j sits at position (last kept position) + 1 + j; the head reads it one position earlier.
        drafting_rows = last_rows[[inputs.batch_rows[i] for i in drafting]]
        feed_positions = batch.positions[drafting_rows] + 1
        replayed = self._replay_catch_up(next_ids, target_features, batch, drafting_rows)
        if replayed is not None:
            logits, features = replayed
            return DraftStart(None, features, feed_positions, logits=logits) if drafting else None
        outputs, features = self._run_head(next_ids, target_features, *self._to_device(batch))
        if not drafting:
            return None
        rows = torch.from_numpy(drafting_rows).to(device)
        return DraftStart(outputs[rows], features[rows], feed_positions)

    def _draft_forward(
        self, tokens: torch.Tensor, hidden_states: torch.Tensor | None, positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert hidden_states is not None  # NOTE: _catch_up always starts from the head's features
        outputs, features = self._run_head(tokens, hidden_states, positions, attn_metadata)
        return self._compute_logits(outputs), features

    def _target_features(self, step: TargetStep, rows: torch.Tensor) -> torch.Tensor:
        """What the head reads of the target at these rows."""
        return step.hidden_states[rows]

    def _run_head(
        self, tokens: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the logits are computed from, what the next draft step feeds back)."""
        features = self.head(self.embed_tokens(tokens), hidden_states, positions, attn_metadata)
        return features, features

    def _compute_logits(self, outputs: torch.Tensor) -> torch.Tensor:
        if self.head.lm_head is not None:
            return self.head.compute_draft_logits(outputs)
        return self.target.compute_logits(outputs)
