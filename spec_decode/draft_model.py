"""A smaller model of the same vocabulary proposes the drafts.

The draft model has its own paged KV cache with the target's geometry and is
addressed by the target's block tables, so prefix-cache hits, preemption and
freed blocks need no bookkeeping of its own: every position the target
computes, the draft model computes too, in the same step.

Each step (`propose`):
1. catch up: run the draft model over the target's rows of this step minus
   the rejected drafts, plus, for each request that sampled, its newest token
   at the next position; the logits there give draft 1;
2. k - 1 single-token steps feed draft j at the next position for draft j + 1.
Greedy requests draft the argmax (q one-hot); random requests sample from the
draft distribution at their temperature and report it as q (a seeded
request from its own generator: see `DraftSampling`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from pagedllm.core.errors import ConfigError
from pagedllm.spec_decode.interface import Drafter, DrafterContext, DraftInputs, DraftOutput
from pagedllm.spec_decode.utils import bind_kv_caches, build_attn_metadata

if TYPE_CHECKING:
    from pagedllm.core.config import SpeculativeConfig


def _load_draft_hf_config(config: SpeculativeConfig, method: str) -> tuple[str, Any]:
    from pagedllm.model_registry.loader import load_hf_config
    from pagedllm.model_registry.tiny import resolve_model_path

    if config.model is None:
        raise ConfigError(
            "speculative.model", None, f"a model folder or shipped alias (e.g. tiny-draft) for method {method!r}"
        )
    path = resolve_model_path(config.model)
    return path, load_hf_config(path)


@dataclass
class DraftSampling:
    """How each request of a propose call draws its drafts."""

    temperatures: torch.Tensor  # [N] float32 (1.0 on greedy rows)
    is_greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    # A seeded random request's (seed, number of known tokens): its drafts
    # come from a generator seeded by these and the draft's index alone, so
    # they do not depend on the batch it runs in, nor on preemption.
    seeds: list[tuple[int, int] | None]


def draft_seed(seed: int, num_tokens: int, draft_index: int) -> int:
    """The generator seed of draft `draft_index` of a seeded request that
    knows `num_tokens` tokens (a 64-bit mix; distinct for nearby inputs)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + (num_tokens + draft_index) * 0xBF58476D1CE4E5B9) % (1 << 64)
    return (mixed ^ (mixed >> 31)) % (1 << 63)


