"""Whole models at TP=2 (2 gloo ranks) give TP=1's logits, each rank holding half the weights.

Each rank loads the checkpoint through the strict loader (every layer
narrowing the memory-mapped tensors to its slice), then runs two hand-built
paged-attention steps with the torch_native backend: two prompts prefilled
together, then one decode token each (which reads the prefilled KV cache).
No engine, no scheduler. Logits are allclose to TP=1's (the all-reduces sum
partial products in another order than the full GEMMs), and greedy tokens
are equal. The KV layouts cover 2 KV heads over 2 ranks (split) and 1 KV
head (replicated); an odd vocabulary covers the padded last vocab shard.
The MoE families (the MoE suites' checkpoints, their routing decisive so
that rounding flips no top-k) split each expert's intermediate dimension;
GPT-OSS also from MXFP4 blocks, each rank dequantizing its slice.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.attention_case import paged_metadata
from helpers.perturbed_models import cached_perturbed_model
from helpers.tiny_models import cached_tiny_model
from helpers.tp_weights import expected_param_bytes

from pagedllm.attention_backends.base import AttentionMetadata
from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.model_registry.loader import load_hf_config, load_model
from pagedllm.model_registry.models.gemma2 import Gemma2ForCausalLM
from pagedllm.model_registry.models.gemma3 import Gemma3ForCausalLM
from pagedllm.model_registry.models.gpt_oss import GptOssForCausalLM
from pagedllm.model_registry.models.granite import GraniteForCausalLM
from pagedllm.model_registry.models.llama import LlamaForCausalLM
from pagedllm.model_registry.models.mixtral import MixtralForCausalLM
from pagedllm.model_registry.models.olmo2 import Olmo2ForCausalLM
from pagedllm.model_registry.models.phi3 import Phi3ForCausalLM
from pagedllm.model_registry.models.qwen2 import Qwen2ForCausalLM
from pagedllm.model_registry.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedllm.model_registry.models.qwen3 import Qwen3ForCausalLM
from pagedllm.model_registry.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}
# Phi-3: fused qkv_proj / gate_up_proj tensors that each rank splits for its
# own heads and rows; LongRoPE's long factors (prompts past the original 4)
# and partial rotary (12 of 16 dims).
PHI3_ROPE = dict(rope_type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0, 2.6, 3.3],
                 long_factor=[1.0, 2.0, 4.0, 7.0, 11.0, 16.0])
PHI3 = dict(pad_token_id=0, eos_token_id=2, original_max_position_embeddings=4, partial_rotary_factor=0.75,
            rope_parameters=PHI3_ROPE)
# Gemma with its mechanisms active on these short prompts: a 4-token window,
# caps that clip (weights at 5x the default scale), norm weights away from 0.
GEMMA_ACTIVE = dict(sliding_window=4, initializer_range=0.1, final_logit_softcapping=3.0, norm_noise=0.5)
# name -> (architecture, config overrides) of a tests/helpers tiny model
TEST_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),  # 4 query heads, 2 KV heads: one KV head per rank
    "llama-1-kv-head": ("llama", {"num_key_value_heads": 1}),  # the KV head replicated on both ranks
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen3-odd-vocab-tied": ("qwen3", {"vocab_size": 509, "tie_word_embeddings": True}),  # q/k norms
    "phi3": ("phi3", PHI3),
    "gemma2": ("gemma2", {**GEMMA_ACTIVE, "attn_logit_softcapping": 1.0}),  # sandwich norms, soft-caps, GeGLU
    "gemma3": ("gemma3", {  # q/k norms, one sliding and one global layer with their own RoPE bases
        **GEMMA_ACTIVE, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
    }),
}
# Every weight perturbed (norms away from 1), so a rank's slice of OLMo 2's
# full-width q/k norms shows when it is the wrong one.
PERTURBED_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "granite": ("granite", {"embedding_multiplier": 8.0, "residual_multiplier": 0.3, "attention_multiplier": 1.5,
                            "logits_scaling": 5.0, "initializer_range": 0.1}),
    # q/k norms across ranks: the sum of squares all-reduced
    "olmo2": ("olmo2", {"eos_token_id": 1}),
    "olmo2-1-kv-head": ("olmo2", {"eos_token_id": 1, "num_key_value_heads": 1}),  # k_norm over a replicated head
}
# name -> architecture of a MoE suite checkpoint (test_models_moe.py's
# build_moe: Qwen3-MoE with a dense layer between sparse ones, Qwen2-MoE's
# shared expert, Mixtral), or GPT-OSS's (test_models_gpt_oss.py: biased
# experts, sinks), float and MXFP4.
MOE_MODELS = {"qwen3-moe": "Qwen3MoeForCausalLM", "qwen2-moe": "Qwen2MoeForCausalLM",
              "mixtral": "MixtralForCausalLM", "gpt-oss": "GptOssForCausalLM", "gpt-oss-mxfp4": "GptOssForCausalLM"}
PROMPTS = [[1, 17, 300, 42, 5, 99, 260], [7, 400, 3, 250, 12]]
DECODE_TOKENS = [11, 23]
BLOCK_SIZE, BLOCKS_PER_REQUEST = 4, 4


_moe_paths: dict[str, Path] = {}


def moe_model_paths() -> dict[str, Path]:
    """MOE_MODELS' checkpoints, built once per process."""
    if not _moe_paths:
        from test_models_gpt_oss import build_gpt_oss
        from test_models_gpt_oss_mxfp4 import to_mxfp4_checkpoint
        from test_models_moe import build_moe

        root = Path(tempfile.mkdtemp(prefix="pagedllm-tp-moe-"))
        atexit.register(shutil.rmtree, root, True)
        for name, architecture in MOE_MODELS.items():
            if name == "gpt-oss-mxfp4":
                _moe_paths[name] = to_mxfp4_checkpoint(_moe_paths["gpt-oss"], root / name)
            elif name == "gpt-oss":
                _moe_paths[name] = build_gpt_oss(root / name)
            else:
                _moe_paths[name] = build_moe(architecture, root / name)
    return dict(_moe_paths)


