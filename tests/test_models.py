"""Llama / Mistral / Qwen2 / Qwen3 over the paged KV cache against HF transformers (float32).

Each scenario runs a flattened batch the way the model runner does: three
prompts of different lengths prefilled together, decode steps, and a fourth
request whose prompt is prefilled in two chunks (the second with cached
context) next to the decodes. Every logit row is compared with HF's logits
for the same full sequence.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.attention_case import paged_metadata
from helpers.tiny_models import cached_tiny_model

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.core.kv_cache.kv_cache_interface import MLAAttentionSpec
from pagedllm.model_registry.interface import ModelForCausalLM
from pagedllm.model_registry.layers.rotary import compute_inv_freq, get_rope_parameters
from pagedllm.model_registry.loader import load_hf_config, load_model
from pagedllm.model_registry.models.llama import LlamaForCausalLM
from pagedllm.model_registry.models.qwen2 import Qwen2ForCausalLM
from pagedllm.model_registry.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,  # registered for MistralForCausalLM too
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
# original 8 < every prompt: transformers' YaRN has no length switch, but a
# short original length puts many dims in the interpolated band.
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8)
SCENARIOS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama-rope-yarn": ("llama", {"rope_parameters": YARN_ROPE}),
    "llama-tied-embeddings": ("llama", {"tie_word_embeddings": True}),
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}),
    "qwen2-sliding-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 6}),
}


class PagedBatchRunner:
    """The model runner's job in miniature: block tables, slot mapping, metadata."""

    def __init__(self, model: Any, block_size: int = 4, num_blocks: int = 64, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        layer = model.get_attention_layers()[0]
        # A latent (MLA) layer's page is one vector per token: its own layout.
        is_latent = isinstance(layer.get_kv_cache_spec(block_size), MLAAttentionSpec)
        layout = TorchNativeBackend.get_mla_kv_cache_layout() if is_latent else TorchNativeBackend.get_kv_cache_layout()
        shape = layout.kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
        dtype = next(model.parameters()).dtype
        for attn in model.get_attention_layers():
            attn.kv_cache = torch.full(shape, float("nan"), dtype=dtype)  # garbage must never be read
        # Shuffled, so block tables are non-contiguous.
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tokens: list[list[int]] = []
        self.prompt_lens: list[int] = []
        self.block_tables: list[list[int]] = []
        self.num_computed: list[int] = []
        # logits[r][pos]: our logits predicting the token after position pos
        self.logits: list[dict[int, torch.Tensor]] = []

    def add_request(self, prompt: list[int]) -> int:
        self.tokens.append(list(prompt))
        self.prompt_lens.append(len(prompt))
        self.block_tables.append([])
        self.num_computed.append(0)
        self.logits.append({})
        return len(self.tokens) - 1

    def step(self, schedule: list[tuple[int, int]]) -> None:
        """Run one flattened batch: schedule = [(request, num_new_tokens)]."""
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for r, num_new in schedule:
            start = self.num_computed[r]
            seq_len = start + num_new
            while len(self.block_tables[r]) * self.block_size < seq_len:
                self.block_tables[r].append(self.free_blocks.pop())
            input_ids += self.tokens[r][start:seq_len]
            positions += range(start, seq_len)
            slots += [
                self.block_tables[r][p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, seq_len)
            ]
            query_lens.append(num_new)
            seq_lens.append(seq_len)
        max_blocks = max(len(self.block_tables[r]) for r, _ in schedule)
        block_table = torch.zeros(len(schedule), max_blocks, dtype=torch.int32)
        for row, (r, _) in enumerate(schedule):
            block_table[row, : len(self.block_tables[r])] = torch.tensor(self.block_tables[r])
        metadata = TorchNativeBackend.build_metadata(
            paged_metadata(query_lens, seq_lens, block_table, slots), self.block_size
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), metadata)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(input_ids), self.model.config.vocab_size)
        row = 0
        for r, num_new in schedule:
            for pos in range(self.num_computed[r], self.num_computed[r] + num_new):
                self.logits[r][pos] = logits[row]
                row += 1
            self.num_computed[r] += num_new
            if self.num_computed[r] == len(self.tokens[r]):  # past the prompt: sample greedily
                self.tokens[r].append(int(self.logits[r][self.num_computed[r] - 1].argmax()))


_hf_models: dict[str, Any] = {}


def hf_model(path: Any) -> Any:
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _hf_models:
        _hf_models[key] = AutoModelForCausalLM.from_pretrained(
            key, dtype=torch.float32, attn_implementation="eager", local_files_only=True
        ).eval()
    return _hf_models[key]