def _kv_bytes_per_block(hf_config: Any, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    num_heads = hf_config.num_attention_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    return 2 * num_layers * block_size * num_kv_heads * head_size * dtype.itemsize


class ModelDrafter(Drafter):
    """Shared by the drafters that run a model over the target's tokens."""

    needs_lookahead_slots: ClassVar[bool] = True
    # The speculative.method name, for errors about speculative.model.
    method: ClassVar[str]

    @classmethod
    def kv_cache_bytes_per_block(cls, config: SpeculativeConfig, block_size: int, dtype: torch.dtype) -> int:
        _, hf_config = _load_draft_hf_config(config, cls.method)
        return _kv_bytes_per_block(hf_config, hf_config.num_hidden_layers, block_size, dtype)

    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        super().__init__(config, context)
        # Unseeded random requests draw their drafts from this.
        self.generator = torch.Generator(device=context.device)
        self.generator.manual_seed(0)

    def _sample_drafts(
        self, logits: torch.Tensor, sampling: DraftSampling, draft_index: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [N] and, when some row is random, q [N, V] (one-hot on greedy rows)."""
        logits = logits.float()
        greedy_tokens = logits.argmax(dim=-1)
        if sampling.all_greedy:
            return greedy_tokens, None
        probs = (logits / sampling.temperatures.unsqueeze(1)).softmax(dim=-1)
        exponential = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed in enumerate(sampling.seeds):
            if seed is not None:
                generator = torch.Generator(device=probs.device).manual_seed(draft_seed(*seed, draft_index))
                exponential[row].exponential_(generator=generator)
        sampled = probs.div(exponential.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(dim=-1)
        is_greedy = sampling.is_greedy
        tokens = torch.where(is_greedy, greedy_tokens, sampled)
        one_hot = torch.zeros_like(probs).scatter_(1, tokens.unsqueeze(1), 1.0)
        return tokens, torch.where(is_greedy.unsqueeze(1), one_hot, probs)

    def _num_drafts(self, next_positions: np.ndarray) -> np.ndarray:
        """Drafts per request: k, fewer near max_model_len (draft j sits at
        position next_position + j - 1, which must stay below it)."""
        room = self.context.max_model_len - next_positions
        return np.clip(room, 0, self.num_speculative_tokens)

    def _draft_sampling(self, inputs: DraftInputs) -> DraftSampling:
        device = self.context.device
        is_greedy = [p.temperature < 1e-5 for p in inputs.sampling_params]
        temperatures = [1.0 if g else p.temperature for p, g in zip(inputs.sampling_params, is_greedy)]
        seeds = [
            None if greedy or params.seed is None else (params.seed, len(tokens))
            for params, greedy, tokens in zip(inputs.sampling_params, is_greedy, inputs.token_ids)
        ]
        return DraftSampling(
            temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
            is_greedy=torch.tensor(is_greedy, dtype=torch.bool, device=device),
            all_greedy=all(is_greedy),
            seeds=seeds,
        )

    @staticmethod
    def _to_output(
        draft_tokens: list[torch.Tensor], draft_probs: list[torch.Tensor | None], num_drafts: np.ndarray
    ) -> DraftOutput:
        """Per-step tensors [N] (all requests drafted at step j) -> per request lists."""
        num_requests = len(num_drafts)
        if not draft_tokens:
            return DraftOutput([[] for _ in range(num_requests)])
        tokens = torch.stack(draft_tokens, dim=1).tolist()  # [N, k]
        out_tokens = [tokens[i][: int(num_drafts[i])] for i in range(num_requests)]
        if all(p is None for p in draft_probs):
            return DraftOutput(out_tokens)
        vocab_size = next(p for p in draft_probs if p is not None).shape[-1]
        stacked = torch.stack(
            [p if p is not None else torch.zeros(num_requests, vocab_size) for p in draft_probs], dim=1
        )  # [N, k, V]
        return DraftOutput(out_tokens, [stacked[i, : int(num_drafts[i])] for i in range(num_requests)])


class DraftModelDrafter(ModelDrafter):
    method = "draft_model"

    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        super().__init__(config, context)
        from pagedllm.model_registry.loader import get_architecture, load_model
        from pagedllm.plugins import get_plugin_manager

        path, hf_config = _load_draft_hf_config(config, self.method)
        if hf_config.vocab_size != context.vocab_size:
            raise ConfigError(
                "speculative.model", config.model,
                f"a model with the target's vocabulary ({context.vocab_size} tokens, "
                f"this one has {hf_config.vocab_size})",
            )
        model_cls = get_plugin_manager().registry("model").load(get_architecture(hf_config))
        self.model = load_model(
            path, model_cls=model_cls, attn_backend=context.attn_backend, dtype=context.dtype,
            device=context.device, hf_config=hf_config,
        )
        self.kv_caches = bind_kv_caches(self.model, context)

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> DraftOutput:
        step = inputs.target_step
        if step is None:
            raise ValueError("the draft_model drafter needs the target step")
        device = self.context.device
        block_size = self.context.block_size
        num_batch = len(step.req_ids)
        sampling_index = {row: i for i, row in enumerate(inputs.batch_rows)}

        # 1. Catch up: the target's kept rows, plus each sampling request's newest token.
        query_lens = np.diff(step.query_start_loc) - step.num_rejected
        row_ids: list[np.ndarray] = []
        extra_tokens: list[int] = []
        lens = query_lens.copy()
        for b in range(num_batch):
            start = int(step.query_start_loc[b])
            row_ids.append(np.arange(start, start + int(query_lens[b])))
            if b in sampling_index:
                extra_tokens.append(inputs.token_ids[sampling_index[b]][-1])
                lens[b] += 1
        kept = np.concatenate(row_ids)
        # Interleave: request b's kept rows, then its extra row when it sampled.
        input_ids = torch.empty(int(lens.sum()), dtype=torch.long, device=device)
        positions = np.empty(int(lens.sum()), dtype=np.int64)
        out_start = np.zeros(num_batch + 1, dtype=np.int64)
        np.cumsum(lens, out=out_start[1:])
        kept_input_ids = step.input_ids[torch.from_numpy(kept).to(device)]
        kept_dest = np.concatenate(
            [np.arange(out_start[b], out_start[b] + query_lens[b]) for b in range(num_batch)]
        ).astype(np.int64)
        input_ids[torch.from_numpy(kept_dest).to(device)] = kept_input_ids
        positions[kept_dest] = step.positions[kept]
        sampling_rows = inputs.batch_rows
        last_rows = np.array([out_start[b + 1] - 1 for b in sampling_rows], dtype=np.int64)
        if sampling_rows:
            input_ids[torch.from_numpy(last_rows).to(device)] = torch.tensor(extra_tokens, device=device)
            positions[last_rows] = positions[last_rows - 1] + 1
        attn_metadata = build_attn_metadata(
            self.context.attn_backend, block_size, positions, lens, step.block_table, device
        )
        hidden_states = self.model(input_ids, torch.from_numpy(positions).to(device), attn_metadata)
        if not sampling_rows:
            return DraftOutput([])

        # 2. Draft k tokens for the sampling requests.
        sampling = self._draft_sampling(inputs)
        next_positions = positions[last_rows] + 1
        num_drafts = self._num_drafts(next_positions)
        block_table = step.block_table[sampling_rows]
        logits = self.model.compute_logits(hidden_states[torch.from_numpy(last_rows).to(device)])
        draft_tokens: list[torch.Tensor] = []
        draft_probs: list[torch.Tensor | None] = []
        max_drafts = int(num_drafts.max()) if len(num_drafts) else 0
        for j in range(max_drafts):
            tokens, probs = self._sample_drafts(logits, sampling, j)
            draft_tokens.append(tokens)
            draft_probs.append(probs)
            if j + 1 == max_drafts:
                break
            # Feed draft j at next_positions + j (clamped where a request stops early;
            # its extra drafts are cut by num_drafts).
            feed_positions = np.minimum(next_positions + j, self.context.max_model_len - 1)
            attn_metadata = build_attn_metadata(
                self.context.attn_backend, block_size, feed_positions,
                np.ones(len(sampling_rows), dtype=np.int64), block_table, device,
            )
            hidden = self.model(tokens, torch.from_numpy(feed_positions).to(device), attn_metadata)
            logits = self.model.compute_logits(hidden)
        return self._to_output(draft_tokens, draft_probs, num_drafts)