def model_paths() -> dict[str, Path]:
    from pagedllm.model_registry.tiny import get_default_model_dir

    paths = {name: cached_tiny_model(arch, **overrides) for name, (arch, overrides) in TEST_MODELS.items()}
    paths |= {name: cached_perturbed_model(arch, **overrides) for name, (arch, overrides) in PERTURBED_MODELS.items()}
    paths |= moe_model_paths()
    return paths | {"tiny": get_default_model_dir()}  # the shipped model (Llama, tied, float16 on disk)


def load(path: Path) -> Any:
    hf_config = load_hf_config(path)
    model_cls = MODEL_CLASSES[hf_config.architectures[0]]
    return load_model(
        path, model_cls=model_cls, attn_backend=TorchNativeBackend, dtype=torch.float32, device="cpu",
        hf_config=hf_config,
    )


def _metadata(starts: list[int], query_lens: list[int]) -> AttentionMetadata:
    """Request r owns blocks r * BLOCKS_PER_REQUEST ...; its query starts at position starts[r]."""
    slots = [r * BLOCKS_PER_REQUEST * BLOCK_SIZE + pos
             for r, (start, n) in enumerate(zip(starts, query_lens, strict=True)) for pos in range(start, start + n)]
    block_table = torch.arange(len(starts) * BLOCKS_PER_REQUEST, dtype=torch.int32).view(len(starts), -1)
    seq_lens = [s + n for s, n in zip(starts, query_lens, strict=True)]
    return TorchNativeBackend.build_metadata(paged_metadata(query_lens, seq_lens, block_table, slots), BLOCK_SIZE)


def run_two_steps(model: Any) -> torch.Tensor:
    """Logits [12 prompt rows + 2 decode rows, vocab] of a prefill step and a decode step."""
    num_blocks = len(PROMPTS) * BLOCKS_PER_REQUEST
    for attn in model.get_attention_layers():
        shape = TorchNativeBackend.get_kv_cache_shape(num_blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_size)
        attn.kv_cache = torch.full(shape, float("nan"))  # garbage must never be read
    prompt_lens = [len(p) for p in PROMPTS]
    prompt_tokens = [token for prompt in PROMPTS for token in prompt]
    steps = [
        (prompt_tokens, [pos for n in prompt_lens for pos in range(n)], _metadata([0, 0], prompt_lens)),
        (DECODE_TOKENS, prompt_lens, _metadata(prompt_lens, [1, 1])),
    ]
    logits = []
    with torch.no_grad():
        for input_ids, positions, metadata in steps:
            hidden = model(torch.tensor(input_ids), torch.tensor(positions), metadata)
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


def param_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a tied weight counts once


def test_expected_param_bytes_formula_is_the_model_at_tp1() -> None:
    for name, path in model_paths().items():
        assert param_bytes(load(path)) == expected_param_bytes(load_hf_config(path), 1), name


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from helpers.tp_ranks import run_ranks

    args = [f"{name}={path}" for name, path in model_paths().items()]
    return run_ranks(__file__, 2, tmp_path_factory.mktemp("tp2"), *args, timeout=120)


