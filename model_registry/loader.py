"""Hugging Face checkpoints: config.json and (sharded) safetensors.

`load_model` builds the model on the device in the requested dtype and loads
every weight with a strict check: each missing and each unexpected
checkpoint name is reported, in checkpoint names (``...q_proj.weight``, not
the stacked ``qkv_proj``), so the message matches what the user sees in the
files. Checkpoint tensors are memory-mapped views: a tensor-parallel layer's
weight loader narrows each to its rank's slice, so only that slice is copied.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.core.errors import PagedLLMError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pagedllm.attention_backends.base import AttentionBackend

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class ModelLoadError(PagedLLMError):
    """The checkpoint does not fit the model: missing, unexpected or misshaped weights."""

    def __init__(
        self,
        model_path: str | Path,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        detail: str | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        parts = []
        if self.missing:
            parts.append(f"missing weights ({len(self.missing)}): {', '.join(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected weights ({len(self.unexpected)}): {', '.join(self.unexpected)}")
        if detail:
            parts.append(detail)
        super().__init__(f"cannot load {self.model_path}: " + "; ".join(parts))


def load_hf_config(model_path: str | Path) -> PretrainedConfig:
    """config.json of a local model folder (never the network)."""
    from transformers import AutoConfig

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(path, detail="no config.json in the model folder")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


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


def iterate_safetensors(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of model.safetensors or of the shards
    listed in model.safetensors.index.json; memory-mapped (`mmap_safetensors`)."""
    path = Path(model_path)
    if (path / SAFETENSORS_INDEX).is_file():
        weight_map: dict[str, str] = json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / SAFETENSORS_SINGLE).is_file():
        files = [SAFETENSORS_SINGLE]
    else:
        raise ModelLoadError(path, detail=f"neither {SAFETENSORS_SINGLE} nor {SAFETENSORS_INDEX} found")
    for file_name in files:
        yield from mmap_safetensors(path / file_name)


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
    names = set()
    for param_name, _ in model.named_parameters():  # tied params appear once
        parts = param_name.split(".")
        stacked = next((i for i, part in enumerate(parts) if part in sources_of), None)
        if stacked is None:
            names.add(param_name)
            continue
        for source in sources_of[parts[stacked]]:
            names.add(".".join(parts[:stacked] + [source] + parts[stacked + 1 :]))
    return names


def load_weights_strict(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], model_path: str | Path) -> None:
    """Feed the expected weights to model.load_weights; raise ModelLoadError
    naming every missing and unexpected one."""
    expected = expected_checkpoint_names(model)
    is_ignored = getattr(model, "is_ignored_weight", lambda name: False)
    seen: set[str] = set()
    unexpected: set[str] = set()

    def accepted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name in expected:
                seen.add(name)
                yield name, tensor
            elif not is_ignored(name):
                unexpected.add(name)

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
) -> nn.Module:
    """Build ``model_cls`` on ``device`` in ``dtype`` and load the checkpoint strictly."""
    if hf_config is None:
        hf_config = load_hf_config(model_path)
    with torch.device(device):
        model = model_cls(hf_config, attn_backend, dtype=dtype)
    load_weights_strict(model, iterate_safetensors(model_path), model_path)
    return model.eval()
