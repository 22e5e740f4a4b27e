"""GGUF checkpoints (llama.cpp's single-file format): `model.gguf`.

The config comes from the file's metadata through transformers
(`AutoConfig.from_pretrained(folder, gguf_file=name)`), the tokenizer likewise
(model_registry/tokenizer.py); the tensors are read here with the `gguf`
package's memory-mapped GGUFReader, one at a time, each dequantized to
float32 (`gguf.quants.dequantize`) as the loader reaches it and renamed to
the HF checkpoint name the model classes load (`GGUF_TENSOR_NAMES`).

llama.cpp's converter permutes Llama's q_proj / k_proj rows so that rotary
acts on interleaved pairs; `unpermute_rotary_rows` puts them back in HF's
rotate-half order (any row-major tensor of those rows: a float weight, or
the raw blocks of a quantized one, whose rows are whole blocks).

Linear weights of the types in `KEPT_QUANTIZED_TYPES` stay quantized: the
config carries ``quantization_config = {"quant_method": "gguf",
"tensor_types": {HF module name: GGUF type name}}`` naming them (so the
"gguf" quantization method, quantization/gguf.py, serves the file), and
`iterate_gguf` yields each as ``<module>.qweight``: its raw GGUF blocks,
uint8 [out, bytes per row], rows unpermuted. A tensor stays quantized only
together with the other shards of its stacked layer (q/k/v, gate/up), so a
layer loads either quantized or float, never half of each. Everything else
(F16/F32, other quant types, the embedding, the LM head, norms) is
dequantized to float32 as it is read.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedllm.model_registry.load_error import ModelLoadError

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType, GGUFReader
    from transformers import PretrainedConfig

GGUF_SUFFIX = ".gguf"
# general.architecture -> the model class that serves it.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose q/k rows llama.cpp's converter permuted for rotary.
PERMUTED_ROTARY_ARCHITECTURES = frozenset({"llama"})
# GGUF tensor names (the GGUF spec's standardized names) -> HF checkpoint names.
GGUF_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp writes that the model computes itself (llama3 rope's
# frequency factors come from the config).
IGNORED_GGUF_TENSORS = frozenset({"rope_freqs.weight"})
# NOTE: the types quantization/gguf_convert.py converts exactly to the
# grouped 8/4-bit layout; a test holds the two lists together.
KEPT_QUANTIZED_TYPES = frozenset({"Q8_0", "Q6_K", "Q4_K"})
# A layer's linear tensors; those of one group load into one stacked layer.
GGUF_LINEAR_GROUPS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))
QUANTIZED_WEIGHT = "qweight"
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf_file(model_path: str | Path) -> bool:
    """A `.gguf` path names a GGUF checkpoint (the loader's load_format `auto` picks `gguf`)."""
    return str(model_path).endswith(GGUF_SUFFIX)


def open_gguf(model_path: str | Path) -> GGUFReader:
    from gguf import GGUFReader

    path = Path(model_path)
    if not path.is_file():
        raise ModelLoadError(path, detail="no such GGUF file")
    try:
        return GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as err:  # an unknown type id is a ValueError
        raise ModelLoadError(path, detail=f"not a readable GGUF file ({err})") from err


def gguf_architecture(metadata: Mapping[str, Any], model_path: str | Path) -> str:
    """general.architecture, when a model class serves it; else a ModelLoadError."""
    architecture = metadata.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelLoadError(model_path, detail=(
            f"GGUF general.architecture={architecture!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        ))
    return str(architecture)


def read_gguf_metadata(model_path: str | Path) -> dict[str, Any]:
    """The file's key-value metadata, string arrays (the vocabulary) left as
    counts: transformers' fast reader (GGUFReader parses every token string)."""
    from transformers.integrations.gguf import read_gguf_metadata as read_metadata

    path = Path(model_path)
    if not path.is_file():
        raise ModelLoadError(path, detail="no such GGUF file")
    if importlib.util.find_spec("gguf") is None:  # transformers and the loader both read the file with it
        raise ModelLoadError(path, detail="reading GGUF files needs the gguf package: pip install 'pagedllm[gguf]'")
    try:
        metadata, _ = read_metadata(str(path))
    except (OSError, ValueError, KeyError, IndexError, UnicodeDecodeError) as err:
        raise ModelLoadError(path, detail=f"not a readable GGUF file ({err!r})") from err
    return dict(metadata)


def load_gguf_config(model_path: str | Path) -> PretrainedConfig:
    """The HF config the file's metadata describes (transformers' GGUF
    mapping), with `architectures` naming the model class."""
    from transformers import AutoConfig

    path = Path(model_path)
    metadata = read_gguf_metadata(path)
    architecture = gguf_architecture(metadata, path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                        trust_remote_code=False)
    config.architectures = [GGUF_ARCHITECTURES[architecture]]
    tensor_types = quantized_tensor_types(open_gguf(path))
    if tensor_types:  # else a float file: stage A, and model.quantization may quantize it at load
        config.quantization_config = {"quant_method": "gguf", "tensor_types": tensor_types}
    key_length = metadata.get(f"{architecture}.attention.key_length")
    if key_length is not None:  # transformers maps it only for some architectures (not qwen3)
        config.head_dim = int(key_length)
    return config


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor; None for one no table names."""
    module, _, suffix = gguf_name.rpartition(".")
    if module in GGUF_TENSOR_NAMES:
        return f"{GGUF_TENSOR_NAMES[module]}.{suffix}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in GGUF_LAYER_TENSOR_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{GGUF_LAYER_TENSOR_NAMES[match.group(2)]}.{match.group(3)}"


@functools.cache
def can_dequantize(tensor_type: GGMLQuantizationType) -> bool:
    """Whether gguf.quants dequantizes this type (tried on one zero block)."""
    from gguf import GGML_QUANT_SIZES, quants

    _, type_size = GGML_QUANT_SIZES[tensor_type]
    try:
        quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), tensor_type)
    except (NotImplementedError, ValueError):
        return False
    return True


def check_gguf_tensor_types(reader: GGUFReader, model_path: str | Path) -> None:
    """A ModelLoadError naming every tensor of a type nothing dequantizes."""
    unsupported = [f"{tensor.name} ({tensor.tensor_type.name})" for tensor in reader.tensors
                   if not can_dequantize(tensor.tensor_type)]
    if unsupported:
        raise ModelLoadError(model_path, detail=(
            f"GGUF tensor types that cannot be dequantized: {', '.join(unsupported)}"
        ))


def quantized_tensor_types(reader: GGUFReader) -> dict[str, str]:
    """HF module name -> GGUF type name of every linear weight `iterate_gguf`
    yields quantized: one of `KEPT_QUANTIZED_TYPES` whose stacked siblings
    (`GGUF_LINEAR_GROUPS`) all are too."""
    types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors if len(tensor.shape) == 2}
    kept: dict[str, str] = {}
    for name, type_name in types.items():
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None or match.group(3) != "weight":
            continue
        group = next((kinds for kinds in GGUF_LINEAR_GROUPS if match.group(2) in kinds), None)
        siblings = [f"blk.{match.group(1)}.{kind}.weight" for kind in group or ()]
        if siblings and all(types.get(sibling) in KEPT_QUANTIZED_TYPES for sibling in siblings):
            kept[str(hf_tensor_name(name)).removesuffix(".weight")] = type_name
    return kept


def unpermute_rotary_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's q/k permutation along dim 0: per head,
    llama.cpp's interleaved (pair, half) rows back to HF's (half, pair)."""
    shape = rows.shape
    return rows.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _rotary_heads(reader: GGUFReader, architecture: str) -> dict[str, int]:
    """The heads each permuted tensor was permuted with: attn_q by the query
    heads, attn_k by the KV heads."""
    if architecture not in PERMUTED_ROTARY_ARCHITECTURES:
        return {}
    heads = int(_field(reader, f"{architecture}.attention.head_count"))
    kv_heads = _field(reader, f"{architecture}.attention.head_count_kv")
    return {"attn_q": heads, "attn_k": int(kv_heads) if kv_heads is not None else heads}


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def dequantize_tensor(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as float32, in torch's dim order (GGUF lists ne0 first)."""
    from gguf import quants

    values = np.ascontiguousarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if not values.flags.writeable:  # F32 data is a view of the read-only map
        values = values.copy()
    shape = [int(dim) for dim in reversed(tensor.shape)]
    return torch.from_numpy(values).reshape(shape)


def raw_blocks(tensor: Any) -> torch.Tensor:
    """A quantized GGUF tensor's blocks as stored: uint8 [rows, bytes per row]."""
    data = np.array(tensor.data, dtype=np.uint8, copy=True)  # the map is read-only
    return torch.from_numpy(data).reshape(int(tensor.shape[-1]), -1)


def iterate_gguf(model_path: str | Path, keep_quantized: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of a GGUF file, read one at a time
    as the loader asks for it: float32, dequantized, or (`keep_quantized`,
    the tensors `quantized_tensor_types` names) ``<module>.qweight``, its raw
    blocks. A tensor no table names keeps its GGUF name (the strict loader
    reports it as unexpected)."""
    reader = open_gguf(model_path)
    architecture = gguf_architecture({"general.architecture": _field(reader, "general.architecture")}, model_path)
    check_gguf_tensor_types(reader, model_path)
    rotary_heads = _rotary_heads(reader, architecture)
    quantized = quantized_tensor_types(reader) if keep_quantized else {}
    for tensor in reader.tensors:
        if tensor.name in IGNORED_GGUF_TENSORS:
            continue
        name = hf_tensor_name(tensor.name) or tensor.name
        module = name.removesuffix(".weight")
        if module in quantized:
            name, weights = f"{module}.{QUANTIZED_WEIGHT}", raw_blocks(tensor)
        else:
            weights = dequantize_tensor(tensor)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
        if kind in rotary_heads:
            weights = unpermute_rotary_rows(weights, rotary_heads[kind])
        yield name, weights