ALL_MODELS = [*TEST_MODELS, *PERTURBED_MODELS, *MOE_MODELS, "tiny"]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_tp2_logits_equal_tp1(tp2_results: list[dict[str, Any]], name: str) -> None:
    path = model_paths()[name]
    expected = run_two_steps(load(path))
    for rank, results in enumerate(tp2_results):
        got = results[name]["logits"]
        assert got.shape == expected.shape
        # float32 rounding of sums taken in another order: 1e-5 of the logits' scale
        # (measured: 2e-7 on the random models' ~1, 2.4e-5 on the trained tiny's ~12).
        atol = 1e-5 * max(1.0, expected.abs().max().item())
        torch.testing.assert_close(got, expected, rtol=0, atol=atol, msg=f"rank {rank}")
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # Every rank samples from the same all-gathered logits.
    assert torch.equal(tp2_results[0][name]["logits"], tp2_results[1][name]["logits"])


def test_tp2_with_cpu_prepacked_gemms_keeps_its_collectives(tp2_results: list[dict[str, Any]]) -> None:
    """The CPU platform swaps each parallel layer's GEMM for oneDNN's; its
    all-reduce and all-gather must stay (without them the logits would be
    each rank's partial sums)."""
    expected = run_two_steps(load(model_paths()["llama"]))
    for results in tp2_results:
        assert results["llama"]["num_prepacked"] in (0, 2 * 4 + 1)  # 0: no oneDNN in this torch build
        torch.testing.assert_close(results["llama"]["logits_prepacked"], expected, rtol=0, atol=1e-5)


def test_memory_mapped_checkpoint_reads_what_safetensors_reads(tmp_path: Path) -> None:
    """The loader's own safetensors reader (zero-copy views that a rank
    narrows before copying) against the safetensors package, every dtype."""
    from safetensors.torch import load_file, save_file

    from pagedllm.model_registry.loader import ModelLoadError, iterate_safetensors

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(2, 3, generator=gen).to(torch.float16),
        "i64": torch.arange(-4, 5),
        "u8": torch.arange(9, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = list(iterate_safetensors(tmp_path))
    assert [name for name, _ in loaded] == sorted(tensors)
    reference = load_file(str(tmp_path / "model.safetensors"))
    for name, tensor in loaded:
        assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name]), name
    # A narrowed view holds this rank's rows only once copied.
    rows = dict(loaded)["f32"].narrow(0, 1, 2).clone()
    assert torch.equal(rows, tensors["f32"][1:3])

    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        list(iterate_safetensors(tmp_path))


def test_models_declare_tensor_parallel_support() -> None:
    from pagedllm.model_registry.interface import ModelForCausalLM

    assert ModelForCausalLM.supports_tensor_parallel is False  # the default: a model must say so
    assert all(cls.supports_tensor_parallel for cls in MODEL_CLASSES.values())


@pytest.mark.parametrize("name", ALL_MODELS)
def test_tp2_rank_holds_half_the_weights_and_its_heads(tp2_results: list[dict[str, Any]], name: str) -> None:
    config = load_hf_config(model_paths()[name])
    for results in tp2_results:
        assert results[name]["param_bytes"] == expected_param_bytes(config, 2)
        assert results[name]["heads"] == (
            config.num_attention_heads // 2, max(config.num_key_value_heads // 2, 1)
        )
    ratio = expected_param_bytes(config, 2) / expected_param_bytes(config, 1)
    # Replicated: the norms (and the 1-KV-head model's KV head); padded: one
    # row of the odd vocabulary.
    assert 0.5 <= ratio < (0.52 if config.num_key_value_heads == 1 else 0.505)


if __name__ == "__main__":  # one rank of the tp2_results fixture
    from helpers.tp_ranks import init_rank_from_argv

    from pagedllm.distributed.parallel_state import destroy_distributed_environment

    tp_rank, _, out_dir, named_paths = init_rank_from_argv()
    results = {}
    for item in named_paths:
        name, path = item.split("=", 1)
        model = load(Path(path))
        attn = model.get_attention_layers()[0]
        results[name] = {
            "logits": run_two_steps(model),
            "param_bytes": param_bytes(model),
            "heads": (attn.num_heads, attn.num_kv_heads),
        }
    from pagedllm.platforms.cpu import CpuPlatform
    from pagedllm.worker.layer_ops import prepare_layer_ops

    model = load(Path(dict(item.split("=", 1) for item in named_paths)["llama"]))
    results["llama"]["num_prepacked"] = prepare_layer_ops(model, CpuPlatform())["cpu_prepacked"]
    results["llama"]["logits_prepacked"] = run_two_steps(model)
    torch.save(results, out_dir / f"rank{tp_rank}.pt")
    destroy_distributed_environment()