def save_with_tokenizer(model: Any, path: Path) -> Path:
    """A transformers model saved as a checkpoint folder with the shipped tokenizer."""
    from pagedllm.model_registry.tiny import get_tokenizer_dir

    path.mkdir(parents=True, exist_ok=True)
    for item in Path(get_tokenizer_dir()).iterdir():
        if item.is_file():
            shutil.copy(item, path / item.name)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def run_mixed_schedule(model: Any, first_id: int = 0) -> PagedBatchRunner:
    """Three prompts (token ids from `first_id`) prefilled together, decodes,
    then a prompt prefilled in two chunks (the second over cached context)
    beside the decodes."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    runner = PagedBatchRunner(model)
    for length in (5, 13, 21):
        runner.add_request(torch.randint(first_id, vocab, (length,), generator=gen).tolist())
    runner.step([(0, 5), (1, 13), (2, 21)])  # three fresh prefills in one batch
    for _ in range(3):
        runner.step([(0, 1), (1, 1), (2, 1)])
    late = runner.add_request(torch.randint(first_id, vocab, (19,), generator=gen).tolist())
    runner.step([(0, 1), (late, 8), (1, 1), (2, 1)])  # first chunk beside decodes
    runner.step([(0, 1), (1, 1), (late, 11), (2, 1)])  # second chunk reads 8 cached tokens
    for _ in range(2):
        runner.step([(0, 1), (1, 1), (2, 1), (late, 1)])
    return runner


def run_scenario(
    arch: str, overrides: dict[str, Any], dtype: torch.dtype = torch.float32
) -> tuple[PagedBatchRunner, Any]:
    path = cached_tiny_model(arch, **overrides)
    model = load_model(path, model_cls=MODEL_CLASSES[arch], attn_backend=TorchNativeBackend, dtype=dtype, device="cpu")
    return run_mixed_schedule(model), path


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_batches_match_hf_logits_and_greedy_tokens(scenario: str) -> None:
    arch, overrides = SCENARIOS[scenario]
    runner, path = run_scenario(arch, overrides)
    reference = hf_model(path)
    for r, tokens in enumerate(runner.tokens):
        num_computed = runner.num_computed[r]
        with torch.no_grad():
            expected = reference(torch.tensor([tokens[:num_computed]])).logits[0]
        ours = torch.stack([runner.logits[r][pos] for pos in range(num_computed)])
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
        # Every token we appended greedily is HF's argmax at that position.
        prompt_len = runner.prompt_lens[r]
        assert len(tokens) == num_computed + 1 and num_computed > prompt_len
        assert tokens[prompt_len:] == expected[prompt_len - 1 :].argmax(-1).tolist()


def test_sliding_window_changes_the_result() -> None:
    # Guards the sliding-window scenarios against silently testing full attention.
    windowed, _ = run_scenario("mistral", {"sliding_window": 6})
    full, _ = run_scenario("mistral", {"sliding_window": None})
    assert not torch.allclose(windowed.logits[2][20], full.logits[2][20], atol=1e-3)


def test_llama3_rope_scaling_matches_hf_inv_freq() -> None:
    path = cached_tiny_model("llama", rope_scaling=LLAMA3_ROPE)
    params = get_rope_parameters(load_hf_config(path))
    assert params["rope_type"] == "llama3"
    rotary = hf_model(path).model.rotary_emb
    torch.testing.assert_close(compute_inv_freq(16, params), rotary.inv_freq, atol=0, rtol=0)
    default = compute_inv_freq(16, {"rope_type": "default", "rope_theta": 1e4})
    assert not torch.equal(compute_inv_freq(16, params), default)


def test_rope_parameters_from_legacy_config_fields() -> None:
    legacy = type("Cfg", (), {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})()
    assert get_rope_parameters(legacy) == {"type": "linear", "factor": 2.0, "rope_theta": 5e5, "rope_type": "linear"}
    plain = type("Cfg", (), {"rope_theta": 1e6})()
    assert get_rope_parameters(plain) == {"rope_theta": 1e6, "rope_type": "default"}


def test_tied_embeddings_share_one_tensor() -> None:
    path = cached_tiny_model("llama", tie_word_embeddings=True)
    model = load_model(path, model_cls=LlamaForCausalLM, attn_backend=TorchNativeBackend, dtype=torch.float32,
                       device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_tracks_float32(dtype: torch.dtype) -> None:
    ours, _ = run_scenario("qwen3", {}, dtype=dtype)
    reference, _ = run_scenario("qwen3", {})
    assert next(ours.model.parameters()).dtype == dtype
    # Prompt rows only: after a greedy divergence the sequences differ.
    prompt_rows = [(r, pos) for r in range(4) for pos in range(ours.prompt_lens[r])]
    torch.testing.assert_close(
        torch.stack([ours.logits[r][pos] for r, pos in prompt_rows]),
        torch.stack([reference.logits[r][pos] for r, pos in prompt_rows]),
        atol=5e-2,
        rtol=5e-2,
    )


def test_head_dim_from_config_when_present() -> None:
    path = cached_tiny_model("qwen3", head_dim=32)  # 4 heads * 32 != hidden 64
    runner, _ = run_scenario("qwen3", {"head_dim": 32})
    assert runner.model.get_attention_layers()[0].head_size == 32
    assert math.isfinite(float(runner.logits[0][0].sum()))
    expected = hf_model(path)(torch.tensor([runner.tokens[0][:5]])).logits[0]
    torch.testing.assert_close(torch.stack([runner.logits[0][p] for p in range(5)]), expected, atol=1e-4, rtol=1e-4)


def test_built_in_models_implement_the_model_interface() -> None:
    path = cached_tiny_model("llama", tie_word_embeddings=True)
    model = load_model(path, model_cls=LlamaForCausalLM, attn_backend=TorchNativeBackend, dtype=torch.float32,
                       device="cpu")
    assert isinstance(model, ModelForCausalLM)
    for model_cls in (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM):
        assert ModelForCausalLM in model_cls.__mro__ and not model_cls.__abstractmethods__
    # The optional weight mapping: Llama's override, the interface's default.
    assert model.is_ignored_weight("lm_head.weight") is True  # tied: the saved copy is redundant
    assert ModelForCausalLM.is_ignored_weight(model, "lm_head.weight") is False
    with pytest.raises(TypeError, match="abstract"):
        ModelForCausalLM()  # type: ignore[abstract]
