"""The skeleton shared by the drafters that run a model over the target's tokens
(draft_model.py, eagle.py).

Such a drafter has its own paged KV cache with the target's geometry and is
addressed by the target's block tables, so prefix-cache hits, preemption and
freed blocks need no bookkeeping of its own: every position the target
computes, the drafter computes too, in the same step.

Each step (`propose`):
1. catch up (`_catch_up`, per drafter): run the model over the target's kept
   rows of this step; its logits at the end of each request that drafts
   give draft 1;
2. single-token steps (`_draft_forward`, per drafter) feed draft j for
   draft j + 1, as many as the longest draft needs. They are uniform decode
   batches: with graphs captured (`capture_graphs`), each replays the graph
   of its batch size.
Each request drafts what the speculation policy gave it
(`DraftInputs.num_drafts`), fewer near max_model_len. Only the requests that
draft at all take part after the catch-up: when none does, the catch-up (the
KV mirror) is all that runs, and no logits are computed.
Greedy requests draft the argmax (q one-hot); random requests sample from the
draft distribution at their temperature and report it as q (a seeded
request from its own generator: see `DraftSampling`).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from pagedllm.attention_backends.base import STANDARD_KV_CACHE_LAYOUT
from pagedllm.core.errors import ConfigError
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model_registry.batch_graphs import BatchGraphs
from pagedllm.model_registry.input_batch import InputBatch
from pagedllm.model_registry.kv_cache import PagedModule, allocate_kv_caches
from pagedllm.model_registry.layers.tp_heads import partition_heads
from pagedllm.spec_decode.interface import Drafter, DrafterContext, DraftInputs, DraftOutput, TargetStep

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionMetadata
    from pagedllm.core.config import SpeculativeConfig
    from pagedllm.platforms.interface import Platform



def load_draft_hf_config(config: SpeculativeConfig, method: str) -> tuple[str, Any]:
    """(folder, Hugging Face config) of `speculative.model`."""
    from pagedllm.model_registry.loader import load_hf_config

    if config.model is None:
        raise ConfigError(
            "speculative.model", None, f"a model folder or shipped alias (e.g. tiny-draft) for method {method!r}"
        )
    # The builder resolved a model source's name (tiny-draft) to its folder.
    return config.model, load_hf_config(config.model)


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


@dataclass
class DraftStart:
    """Where drafting starts for the requests that draft, after the catch-up."""

    # [N, H] what the logits of draft 1 are computed from (`_compute_logits`);
    # None when `logits` holds them already (a replayed catch-up).
    outputs: torch.Tensor | None
    # What `_draft_step` feeds back besides the token (EAGLE's features); None for a plain model.
    hidden_states: torch.Tensor | None
    feed_positions: np.ndarray  # [N] the drafter's position when it is fed draft 1
    logits: torch.Tensor | None = None  # [N, V] the logits of draft 1, when computed


def draft_seed(seed: int, num_tokens: int, draft_index: int) -> int:
    """The generator seed of draft `draft_index` of a seeded request that
    knows `num_tokens` tokens (a 64-bit mix; distinct for nearby inputs)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + (num_tokens + draft_index) * 0xBF58476D1CE4E5B9) % (1 << 64)
    return (mixed ^ (mixed >> 31)) % (1 << 63)


