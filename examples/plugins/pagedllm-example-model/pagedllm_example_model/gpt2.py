"""GPT-2 (Radford et al., 2019) on pagedllm's paged attention.

Pre-norm decoder: x + Attn(LayerNorm(x)), then x + MLP(LayerNorm(x)) with a
4x GELU MLP; learned absolute position embeddings (no rotary); multi-head
attention over the paged KV cache through pagedllm's ``Attention`` layer, so
any selected backend (torch_native, sdpa, ...) runs it; lm_head tied to the
token embedding.

Checkpoints saved by transformers use ``Conv1D`` layers: ``y = x @ W + b`` with
W stored [in, out], the transpose of ``nn.Linear``'s [out, in]. Every such
weight is transposed once at load time (``CONV1D_WEIGHTS``), so the forward
pass is plain ``nn.Linear``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_registry.layers.attention import Attention
from pagedllm.model_registry.loader import check_weight_shape

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata

# config.activation_function -> activation. HF's "gelu_new" is the tanh
# approximation of GELU (Hendrycks & Gimpel), which is what GPT-2 was trained with.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}

# Checkpoint weights stored as Conv1D [in, out]: transposed into nn.Linear.
CONV1D_WEIGHTS = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")
# Buffers older transformers saved with the weights (the causal mask): not weights.
IGNORED_WEIGHTS = re.compile(r"\.attn\.(bias|masked_bias)$")


class GPT2Attention(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, attn_backend: type[AttentionBackend]):
        super().__init__()
        hidden_size = hf_config.n_embd
        self.num_heads = hf_config.n_head
        self.head_dim = hidden_size // self.num_heads
        scale = self.head_dim**-0.5 if getattr(hf_config, "scale_attn_weights", True) else 1.0
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.c_attn = nn.Linear(hidden_size, 3 * hidden_size)  # fused [q | k | v]
        self.c_proj = nn.Linear(hidden_size, hidden_size)
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_heads, attn_backend)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # [T, hidden] each
        return self.c_proj(self.attn(q, k, v, attn_metadata))


class GPT2MLP(nn.Module):
    def __init__(self, hf_config: Any):
        super().__init__()
        hidden_size = hf_config.n_embd
        inner_size = getattr(hf_config, "n_inner", None) or 4 * hidden_size
        activation = hf_config.activation_function
        if activation not in ACTIVATIONS:
            raise ValueError(f"GPT-2 activation_function={activation!r} is not supported; known: {sorted(ACTIVATIONS)}")
        self.c_fc = nn.Linear(hidden_size, inner_size)
        self.act = ACTIVATIONS[activation]
        self.c_proj = nn.Linear(inner_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, attn_backend: type[AttentionBackend]):
        super().__init__()
        eps = hf_config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(hf_config.n_embd, eps=eps)
        self.attn = GPT2Attention(hf_config, layer_idx, attn_backend)
        self.ln_2 = nn.LayerNorm(hf_config.n_embd, eps=eps)
        self.mlp = GPT2MLP(hf_config)

    def forward(self, x: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_metadata)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend]):
        super().__init__()
        self.wte = nn.Embedding(hf_config.vocab_size, hf_config.n_embd)  # tokens
        self.wpe = nn.Embedding(hf_config.n_positions, hf_config.n_embd)  # learned positions
        self.h = nn.ModuleList(GPT2Block(hf_config, i, attn_backend) for i in range(hf_config.n_layer))
        self.ln_f = nn.LayerNorm(hf_config.n_embd, eps=hf_config.layer_norm_epsilon)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        x = self.wte(input_ids) + self.wpe(positions)  # [T, hidden]
        for block in self.h:
            x = block(x, attn_metadata)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """What pagedllm builds for ``"architectures": ["GPT2LMHeadModel"]``.

    Parameter names equal the checkpoint's (``transformer.h.0.attn.c_attn.weight``),
    so the loader needs no name table; only Conv1D weights are transposed.
    """

    # Plain nn.Linear / nn.Embedding, every weight whole: one rank only. At
    # parallel.tensor_parallel_size > 1 pagedllm refuses it with a ConfigError
    # (tensor parallelism would need model_registry/layers' parallel layers).
    supports_tensor_parallel: ClassVar[bool] = False

    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = hf_config
        self.transformer = GPT2Model(hf_config, attn_backend)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = nn.Linear(hf_config.n_embd, hf_config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.to(dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.transformer(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    def get_attention_layers(self) -> list[Attention]:
        return [block.attn.attn for block in self.transformer.h]

    def is_ignored_weight(self, name: str) -> bool:
        """Checkpoint entries that are neither loaded nor unexpected."""
        if IGNORED_WEIGHTS.search(name):
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"  # a saved copy of wte

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.is_ignored_weight(name):
                continue
            param = params[name]
            if CONV1D_WEIGHTS.search(name):
                tensor = tensor.t()  # Conv1D [in, out] -> Linear [out, in]
            check_weight_shape(param, tensor)
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        return loaded
