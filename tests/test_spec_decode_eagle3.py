"""EAGLE-3: vLLM's checkpoint layout loads, the head computes what its formulas
say (a plain-torch reference written here), the target keeps the layer inputs
the head reads, and a head that does not fit the target is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.eagle3_heads import random_eagle3_weights, save_random_eagle3_head
from helpers.tiny_models import cached_tiny_model
from safetensors.torch import load_file, save_file

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.input_batch import InputBatch
from pagedllm.model_registry.loader import ModelLoadError, iterate_safetensors, load_hf_config, load_model
from pagedllm.model_registry.models.llama import LlamaForCausalLM
from pagedllm.spec_decode.eagle3 import Eagle3Head, aux_layer_ids

AUX_LAYERS = [0, 1, 1]  # the tiny test target has 2 layers
DRAFT_VOCAB = 200
BLOCK_SIZE, NUM_BLOCKS = 4, 8


@pytest.fixture(scope="module")
def target_dir() -> Path:
    return cached_tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def head_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eagle3") / "head"
    return save_random_eagle3_head(target_dir, out, seed=5, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=AUX_LAYERS)


def _with_cache(layers: list[Any]) -> None:
    for layer in layers:
        layer.kv_cache = torch.zeros(
            TorchNativeBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, layer.num_kv_heads, layer.head_size)
        )


def _batch(seq: int) -> tuple[torch.Tensor, Any]:
    block_table = np.array([[5, 2, 7]], dtype=np.int32)
    batch = InputBatch.from_positions(np.arange(seq), np.array([seq]), block_table, BLOCK_SIZE)
    return batch.to_device(TorchNativeBackend, BLOCK_SIZE, torch.device("cpu"))


def _paged_head(head_dir: Path) -> Eagle3Head:
    head = Eagle3Head(load_hf_config(head_dir), len(AUX_LAYERS), TorchNativeBackend)
    head.load_checkpoint(iterate_safetensors(head_dir), str(head_dir))
    _with_cache(head.get_attention_layers())
    return head.eval()


# ------------------------------------------------------------ the reference


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary embedding of x [T, heads, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


def _reference(w: dict[str, torch.Tensor], cfg: dict[str, Any], embeds: torch.Tensor, aux: torch.Tensor) -> Any:
    """(target-vocab logits, fed-back features) of one sequence, straight from the formulas."""
    eps, d = cfg["rms_norm_eps"], cfg["head_dim"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    seq = embeds.shape[0]
    positions = torch.arange(seq, dtype=torch.float32)
    g = aux @ w["fc.weight"].T
    x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                   _rms(g, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
    q = _rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(seq, heads, d), positions, cfg["rope_theta"])
    k = _rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(seq, kv_heads, d), positions, cfg["rope_theta"])
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(seq, kv_heads, d)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq, heads * d)
    normed_g = _rms(g, w["midlayer.hidden_norm.weight"], eps)
    r = attn @ w["midlayer.self_attn.o_proj.weight"].T + (normed_g if cfg.get("norm_before_residual") else g)
    h = _rms(r, w["midlayer.post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(h @ w["midlayer.mlp.gate_proj.weight"].T) * (h @ w["midlayer.mlp.up_proj.weight"].T)
    f = mlp @ w["midlayer.mlp.down_proj.weight"].T + r
    draft_logits = _rms(f, w["norm.weight"], eps) @ w["lm_head.weight"].T
    logits = torch.full((seq, cfg["vocab_size"]), float("-inf"))
    logits[:, torch.arange(cfg["draft_vocab_size"]) + w["d2t"]] = draft_logits
    return logits, f


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("norm_before_residual", [False, True])
@torch.inference_mode()
def test_eagle3_head_logits_equal_the_reference_formulas(
    head_dir: Path, tmp_path: Path, norm_before_residual: bool
) -> None:
    if norm_before_residual:
        head_dir = _rewrite(head_dir, tmp_path / "nbr", {"norm_before_residual": True})
    cfg = json.loads((head_dir / "config.json").read_text())
    weights = load_file(str(head_dir / "model.safetensors"))
    head = _paged_head(head_dir)
    generator = torch.Generator().manual_seed(0)
    seq, hidden = 10, cfg["hidden_size"]
    embeds = torch.randn(seq, hidden, generator=generator)
    aux = torch.randn(seq, len(AUX_LAYERS) * hidden, generator=generator)
    want_logits, want_features = _reference(weights, cfg, embeds, aux)
    normed, features = head(embeds, head.combine_hidden_states(aux), *_batch(seq))
    logits = head.to_target_logits(head.compute_draft_logits(normed))
    torch.testing.assert_close(features, want_features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    # Only the draft vocabulary can be drafted, at the ids d2t names.
    mapped = torch.arange(DRAFT_VOCAB) + weights["d2t"]
    assert torch.isfinite(logits[:, mapped]).all() and int(torch.isfinite(logits).sum()) == seq * DRAFT_VOCAB


@torch.inference_mode()
def test_target_keeps_the_inputs_of_the_chosen_layers(target_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = load_model(target_dir, model_cls=LlamaForCausalLM, attn_backend=TorchNativeBackend,
                       dtype=torch.float32, device="cpu")
    _with_cache(model.get_attention_layers())
    input_ids = torch.randint(model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    model(input_ids, *_batch(9))
    assert model.get_aux_hidden_states() is None  # nothing asked for: nothing kept
    model.set_aux_hidden_state_layers((1, 0, 1))
    model(input_ids, *_batch(9))
    kept = model.get_aux_hidden_states()
    reference = AutoModelForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32).eval()
    hf = reference(input_ids[None], output_hidden_states=True).hidden_states  # [i]: the input of layer i
    torch.testing.assert_close(kept, torch.cat([hf[1][0], hf[0][0], hf[1][0]], dim=-1), atol=1e-5, rtol=1e-5)


def test_default_aux_layers_are_vllms() -> None:
    config = load_hf_config(cached_tiny_model("llama", seed=3))
    assert aux_layer_ids(config, 32) == (2, 16, 29)
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids.*\[0, 2\)"):
        aux_layer_ids(config, 2)  # (2, 1, -1) does not fit a 2-layer target


def _rewrite(head_dir: Path, out: Path, config: dict[str, Any] | None = None, **weights: torch.Tensor) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    base = json.loads((head_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(base, **(config or {}))))
    save_file(dict(load_file(str(head_dir / "model.safetensors")), **weights), str(out / "model.safetensors"))
    return out


def test_a_d2t_outside_the_target_vocabulary_is_refused(head_dir: Path, tmp_path: Path) -> None:
    d2t = load_file(str(head_dir / "model.safetensors"))["d2t"].clone()
    d2t[-1] = 10_000  # maps past the 512-token target vocabulary
    with pytest.raises(ConfigError, match=r"d2t.*distinct target ids in \[0, 512\)"):
        _paged_head(_rewrite(head_dir, tmp_path / "far", d2t=d2t))
    with pytest.raises(ConfigError, match=r"d2t of shape \(200,\)"):
        _paged_head(_rewrite(head_dir, tmp_path / "short", d2t=d2t[:10]))


def test_a_missing_d2t_or_a_wrong_fc_is_named(head_dir: Path, tmp_path: Path) -> None:
    weights = load_file(str(head_dir / "model.safetensors"))
    out = tmp_path / "no-d2t"
    _rewrite(head_dir, out)
    save_file({k: v for k, v in weights.items() if k != "d2t"}, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing weights \(1\): d2t"):
        _paged_head(out)
    with pytest.raises(ModelLoadError, match=r"fc\.weight"):  # 2 aux layers' fc for a 3-layer head
        _paged_head(_rewrite(head_dir, tmp_path / "fc", **{"fc.weight": weights["fc.weight"][:, :128].contiguous()}))


def test_own_embedding_copy_is_loaded(head_dir: Path, tmp_path: Path) -> None:
    cfg = json.loads((head_dir / "config.json").read_text())
    embedding = random_eagle3_weights(cfg, seed=5, with_embedding=True)["embed_tokens.weight"]
    head = _paged_head(_rewrite(head_dir, tmp_path / "embed", **{"embed_tokens.weight": embedding}))
    assert head.embed_tokens is not None
    torch.testing.assert_close(head.embed_tokens.weight, embedding)


def _llm_with(head: Path, target: Path) -> Any:
    from pagedllm import LLM

    return LLM(model=str(target), dtype="float32", num_kv_blocks=64,
               speculative_config={"method": "eagle3", "num_speculative_tokens": 2, "model": str(head)})


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"hidden_size": 32}, r"EAGLE-3 head for hidden size 64 \(this one has 32\)"),
        ({"vocab_size": 1000}, r"EAGLE-3 head for vocab size 512.*vocab_size 1000"),
        ({"draft_vocab_size": 600}, r"draft_vocab_size <= it.*draft_vocab_size 600"),
    ],
    ids=["hidden-size", "vocab-size", "draft-vocab-larger"],
)
def test_a_head_that_does_not_fit_the_target_is_a_config_error(
    head_dir: Path, target_dir: Path, tmp_path: Path, config: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        _llm_with(_rewrite(head_dir, tmp_path / "bad", config), target_dir)


@torch.inference_mode()
def test_training_head_computes_what_the_paged_head_computes(head_dir: Path) -> None:
    from transformers import LlamaConfig

    from pagedllm.training.train_eagle3 import TrainableEagle3Head

    cfg = json.loads((head_dir / "config.json").read_text())
    weights = load_file(str(head_dir / "model.safetensors"))
    trainable = TrainableEagle3Head(LlamaConfig(**cfg), len(AUX_LAYERS), torch.arange(DRAFT_VOCAB) + weights["d2t"])
    missing, unexpected = trainable.load_state_dict(weights, strict=False)
    assert unexpected == [] and all("rotary_emb" in name for name in missing)
    generator = torch.Generator().manual_seed(2)
    seq, hidden = 7, cfg["hidden_size"]
    embeds = torch.randn(1, seq, hidden, generator=generator)
    aux = torch.randn(1, seq, len(AUX_LAYERS) * hidden, generator=generator)
    want_logits, want_features = trainable.step(embeds, trainable.fc(aux), 0, [])
    head = _paged_head(head_dir)
    normed, features = head(embeds[0], head.combine_hidden_states(aux[0]), *_batch(seq))
    torch.testing.assert_close(features, want_features[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.compute_draft_logits(normed), want_logits[0], atol=1e-5, rtol=1e-5)


def test_a_target_that_keeps_no_aux_hidden_states_is_a_config_error(
    head_dir: Path, target_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model with the interface's default (a plugin's, say) is refused at
    start-up with the method named, not a NotImplementedError."""
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.model_registry.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "set_aux_hidden_state_layers",
                        ModelForCausalLM.set_aux_hidden_state_layers)
    with pytest.raises(ConfigError, match=r"speculative.method='eagle3'.*keeps auxiliary hidden states"):
        _llm_with(head_dir, target_dir)
