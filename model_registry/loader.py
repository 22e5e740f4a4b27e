"""Hugging Face checkpoints: config.json and (sharded) safetensors or
PyTorch .bin weights.

`load_model` builds the model on the device in the requested dtype and loads
every weight with a strict check: each missing and each unexpected
checkpoint name is reported, in checkpoint names (``...q_proj.weight``, not
the stacked ``qkv_proj``), so the message matches what the user sees in the
files. `load_format` (vLLM's names) picks the weight files: `auto`
(a `.gguf` file: gguf; else safetensors when present, else .bin),
`safetensors`, `pt`, `gguf` (one llama.cpp file, dequantized at load:
gguf_checkpoint.py) or `dummy` (random weights of the checkpoint's shapes,
no weight file read). Checkpoint
tensors are memory-mapped views: a tensor-parallel layer's
weight loader narrows each to its rank's slice, so only that slice is copied.

A checkpoint whose config.json has a `quantization_config` loads only into a
model class that lists its `quant_method` in `checkpoint_quant_methods`
(GPT-OSS: "mxfp4", dequantized at load); any other is refused by name
(`check_checkpoint_quantization`) rather than misread as float weights.
A quantization method that reads the format gives the model the checkpoint's
storage before loading; per-tensor fp8 KV-cache scales are matched to the
attention layers by the names checkpoints give them (`kv_scale_aliases`).
"""

from __future__ import annotations

import json
import mmap
import pickle
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from pagedllm.model_registry.gguf_checkpoint import is_gguf_file, iterate_gguf, load_gguf_config
from pagedllm.model_registry.load_error import ModelLoadError as ModelLoadError
from pagedllm.model_registry.plain_config import read_plain_config
from pagedllm.model_registry.remote_code import remote_code_guard

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pagedllm.attention_backends.base import AttentionBackend

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_SINGLE = "pytorch_model.bin"
PT_INDEX = "pytorch_model.bin.index.json"
# Dummy weights are uniform in +-DUMMY_WEIGHT_RANGE (vLLM's range): small
# enough that activations stay finite through any number of layers.
DUMMY_WEIGHT_RANGE = 1e-3


