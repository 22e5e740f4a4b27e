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

Like the draft model, the head keeps a paged KV cache with the target's
geometry, addressed by the same block tables, and mirrors every target row.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.layers.rotary import RotaryEmbedding, get_rope_parameters
from pagedllm.model_registry.loader import ModelLoadError, default_weight_loader, iterate_safetensors
from pagedllm.model_registry.models.llama import LlamaDecoderLayer, LlamaFlags, LlamaForCausalLM
from pagedllm.spec_decode.draft_model import ModelDrafter, _load_draft_hf_config
from pagedllm.spec_decode.interface import DrafterContext, DraftInputs, DraftOutput
from pagedllm.spec_decode.utils import bind_kv_caches, build_attn_metadata

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata
    from pagedllm.core.config import SpeculativeConfig

# Checkpoint entries that belong to the target (the head shares them).
_SHARED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")


class EagleHead(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend], dtype: torch.dtype = torch.float32):
        super().__init__()
        hidden_size = hf_config.hidden_size
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=bool(getattr(hf_config, "bias", False)))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, LlamaFlags(), i, attn_backend) for i in range(hf_config.num_hidden_layers)
        )
        # NOTE: EAGLE drops the first layer's input norm (its input is built
        # from the target's already normalized features).
        self.layers[0].input_layernorm = nn.Identity()
        head_dim = self.layers[0].self_attn.head_dim
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
        for layer in self.layers:
            x = layer(x, cos, sin, attn_metadata)
        return x

    def get_attention_layers(self) -> list[Any]:
        return [layer.self_attn.attn for layer in self.layers]

    def load_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]], model_path: str) -> None:
        """Strict: every parameter loaded, nothing unknown (shared and absent
        input norms aside)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name in _SHARED_WEIGHTS or name.endswith("rotary_emb.inv_freq"):
                continue
            param_name, shard_id = LlamaForCausalLM.checkpoint_to_param_name(name)
            param = params.get(param_name)
            if param is None:
                unexpected.append(name)
                continue
            try:
                if shard_id is None:
                    default_weight_loader(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
            except ValueError as err:
                raise ModelLoadError(model_path, detail=f"{name}: {err}") from err
            loaded.add(param_name)
        missing = set(params) - loaded
        if missing or unexpected:
            raise ModelLoadError(model_path, missing=missing, unexpected=unexpected)


class EagleDrafter(ModelDrafter):
    method = "eagle"

    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        super().__init__(config, context)
        path, hf_config = _load_draft_hf_config(config, self.method)
        target = context.target_model
        embed = getattr(getattr(target, "model", None), "embed_tokens", None)
        if embed is None or not hasattr(target, "compute_logits"):
            raise ConfigError(
                "speculative.method", "eagle", "a target model with model.embed_tokens and compute_logits (Llama family)"
            )
        if hf_config.hidden_size != embed.embedding_dim:
            raise ConfigError(
                "speculative.model", config.model,
                f"an EAGLE head for hidden size {embed.embedding_dim} (this one has {hf_config.hidden_size})",
            )
        self.embed_tokens = embed
        self.target = target
        with torch.device(context.device):
            self.head = EagleHead(hf_config, context.attn_backend, dtype=context.dtype)
        self.head.load_checkpoint(iterate_safetensors(path), path)
        self.head.eval()
        self.kv_caches = bind_kv_caches(self.head, context)

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> DraftOutput:
        step = inputs.target_step
        if step is None:
            raise ValueError("the eagle drafter needs the target step")
        device = self.context.device
        block_size = self.context.block_size
        num_batch = len(step.req_ids)

        # 1. Catch up over the target's kept rows, each with the token after it.
        query_lens = np.diff(step.query_start_loc) - step.num_rejected
        kept = np.concatenate(
            [np.arange(step.query_start_loc[b], step.query_start_loc[b] + query_lens[b]) for b in range(num_batch)]
        ).astype(np.int64)
        kept_t = torch.from_numpy(kept).to(device)
        out_start = np.zeros(num_batch + 1, dtype=np.int64)
        np.cumsum(query_lens, out=out_start[1:])
        last_rows = out_start[1:] - 1  # [B] last kept row of each request, in the catch-up batch
        # Shift by one: row i reads the token of row i + 1; each request's last
        # row reads its next token.
        next_ids = torch.empty(len(kept), dtype=torch.long, device=device)
        next_ids[:-1] = step.input_ids[kept_t[1:]]
        next_ids[torch.from_numpy(last_rows).to(device)] = torch.from_numpy(step.next_token_ids).to(device)
        positions = step.positions[kept]
        attn_metadata = build_attn_metadata(
            self.context.attn_backend, block_size, positions, query_lens, step.block_table, device
        )
        features = self.head(
            self.embed_tokens(next_ids), step.hidden_states[kept_t], torch.from_numpy(positions).to(device),
            attn_metadata,
        )
        sampling_rows = inputs.batch_rows
        if not sampling_rows:
            return DraftOutput([])

        # 2. Draft: draft j sits at position (last kept position) + 1 + j.
        sampling = self._draft_sampling(inputs)
        last = torch.from_numpy(last_rows[sampling_rows]).to(device)
        feature = features[last]
        last_positions = positions[last_rows[sampling_rows]]
        num_drafts = self._num_drafts(last_positions + 2)
        block_table = step.block_table[sampling_rows]
        logits = self.target.compute_logits(feature)
        draft_tokens: list[torch.Tensor] = []
        draft_probs: list[torch.Tensor | None] = []
        max_drafts = int(num_drafts.max()) if len(num_drafts) else 0
        for j in range(max_drafts):
            tokens, probs = self._sample_drafts(logits, sampling, j)
            draft_tokens.append(tokens)
            draft_probs.append(probs)
            if j + 1 == max_drafts:
                break
            feed_positions = np.minimum(last_positions + 1 + j, self.context.max_model_len - 1)
            attn_metadata = build_attn_metadata(
                self.context.attn_backend, block_size, feed_positions,
                np.ones(len(sampling_rows), dtype=np.int64), block_table, device,
            )
            feature = self.head(
                self.embed_tokens(tokens), feature, torch.from_numpy(feed_positions).to(device), attn_metadata
            )
            logits = self.target.compute_logits(feature)
        return self._to_output(draft_tokens, draft_probs, num_drafts)
