"""GGUF files written from a float HF checkpoint folder, the way llama.cpp's
convert_hf_to_gguf.py + llama-quantize lay them out (tests and benchmarks).

    write_gguf(hf_folder, out_file, "Q4_K_M")          # a preset: F32, F16, BF16, Q8_0, Q4_K_M
    write_gguf(hf_folder, out_file, {"blk.0.attn_q.weight": GGMLQuantizationType.Q6_K})  # others F32

Every tensor is stored in its type's own block packing: gguf.quants.quantize
where the package can (F16, BF16, Q8_0), else the round-to-nearest packers
below (Q4_K, Q6_K; llama.cpp's are search-based, the packing is the same), so
gguf.quants.dequantize -- and llama.cpp -- read them back. A matrix whose rows
do not split into a type's blocks falls back as llama-quantize does (Q8_0,
else F16). Llama's q/k rows are permuted as convert_hf_to_gguf.py does for
rotary. The tokenizer goes in as a byte-level BPE ("gpt2") vocabulary with its
merges and control tokens, what transformers needs to rebuild it from the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType, quants

QK_K = 256
PRESETS = ("F32", "F16", "BF16", "Q8_0", "Q4_K_M")
_FILE_TYPES = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
               "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M}
# HF module names -> GGUF's (the "Standardized tensor names" of the GGUF spec).
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def write_gguf(hf_folder: str | Path, out_file: str | Path, types: str | Mapping[str, GGMLQuantizationType]) -> Path:
    """`hf_folder` (config.json, model.safetensors, tokenizer.json) as one
    GGUF file; `types` a preset name or GGUF tensor name -> type (others F32)."""
    from safetensors.numpy import load_file

    folder, out_file = Path(hf_folder), Path(out_file)
    config = json.loads((folder / "config.json").read_text())
    arch = config["model_type"]
    state = load_file(str(folder / "model.safetensors"))
    writer = GGUFWriter(str(out_file), arch)
    _write_config(writer, config, types)
    _write_tokenizer(writer, folder)
    for hf_name in sorted(state):
        gguf_name = gguf_tensor_name(hf_name)
        weights = state[hf_name].astype(np.float32)
        if arch == "llama" and gguf_name.split(".")[2:3] in (["attn_q"], ["attn_k"]):
            weights = _permute_for_rotary(weights, config, is_key=".attn_k." in gguf_name)
        qtype = tensor_type(gguf_name, weights.shape, types, config["num_hidden_layers"])
        writer.add_tensor(gguf_name, quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def gguf_tensor_name(hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.{suffix}"
    _, _, index, local = module.split(".", 3)  # model.layers.N.<local>
    return f"blk.{index}.{_LAYER_NAMES[local]}.{suffix}"


def tensor_type(
    name: str, shape: tuple[int, ...], types: str | Mapping[str, GGMLQuantizationType], num_layers: int
) -> GGMLQuantizationType:
    if not isinstance(types, str):
        wanted = types.get(name, GGMLQuantizationType.F32)
    else:
        wanted = _preset_type(name, len(shape), types, num_layers)
    block_size = GGML_QUANT_SIZES[wanted][0]
    if shape[-1] % block_size == 0:
        return wanted
    return GGMLQuantizationType.Q8_0 if shape[-1] % 32 == 0 else GGMLQuantizationType.F16


def _preset_type(name: str, ndim: int, preset: str, num_layers: int) -> GGMLQuantizationType:
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r}; expected one of {PRESETS}")
    if ndim == 1 or preset == "F32":  # norms stay F32 in every llama.cpp file type
        return GGMLQuantizationType.F32
    if preset != "Q4_K_M":
        return GGMLQuantizationType[preset]
    if name == "output.weight":
        return GGMLQuantizationType.Q6_K
    if name.endswith((".attn_v.weight", ".ffn_down.weight")) and _use_more_bits(int(name.split(".")[1]), num_layers):
        return GGMLQuantizationType.Q6_K
    return GGMLQuantizationType.Q4_K


def _use_more_bits(layer: int, num_layers: int) -> bool:
    """llama-quant.cpp's choice of the layers whose attn_v / ffn_down get Q6_K in Q4_K_M."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def quantize(weights: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.Q4_K:
        return quantize_q4_k(weights)
    if qtype == GGMLQuantizationType.Q6_K:
        return quantize_q6_k(weights)
    return quants.quantize(weights, qtype)


def _fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """Q4_K (144 bytes per 256 values): fp16 d and dmin, 8 sub-blocks of 32
    with 6-bit scale and min packed into 12 bytes, 4-bit codes;
    x ~ d * sc_j * q - dmin * m_j."""
    rows = weights.shape[0]
    x = weights.reshape(-1, 8, 32)  # [super-blocks, sub-block j, 32]
    low = np.minimum(x.min(axis=-1), 0.0)
    scale = (x.max(axis=-1) - low) / 15
    d = _fp16(scale.max(axis=-1) / 63)
    dmin = _fp16(-low.min(axis=-1) / 63)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)), 0, 63).astype(np.uint8)
    step, offset = (d32 * sc)[..., None], (dmin32 * mn)[..., None]
    q = np.clip(np.rint(np.divide(x + offset, step, out=np.zeros_like(x), where=step > 0)), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
    ], axis=1)
    pairs = q.reshape(-1, 4, 2, 32)  # sub-blocks 2c (low nibble) and 2c + 1 (high) share 32 bytes
    codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed_scales, codes], axis=1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """Q6_K (210 bytes per 256 values): 16 groups of 16 with an int8 scale,
    6-bit codes (low 4 bits in ql, high 2 in qh), fp16 d at the end;
    x ~ d * sc_g * (q - 32)."""
    rows = weights.shape[0]
    x = weights.reshape(-1, 16, 16)
    scale = np.abs(x).max(axis=-1) / 31
    d = _fp16(scale.max(axis=-1) / 127)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 127).astype(np.int8)
    step = (d32 * sc)[..., None]
    q = np.clip(np.rint(np.divide(x, step, out=np.zeros_like(x), where=step > 0)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [super-block, half c, row s, 32]: value c*128 + s*32 + l
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    ql = ((q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)).reshape(-1, 128)  # rows s and s+2 share a byte
    blocks = np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d[:, None].view(np.uint8)], axis=1)
    return blocks.reshape(rows, -1)


def _permute_for_rotary(weights: np.ndarray, config: dict[str, Any], *, is_key: bool) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from
    HF's rotate-half order to llama.cpp's interleaved pairs."""
    heads = config["num_key_value_heads"] if is_key else config["num_attention_heads"]
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _write_config(writer: GGUFWriter, config: dict[str, Any], types: str | Mapping[str, Any]) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_name(config["model_type"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get(
        "rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if isinstance(types, str):
        writer.add_file_type(_FILE_TYPES[types])


def _write_tokenizer(writer: GGUFWriter, folder: Path) -> None:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tokenizer["model"]["vocab"])
    special = {token["content"]: token["id"] for token in tokenizer.get("added_tokens", []) if token["special"]}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.__getitem__)
    token_types = [TokenType.CONTROL if token in special else TokenType.NORMAL for token in tokens]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if tokenizer_config.get(key) in vocab:
            add(vocab[tokenizer_config[key]])
