"""The EAGLE-1 head: HF checkpoint layout, and the paged head computes what the
plain-torch training head computes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.tiny_models import cached_tiny_model
from safetensors.torch import load_file, save_file

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.model_registry.input_batch import InputBatch
from pagedllm.model_registry.loader import ModelLoadError, iterate_safetensors, load_hf_config
from pagedllm.spec_decode.eagle import EagleHead
from pagedllm.training.train_eagle import TrainableEagleHead, save_random_eagle_head

# The names of a real EAGLE-1 checkpoint (yuhuili/EAGLE-LLaMA3-Instruct-8B
# layout; vLLM's llama_eagle.py loads the same): no input_layernorm, no norm.
EAGLE_WEIGHT_NAMES = {
    "fc.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
}


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = cached_tiny_model("llama", seed=3)
    return save_random_eagle_head(target, tmp_path_factory.mktemp("eagle") / "head", seed=4)


def test_saved_head_has_the_hf_eagle_layout(head_dir: Path) -> None:
    assert set(load_file(str(head_dir / "model.safetensors"))) == EAGLE_WEIGHT_NAMES
    config = json.loads((head_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    weights = load_file(str(head_dir / "model.safetensors"))
    assert tuple(weights["fc.weight"].shape) == (config["hidden_size"], 2 * config["hidden_size"])


def _paged_head(head_dir: Path) -> EagleHead:
    head = EagleHead(load_hf_config(head_dir), TorchNativeBackend)
    head.load_checkpoint(iterate_safetensors(head_dir), str(head_dir))
    return head.eval()


def test_shared_embedding_copy_is_ignored_and_a_missing_weight_is_named(head_dir: Path, tmp_path: Path) -> None:
    weights = load_file(str(head_dir / "model.safetensors"))
    config = json.loads((head_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with_embedding = dict(weights, **{"embed_tokens.weight": torch.zeros(config["vocab_size"], config["hidden_size"])})
    save_file(with_embedding, str(tmp_path / "model.safetensors"))
    _paged_head(tmp_path)  # loads: the target's embedding is used
    save_file({k: v for k, v in weights.items() if k != "fc.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"fc\.weight"):
        _paged_head(tmp_path)


@torch.inference_mode()
def test_paged_head_matches_the_training_head(head_dir: Path) -> None:
    from transformers import LlamaConfig

    config = json.loads((head_dir / "config.json").read_text())
    reference = TrainableEagleHead(LlamaConfig(**config))
    reference.load_state_dict(load_file(str(head_dir / "model.safetensors")), strict=False)
    paged = _paged_head(head_dir)
    layer = paged.layers[0].self_attn.attn
    block_size, num_blocks, seq = 4, 8, 10
    layer.kv_cache = torch.zeros(
        TorchNativeBackend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
    )
    generator = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, seq, config["hidden_size"], generator=generator)
    hidden = torch.randn(1, seq, config["hidden_size"], generator=generator)
    want = reference(embeds, hidden)[0]
    positions = np.arange(seq)
    block_table = np.array([[5, 2, 7]], dtype=np.int32)
    batch = InputBatch.from_positions(positions, np.array([seq]), block_table, block_size)
    got = paged(embeds[0], hidden[0], *batch.to_device(TorchNativeBackend, block_size, torch.device("cpu")))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