def _kv_bytes_per_block(hf_config: Any, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    """This rank's share: the drafter's layers are tensor-parallel like the
    target's, so its cache holds the KV heads its QKVParallelLinear keeps."""
    num_heads = hf_config.num_attention_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    total_num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    tp_size = get_tp_group().world_size  # the Worker asks after joining its group
    num_kv_heads = partition_heads(num_heads, total_num_kv_heads, tp_size).num_kv_heads
    # NOTE: the standard layout's size: this plugin-API classmethod is not told the backend.
    return num_layers * STANDARD_KV_CACHE_LAYOUT.bytes_per_block(block_size, num_kv_heads, head_size, dtype)


class ModelDrafter(Drafter):
    needs_lookahead_slots: ClassVar[bool] = True
    # The speculative.method name, for errors about speculative.model.
    method: ClassVar[str]

    @classmethod
    def kv_cache_bytes_per_block(cls, config: SpeculativeConfig, block_size: int, dtype: torch.dtype) -> int:
        _, hf_config = load_draft_hf_config(config, cls.method)
        return _kv_bytes_per_block(hf_config, hf_config.num_hidden_layers, block_size, dtype)

    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        super().__init__(config, context)
        # Unseeded random requests draw their drafts from this.
        self.generator = torch.Generator(device=context.device)
        self.generator.manual_seed(0)
        self.draft_graphs: BatchGraphs | None = None

    @abstractmethod
    def _catch_up(self, inputs: DraftInputs, step: TargetStep, drafting: list[int]) -> DraftStart | None:
        """Mirror the target's kept rows of this step into the drafter's KV
        cache; where the requests `drafting` (indices into `inputs`) start
        drafting, None when that is none of them (no logits computed)."""

    @abstractmethod
    def _compute_logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """[N, H] model outputs -> [N, V] logits over the target's vocabulary."""

    # The per-row features `_draft_forward` feeds back (EAGLE's), [hidden]; None: none.
    draft_feature_size: int | None = None

    @abstractmethod
    def _draft_forward(
        self, tokens: torch.Tensor, hidden_states: torch.Tensor | None, positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed one draft per request: (logits of the next draft, what the next step feeds back)."""

    def capture_graphs(self, platform: Platform, sizes: list[int]) -> None:
        """Graphs of the draft steps (one token per request) and of the
        catch-ups (each request's kept rows, 1 + k at most, and one more for
        a draft model's newest token), per batch size and query length,
        each captured when a step first needs it."""
        context = self.context
        extras: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        if self.draft_feature_size is not None:
            extras["hidden_states"] = ((self.draft_feature_size,), context.dtype)

        def forward(tokens: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                    inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            logits, feature = self._draft_forward(tokens, inputs.get("hidden_states"), positions, metadata)
            return (logits,) if feature is None else (logits, feature)

        graphs = BatchGraphs(forward, context.attn_backend, platform, sizes=sizes,
                             max_model_len=context.max_model_len, block_size=context.block_size,
                             device=context.device, extra_inputs=extras,
                             query_lens=list(range(1, self.num_speculative_tokens + 3)))
        # NOTE: nothing captured now: each size when a draft step first needs it
        # (one that cannot be captured runs eagerly, logged).
        self.draft_graphs = graphs

    def _draft_step(
        self, tokens: torch.Tensor, hidden_states: torch.Tensor | None, batch: InputBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One single-token draft step: its graph's replay where there is one."""
        replayed = self._replay(tokens, hidden_states, batch)
        if replayed is None:
            return self._draft_forward(tokens, hidden_states, *self._to_device(batch))
        return replayed

    def _replay_catch_up(
        self, tokens: torch.Tensor, hidden_states: torch.Tensor | None, batch: InputBatch, rows: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A catch-up over `batch` as a graph replay, where its shape has one
        (a decode step's kept rows; not a prefill chunk): (logits, features)
        at `rows`; None when it cannot replay (the caller runs it eagerly).
        The graph computes the logits of every row (a few per request),
        where an eager catch-up computes those of `rows` only; eagerly the
        catch-up was most of a batch-1 draft (0.9-1.2 of 2.9-3.5 ms)."""
        replayed = self._replay(tokens, hidden_states, batch)
        if replayed is None:
            return None
        logits, features = replayed
        index = torch.from_numpy(rows).to(self.context.device)
        return logits[index], None if features is None else features[index]

    def _replay(
        self, tokens: torch.Tensor, hidden_states: torch.Tensor | None, batch: InputBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`_draft_forward` over `batch` as its graph's replay: (logits,
        features) of every row; None when the batch's shape has no graph."""
        graphs = self.draft_graphs
        if graphs is None or not graphs.can_run(batch):
            return None
        extras = None if hidden_states is None else {"hidden_states": hidden_states}
        outputs = graphs.run(tokens, batch, extras)
        return outputs[0], outputs[1] if len(outputs) > 1 else None

    def _allocate_kv_caches(self, model: PagedModule) -> list[torch.Tensor]:
        """The drafter's own KV cache, with the target's block geometry: the
        same block ids address both."""
        layer = model.get_attention_layers()[0]
        context = self.context
        return allocate_kv_caches(
            model, context.attn_backend, num_blocks=context.num_blocks, block_size=context.block_size,
            num_kv_heads=layer.num_kv_heads, head_size=layer.head_size, dtype=context.cache_dtype,
            device=context.device,
        )

    def _to_device(self, batch: InputBatch) -> tuple[torch.Tensor, AttentionMetadata]:
        return batch.to_device(self.context.attn_backend, self.context.block_size, self.context.device)

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> DraftOutput:
        if inputs.target_step is None:
            raise ValueError(f"the {self.method} drafter needs the target step")
        step = inputs.target_step
        num_drafts = self._num_drafts(inputs, step)
        drafting = [int(i) for i in np.flatnonzero(num_drafts)]
        start = self._catch_up(inputs, step, drafting)
        if start is None:
            return DraftOutput([[] for _ in inputs.req_ids])
        sampling = self._draft_sampling(inputs, drafting)
        max_drafts = int(num_drafts.max())
        block_table = step.block_table[[inputs.batch_rows[i] for i in drafting]]
        single_rows = np.ones(len(drafting), dtype=np.int64)
        logits = start.logits
        if logits is None:
            assert start.outputs is not None, "a DraftStart without logits has outputs"
            logits = self._compute_logits(start.outputs)
        hidden_states = start.hidden_states
        draft_tokens: list[torch.Tensor] = []
        draft_probs: list[torch.Tensor | None] = []
        for j in range(max_drafts):
            tokens, probs = self._sample_drafts(logits, sampling, j)
            draft_tokens.append(tokens)
            draft_probs.append(probs)
            if j + 1 == max_drafts:
                break
            # Feed draft j + 1 (clamped where a request stops early; its extra drafts are cut by num_drafts).
            feed_positions = np.minimum(start.feed_positions + j, self.context.max_model_len - 1)
            batch = InputBatch.from_positions(feed_positions, single_rows, block_table, self.context.block_size)
            logits, hidden_states = self._draft_step(tokens, hidden_states, batch)
        return self._to_output(draft_tokens, draft_probs, num_drafts, drafting)

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

    def _num_drafts(self, inputs: DraftInputs, step: TargetStep) -> np.ndarray:
        """Drafts per request of `inputs`: what the policy gave it (k when
        not given), fewer near max_model_len. Draft 1 sits two positions
        after the request's last kept row (its newest token is in between),
        draft j at that + j - 1, which must stay below max_model_len."""
        rows = np.asarray(inputs.batch_rows, dtype=np.int64)
        kept_lens = np.diff(step.query_start_loc)[rows] - step.num_rejected[rows]
        first_positions = step.positions[step.query_start_loc[rows] + kept_lens - 1] + 2
        room = self.context.max_model_len - first_positions
        wanted = np.asarray(inputs.num_drafts if inputs.num_drafts else [self.num_speculative_tokens] * len(rows),
                            dtype=np.int64)
        return np.clip(np.minimum(room, wanted), 0, self.num_speculative_tokens)

    def _draft_sampling(self, inputs: DraftInputs, drafting: list[int]) -> DraftSampling:
        device = self.context.device
        params = [inputs.sampling_params[i] for i in drafting]
        is_greedy = [p.temperature < 1e-5 for p in params]
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, is_greedy, strict=True)]
        seeds = [
            None if greedy or p.seed is None else (p.seed, len(inputs.token_ids[i]))
            for p, greedy, i in zip(params, is_greedy, drafting, strict=True)
        ]
        return DraftSampling(
            temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
            is_greedy=torch.tensor(is_greedy, dtype=torch.bool, device=device),
            all_greedy=all(is_greedy),
            seeds=seeds,
        )

    @staticmethod
    def _to_output(
        draft_tokens: list[torch.Tensor], draft_probs: list[torch.Tensor | None], num_drafts: np.ndarray,
        drafting: list[int],
    ) -> DraftOutput:
        """Per-step tensors [N] (the requests `drafting`, drafted at step j)
        -> per request lists (empty for a request that drafts nothing)."""
        out_tokens: list[list[int]] = [[] for _ in num_drafts]
        tokens = torch.stack(draft_tokens, dim=1).tolist()  # [N, max drafts]
        for row, i in enumerate(drafting):
            out_tokens[i] = tokens[row][: int(num_drafts[i])]
        if all(p is None for p in draft_probs):
            return DraftOutput(out_tokens)
        vocab_size = next(p for p in draft_probs if p is not None).shape[-1]
        stacked = torch.stack(
            [p if p is not None else torch.zeros(len(drafting), vocab_size) for p in draft_probs], dim=1
        )  # [N, max drafts, V]
        out_probs: list[torch.Tensor | None] = [None] * len(num_drafts)
        for row, i in enumerate(drafting):
            out_probs[i] = stacked[row, : int(num_drafts[i])]
        return DraftOutput(out_tokens, out_probs)