def load_hf_config(model_path: str | Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """config.json of a local model folder (never the network): read
    directly for a known architecture (`plain_config`, what AutoConfig would
    give without its ~2 s of imports), else by AutoConfig, which imports the
    checkpoint's own config class only with `trust_remote_code`; a `.gguf`
    file's metadata (model_registry/gguf_checkpoint.py)."""
    path = Path(model_path)
    if is_gguf_file(path):  # the config is the file's metadata
        return load_gguf_config(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(path, detail="no config.json in the model folder")
    plain = read_plain_config(path)
    if plain is not None:
        return cast("PretrainedConfig", plain)
    from transformers import AutoConfig

    with remote_code_guard(path, "config.json", trust_remote_code):
        return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)


def checkpoint_quant_method(hf_config: Any) -> str | None:
    """config.json's `quantization_config.quant_method` ("mxfp4", "fp8",
    ...), lowercased; None for a float checkpoint. A quantization_config
    without a method reads as "(none given)"."""
    quant_config = getattr(hf_config, "quantization_config", None)
    if quant_config is None:
        return None
    method = quant_config.get("quant_method") if isinstance(quant_config, dict) else (
        getattr(quant_config, "quant_method", None))
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    return str(method).lower() if method else "(none given)"


def check_checkpoint_quantization(hf_config: Any, model_cls: type, model_path: str | Path) -> None:
    """ModelLoadError unless `model_cls` loads the checkpoint's quantization
    (its `checkpoint_quant_methods`; none: float checkpoints only). Weights
    stored in a format the model does not read would otherwise be refused
    name by name by the strict loader, or worse, loaded as if they were float."""
    method = checkpoint_quant_method(hf_config)
    supported: tuple[str, ...] = tuple(getattr(model_cls, "checkpoint_quant_methods", ()))
    if method is None or method in supported:
        return
    allowed = ", ".join(supported) if supported else "none, float checkpoints only"
    raise ModelLoadError(model_path, detail=(
        f"config.json quantization_config.quant_method={method!r} is not supported by {model_cls.__name__}; "
        f"supported: {allowed} (a float checkpoint may be quantized at load: model.quantization)"
    ))


def get_architecture(hf_config: Any, override: str | None = None) -> str:
    if override:
        return override
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ModelLoadError(
            getattr(hf_config, "_name_or_path", "?"),
            detail="config.json names no architectures; pass the architecture explicitly",
        )
    return str(architectures[0])


# safetensors dtype names (the format's header) -> torch dtypes.
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def mmap_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of one safetensors file, by name, each a
    zero-copy view of the memory-mapped file.

    A page of the file is read only when a weight loader touches it, so a
    tensor-parallel layer that narrows a tensor to its rank's slice before
    copying reads (roughly) that slice, and no rank holds a private copy of a
    whole checkpoint matrix. The map is copy-on-write (nothing ever writes to
    it; torch wants a writable buffer) and closes when its last view is freed.
    """
    try:
        with open(file, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            header: dict[str, Any] = json.loads(f.read(header_size))
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        header.pop("__metadata__", None)
        entries = [(name, header[name]) for name in sorted(header)]
        dtypes = [_SAFETENSORS_DTYPES[info["dtype"]] for _, info in entries]
    except (OSError, ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
        raise ModelLoadError(file.parent, detail=f"{file.name} is not a readable safetensors file ({err!r})") from err
    data_start = 8 + header_size
    for (name, info), dtype in zip(entries, dtypes, strict=True):
        begin, end = info["data_offsets"]
        if end == begin:  # frombuffer refuses an empty range
            yield name, torch.empty(info["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=data_start + begin)
        yield name, flat.view(info["shape"])


def _weight_files(path: Path, single: str, index: str) -> list[str] | None:
    """The files of one format: the shards its index lists, or its single
    file; None when the folder has neither."""
    if (path / index).is_file():
        weight_map: dict[str, str] = json.loads((path / index).read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    if (path / single).is_file():
        return [single]
    return None


def iterate_safetensors(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of model.safetensors or of the shards
    listed in model.safetensors.index.json; memory-mapped (`mmap_safetensors`)."""
    path = Path(model_path)
    files = _weight_files(path, SAFETENSORS_SINGLE, SAFETENSORS_INDEX)
    if files is None:
        raise ModelLoadError(path, detail=f"neither {SAFETENSORS_SINGLE} nor {SAFETENSORS_INDEX} found")
    for file_name in files:
        yield from mmap_safetensors(path / file_name)


def iterate_pt(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of pytorch_model.bin or of the shards
    listed in pytorch_model.bin.index.json, by name within each file.
    `weights_only`: a pickle may hold tensors and plain containers, never code."""
    path = Path(model_path)
    files = _weight_files(path, PT_SINGLE, PT_INDEX)
    if files is None:
        raise ModelLoadError(path, detail=f"load_format 'pt': neither {PT_SINGLE} nor {PT_INDEX} found")
    for file_name in files:
        try:
            state = torch.load(path / file_name, map_location="cpu", weights_only=True, mmap=True)
        except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as err:
            raise ModelLoadError(path, detail=f"{file_name} is not a readable PyTorch weights file ({err})") from err
        if not isinstance(state, dict):
            raise ModelLoadError(path, detail=f"{file_name} holds a {type(state).__name__}, not a name -> tensor dict")
        for name in sorted(state):
            yield name, state[name]


def resolve_load_format(model_path: str | Path, load_format: str) -> str:
    """`auto` resolved: gguf for a `.gguf` file; safetensors when the folder
    has them, else pt when it has .bin weights, else safetensors (whose error
    names the missing files)."""
    if load_format != "auto":
        return load_format
    path = Path(model_path)
    if is_gguf_file(path):
        return "gguf"
    if _weight_files(path, SAFETENSORS_SINGLE, SAFETENSORS_INDEX) is None and (
        _weight_files(path, PT_SINGLE, PT_INDEX) is not None
    ):
        return "pt"
    return "safetensors"


def iterate_checkpoint(model_path: str | Path, load_format: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight file `load_format` names (not `dummy`:
    it reads none)."""
    resolved = resolve_load_format(model_path, load_format)
    if resolved == "safetensors":
        return iterate_safetensors(model_path)
    if resolved == "pt":
        return iterate_pt(model_path)
    if resolved == "gguf":
        return iterate_gguf(model_path)
    raise ValueError(f"load_format {load_format!r} reads no weight files")


def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Every parameter uniform in +-DUMMY_WEIGHT_RANGE (a tied one once),
    seeded, on its own device: the checkpoint's shapes, none of its values."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for param in model.parameters():
            if not param.is_floating_point():
                continue
            generator = generators.get(param.device)
            if generator is None:
                generator = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)


def check_weight_shape(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: model expects {tuple(param.shape)}, checkpoint has {tuple(loaded.shape)}")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    check_weight_shape(param, loaded)
    with torch.no_grad():
        param.copy_(loaded)  # converts dtype and device


def expected_checkpoint_names(model: nn.Module) -> set[str]:
    """The checkpoint names that together fill every parameter of the model."""
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules_mapping", {})
    sources_of: dict[str, list[str]] = {}
    for source, (target, _) in packed.items():
        sources_of.setdefault(target, []).append(source)
    names: set[str] = set()
    # Layers that name their own checkpoint tensors (the MoE experts).
    own_names: dict[str, dict[str, list[str]]] = {
        prefix: module.checkpoint_names() for prefix, module in model.named_modules()
        if callable(getattr(module, "checkpoint_names", None))
    }
    for prefix, param_names in own_names.items():
        names.update(f"{prefix}.{name}" for names_of_param in param_names.values() for name in names_of_param)
    for param_name, _ in model.named_parameters():  # tied params appear once
        module_name, _, local_name = param_name.rpartition(".")
        if local_name in own_names.get(module_name, {}):
            continue
        parts = param_name.split(".")
        stacked = next((i for i, part in enumerate(parts) if part in sources_of), None)
        if stacked is None:
            names.add(param_name)
            continue
        for source in sources_of[parts[stacked]]:
            names.add(".".join(parts[:stacked] + [source] + parts[stacked + 1 :]))
    return names


# Per-tensor fp8 KV-cache scales as checkpoints name them beside an attention
# module: compressed-tensors' `self_attn.k_scale`, vLLM's older
# `self_attn.k_proj.output_scale`. A model without a parameter for them (no
# quantization method loads them) accepts and ignores them.
KV_SCALE_SUFFIXES = {"k_scale": ("k_scale", "k_proj.output_scale"), "v_scale": ("v_scale", "v_proj.output_scale")}


def is_kv_scale_name(name: str) -> bool:
    return name.endswith(tuple(f".{alias}" for aliases in KV_SCALE_SUFFIXES.values() for alias in aliases))


def kv_scale_aliases(expected: Iterable[str]) -> dict[str, str]:
    """Checkpoint name -> the expected KV-scale parameter it fills: for
    `model.layers.0.self_attn.attn.k_scale`, `model.layers.0.self_attn.k_scale`
    and `model.layers.0.self_attn.k_proj.output_scale`."""
    aliases: dict[str, str] = {}
    for name in expected:
        module, _, local = name.rpartition(".")
        if local not in KV_SCALE_SUFFIXES or not module:
            continue
        parent = module.rpartition(".")[0]
        for alias in KV_SCALE_SUFFIXES[local]:
            aliases[f"{parent}.{alias}" if parent else alias] = name
    return aliases


def load_weights_strict(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], model_path: str | Path) -> None:
    """Feed the expected weights to model.load_weights; raise ModelLoadError
    naming every missing and unexpected one."""
    expected = expected_checkpoint_names(model)
    is_ignored = getattr(model, "is_ignored_weight", lambda name: False)
    map_name = getattr(model, "map_checkpoint_name", None)  # absent on duck-typed (1.0) models
    kv_scales = kv_scale_aliases(expected)
    seen: set[str] = set()
    unexpected: set[str] = set()

    def accepted() -> Iterator[tuple[str, torch.Tensor]]:
        for checkpoint_name, tensor in weights:
            name = checkpoint_name if map_name is None else map_name(checkpoint_name)
            name = kv_scales.get(name, name)
            if name in expected:
                seen.add(name)
                yield name, tensor
            elif not is_ignored(name) and not is_kv_scale_name(name):
                unexpected.add(checkpoint_name)

    try:
        loaded_params = model.load_weights(accepted())  # type: ignore[operator]
    except ValueError as err:  # a shape mismatch
        raise ModelLoadError(model_path, detail=str(err)) from err
    missing = expected - seen
    not_loaded = {name for name, _ in model.named_parameters()} - set(loaded_params)
    if missing or unexpected or not_loaded:
        if not_loaded and not missing:  # the model skipped something it was given
            missing = not_loaded
        raise ModelLoadError(model_path, missing=missing, unexpected=unexpected)


def load_model(
    model_path: str | Path,
    *,
    model_cls: type[nn.Module],
    attn_backend: type[AttentionBackend],
    dtype: torch.dtype,
    device: str | torch.device,
    hf_config: PretrainedConfig | None = None,
    load_format: str = "auto",
    seed: int = 0,
    create_quantized_weights: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """Build ``model_cls`` on ``device`` in ``dtype`` and load the checkpoint
    strictly (``load_format`` ``dummy``: random weights, seeded by ``seed``).
    `create_quantized_weights(model)`, for a quantized checkpoint that a
    quantization method reads, gives the built model the checkpoint's storage
    before any weight is loaded (worker/quantize.py)."""
    if hf_config is None:
        hf_config = load_hf_config(model_path)
    if load_format != "dummy" and create_quantized_weights is None:  # dummy weights read no file
        check_checkpoint_quantization(hf_config, model_cls, model_path)
    with torch.device(device):
        model = model_cls(hf_config, attn_backend, dtype=dtype)
        if create_quantized_weights is not None:
            create_quantized_weights(model)
    if load_format == "dummy":
        initialize_dummy_weights(model, seed)
    else:
        load_weights_strict(model, iterate_checkpoint(model_path, load_format), model_path)
    return model.eval()
