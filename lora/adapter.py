"""Loading a PEFT LoRA adapter: adapter_config.json + adapter_model.safetensors.

Only safetensors are read (a pickled .bin can run code when loaded), and
only up to `max_bytes` in all. Every check names what failed and the limit:
a rank above `max_rank`, a module the base model lacks, shapes that do not
fit the base model's (an adapter trained for another base model), and the
PEFT features this engine does not compute (DoRA, LoRA biases, trained
copies of whole modules, embedding adapters, per-module alphas).

The adapter's tensors come back per base-checkpoint module
("model.layers.0.self_attn.q_proj"): "<module>.lora_A" [r, in] and
"<module>.lora_B" [out, r] in float32, B already multiplied by the module's
scaling (alpha / r, or alpha / sqrt(r) with rsLoRA), with the content digest
(lora/identity.py) computed over the tensors as stored.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.lora import LoRARef
from pagedllm.lora.identity import adapter_digest

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
# PEFT's saved names: "base_model.model.<module>.lora_A.weight".
_PEFT_PREFIX = "base_model.model."
_A_SUFFIX, _B_SUFFIX = ".lora_A.weight", ".lora_B.weight"
_REFUSED_CONFIG = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "modules_to_save": "adapters that train whole modules (modules_to_save) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
}


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be served: the field, the value, the limit."""


@dataclass(frozen=True)
class LoRAAdapterConfig:
    rank: int  # the largest rank of its modules
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # the base modules it adapts, sorted
    base_model_name_or_path: str | None

    def scaling(self, rank: int) -> float:
        """PEFT's scaling of a module of rank `rank`."""
        return self.alpha / (math.sqrt(rank) if self.use_rslora else rank)


@dataclass(frozen=True)
class LoRAAdapter:
    ref: LoRARef
    config: LoRAAdapterConfig
    # "<module>.lora_A" [r, in] and "<module>.lora_B" [out, r] (scaled), float32.
    weights: dict[str, torch.Tensor]
    num_bytes: int


def load_lora_adapter(
    path: str | os.PathLike[str],
    *,
    name: str,
    max_rank: int,
    max_bytes: int,
    base_modules: Mapping[str, tuple[int, int]] | None = None,
) -> LoRAAdapter:
    """Read, check and digest the PEFT adapter in folder `path`.
    `base_modules`: the base model's module -> (out, in) (`base_model_modules`);
    None skips the checks against the base model."""
    folder = Path(path)
    files = _adapter_files(folder, name, max_bytes)
    raw = _read_config(files[0], name)
    modules = _read_modules(files[1], name)
    for module, (lora_a, lora_b) in modules.items():
        _check_module(name, module, lora_a, lora_b, max_rank, base_modules)
    config = LoRAAdapterConfig(
        rank=max(lora_a.shape[0] for lora_a, _ in modules.values()),
        alpha=float(raw.get("lora_alpha", 8)),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=tuple(sorted(modules)),
        base_model_name_or_path=str(raw["base_model_name_or_path"]) if raw.get("base_model_name_or_path") else None,
    )
    scaled = {module: (a, b, config.scaling(a.shape[0])) for module, (a, b) in modules.items()}
    weights: dict[str, torch.Tensor] = {}
    for module, (lora_a, lora_b, scaling) in scaled.items():
        weights[f"{module}.lora_A"] = lora_a.float()
        weights[f"{module}.lora_B"] = lora_b.float() * scaling
    ref = LoRARef(name=name, digest=adapter_digest(scaled), path=str(folder.resolve()))
    return LoRAAdapter(ref, config, weights, sum(file.stat().st_size for file in files))


def _adapter_files(folder: Path, name: str, max_bytes: int) -> tuple[Path, Path]:
    if not folder.is_dir():
        raise LoRAAdapterError("lora_path", str(folder), f"a folder holding {CONFIG_NAME} and {WEIGHTS_NAME}")
    config_file, weights_file = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not config_file.is_file():
        raise LoRAAdapterError("lora_path", str(folder), f"adapter {name!r}: a PEFT adapter folder with {CONFIG_NAME}")
    if not weights_file.is_file():
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        why = f" (found {', '.join(sorted(pickled))}: pickled weights are never loaded)" if pickled else ""
        raise LoRAAdapterError("lora_path", str(folder), f"adapter {name!r}: {WEIGHTS_NAME}{why}")
    total = config_file.stat().st_size + weights_file.stat().st_size
    if total > max_bytes:
        raise LoRAAdapterError("lora_path", str(folder), f"adapter {name!r}: {total} bytes, at most {max_bytes}")
    return config_file, weights_file


