"""compressed-tensors checkpoints (llm-compressor's format) written from a
float checkpoint by hand, following the format: config validated by the
compressed-tensors package, int4 packed by its own `pack_to_int32`,
round-to-nearest with min-max scales, static input scales from a min-max
pass over given prompts. Used by tests/test_compressed_tensors.py and the
checkpoint-format benchmark."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file, save_file

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = torch.float8_e4m3fn
LIMIT = {"int": 127.0, "float": 448.0}


def scheme_args(kind: str, strategy: str, *, bits: int = 8, dynamic: bool = False, group_size: int | None = None,
                symmetric: bool = True) -> dict[str, Any]:
    """One QuantizationArgs as compressed-tensors writes it."""
    return {"num_bits": bits, "type": kind, "symmetric": symmetric, "strategy": strategy, "dynamic": dynamic,
            "group_size": group_size, "block_structure": None, "actorder": None, "observer": "minmax",
            "observer_kwargs": {}}


# name -> (weights, input_activations, format)
SCHEMES: dict[str, tuple[dict[str, Any], dict[str, Any] | None, str]] = {
    "w8a16_channel": (scheme_args("int", "channel"), None, "naive-quantized"),
    "w8a16_group": (scheme_args("int", "group", group_size=32), None, "pack-quantized"),
    "w8a16_tensor": (scheme_args("int", "tensor"), None, "naive-quantized"),
    "w4a16_group": (scheme_args("int", "group", bits=4, group_size=32), None, "pack-quantized"),
    "w8a8_int8_dynamic": (scheme_args("int", "channel"), scheme_args("int", "token", dynamic=True), "int-quantized"),
    "w8a8_int8_static": (scheme_args("int", "channel"), scheme_args("int", "tensor"), "int-quantized"),
    "fp8_weight_only": (scheme_args("float", "channel"), None, "float-quantized"),
    "fp8_dynamic": (scheme_args("float", "channel"), scheme_args("float", "token", dynamic=True), "float-quantized"),
    "fp8_static": (scheme_args("float", "tensor"), scheme_args("float", "tensor"), "float-quantized"),
}


def quantize_weight(weight: torch.Tensor, args: dict[str, Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the checkpoint's tensors of one module, its dequantized weight)."""
    num_out, num_in = weight.shape
    w = weight.float()
    qmax = LIMIT[args["type"]] if args["num_bits"] == 8 else 7.0
    if args["strategy"] == "group":
        grouped = w.view(num_out, num_in // args["group_size"], args["group_size"])
        scale = grouped.abs().amax(dim=-1) / qmax  # [N, K // g]
        expanded = scale.repeat_interleave(args["group_size"], dim=1)
    elif args["strategy"] == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / qmax  # [N, 1]
        expanded = scale
    else:
        scale = (w.abs().amax() / qmax).reshape(1)
        expanded = scale
    if args["type"] == "float":
        codes = (w / expanded).clamp(-448, 448).to(FP8)
        return {"weight": codes, "weight_scale": scale}, codes.float() * expanded
    codes = torch.round(w / expanded).clamp(-qmax - 1, qmax).to(torch.int8)
    dequantized = codes.float() * expanded
    if args["num_bits"] == 4 or args["strategy"] == "group":  # pack-quantized
        packed = pack_to_int32(codes, args["num_bits"])
        return {"weight_packed": packed, "weight_shape": torch.tensor([num_out, num_in]), "weight_scale": scale}, (
            dequantized)
    return {"weight": codes, "weight_scale": scale}, dequantized


def calibrate_input_scales(source: Path, args: dict[str, Any], prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Static per-tensor input scales: max |x| of each linear's input over the
    prompts, on the float model (q/k/v see one x, so they share a scale)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    amax: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in LINEAR_SUFFIXES:
            module.register_forward_pre_hook(
                lambda _m, inputs, n=name: amax.__setitem__(n, torch.maximum(amax.get(n, torch.zeros(())),
                                                                             inputs[0].abs().amax())))
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    return {name: (value * 2 / LIMIT[args["type"]]).reshape(1) for name, value in amax.items()}  # 2x: headroom


def write_compressed_tensors(
    source: Path, out_dir: Path, scheme: str, prompts: list[list[int]],
    kv_scales: dict[int, tuple[float, float]] | None = None, **config_changes: Any,
) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(the compressed-tensors checkpoint of the float checkpoint `source` in
    `scheme`, a float one of its dequantized weights, the static input scales
    by module, calibrated on `prompts`), written under `out_dir`."""
    weight_args, input_args, fmt = SCHEMES[scheme]
    quantized, dequantized = out_dir / scheme, out_dir / f"{scheme}-dequantized"
    shutil.copytree(source, quantized)
    shutil.copytree(source, dequantized)
    static = input_args is not None and not input_args["dynamic"]
    input_scales = calibrate_input_scales(source, input_args, prompts) if static else {}
    tensors = load_file(str(source / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rpartition(".")[2] in LINEAR_SUFFIXES:
            parts, tensors[name] = quantize_weight(tensor, weight_args)
            stored.update({f"{module}.{key}": value for key, value in parts.items()})
            if module in input_scales:
                stored[f"{module}.input_scale"] = input_scales[module]
        else:
            stored[name] = tensor
    for layer, (k_scale, v_scale) in (kv_scales or {}).items():
        stored[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([k_scale])
        stored[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v_scale])
    save_file(stored, str(quantized / "model.safetensors"))
    save_file(tensors, str(dequantized / "model.safetensors"))
    quant_config: dict[str, Any] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weight_args,
                                      "input_activations": input_args, "output_activations": None, "format": fmt}},
        "ignore": ["lm_head"], "kv_cache_scheme": None if kv_scales is None else scheme_args("float", "tensor"),
    }
    quant_config.update(config_changes)
    QuantizationConfig.model_validate(quant_config)  # the package's own reading of it
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = quant_config
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized, input_scales