def _read_config(config_file: Path, name: str) -> dict[str, Any]:
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoRAAdapterError(CONFIG_NAME, str(config_file), f"at most {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(CONFIG_NAME, str(config_file), f"adapter {name!r}: valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise LoRAAdapterError(CONFIG_NAME, str(config_file), "a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError("peft_type", peft_type, f"adapter {name!r}: 'LORA'")
    for key, why in _REFUSED_CONFIG.items():
        if raw.get(key):
            raise LoRAAdapterError(key, raw[key], f"adapter {name!r}: {why}")
    if raw.get("bias", "none") != "none":
        raise LoRAAdapterError("bias", raw["bias"], f"adapter {name!r}: 'none' (LoRA biases are not supported)")
    if raw.get("fan_in_fan_out"):
        raise LoRAAdapterError("fan_in_fan_out", True, f"adapter {name!r}: false (Conv1D-style layers)")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAAdapterError("lora_alpha", alpha, f"adapter {name!r}: a finite number")
    return raw


def _read_modules(weights_file: Path, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights_file)
    except (SafetensorError, OSError, ValueError) as exc:
        why = f"adapter {name!r}: a safetensors file ({exc})"
        raise LoRAAdapterError(WEIGHTS_NAME, str(weights_file), why) from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module_key = key.removeprefix(_PEFT_PREFIX)
        for suffix, half in ((_A_SUFFIX, "A"), (_B_SUFFIX, "B")):
            if module_key.endswith(suffix):
                halves.setdefault(module_key.removesuffix(suffix), {})[half] = tensor
                break
        else:
            raise LoRAAdapterError(
                "weights", key, f"adapter {name!r}: only lora_A / lora_B matrices of linear layers are supported"
            )
    if not halves:
        raise LoRAAdapterError(WEIGHTS_NAME, str(weights_file), f"adapter {name!r}: at least one adapted module")
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError("weights", module, f"adapter {name!r}: both lora_A and lora_B of each module")
        modules[module] = (pair["A"], pair["B"])
    return modules


def _check_module(
    name: str,
    module: str,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    max_rank: int,
    base_modules: Mapping[str, tuple[int, int]] | None,
) -> None:
    if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != lora_b.shape[1]:
        raise LoRAAdapterError(
            "weights", module, f"adapter {name!r}: lora_A [r, in] and lora_B [out, r] of one rank, "
            f"got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}"
        )
    if not (lora_a.is_floating_point() and lora_b.is_floating_point()):
        raise LoRAAdapterError("weights", module, f"adapter {name!r}: float tensors, got {lora_a.dtype}")
    rank = lora_a.shape[0]
    if rank > max_rank:
        raise LoRAAdapterError("r", rank, f"adapter {name!r}, module {module}: at most max_lora_rank={max_rank}")
    if base_modules is None:
        return
    shape = base_modules.get(module)
    if shape is None:
        raise LoRAAdapterError(
            "target_modules", module, f"adapter {name!r}: a linear module of the base model (it has no such module)"
        )
    if (lora_b.shape[0], lora_a.shape[1]) != shape:
        raise LoRAAdapterError(
            "weights", module, f"adapter {name!r} was trained for another base model: this model's {module} is "
            f"[out={shape[0]}, in={shape[1]}], the adapter's is [out={lora_b.shape[0]}, in={lora_a.shape[1]}]"
        )


def base_model_modules(model_path: str | os.PathLike[str]) -> dict[str, tuple[int, int]] | None:
    """The base checkpoint's linear modules -> (out, in): every 2-D
    "<module>.weight" in its safetensors headers (no tensor is read).
    None for a checkpoint without float safetensors (GGUF, .bin, packed
    quantized weights): no checks then."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    modules: dict[str, tuple[int, int]] = {}
    for file in files:
        with safe_open(file, framework="pt") as reader:
            for key in reader.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if key.endswith((".qweight", ".weight_packed")):
                    return None
                if key.endswith(".weight"):
                    shape = reader.get_slice(key).get_shape()
                    if len(shape) == 2:
                        modules[key.removesuffix(".weight")] = (int(shape[0]), int(shape[1]))
    return modules
