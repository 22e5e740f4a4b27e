"""GPTQ and AWQ checkpoints (quantization/gptq.py, awq.py, wna16.py) and the
CUDA platform's Triton W4 GEMM (platforms/cuda_grouped_linear.py).

A test-only writer packs a tiny float Llama into each format with the
format's own packing (round to nearest, no calibration) and writes a float
checkpoint of the weights the format's formula dequantizes them to; greedy
tokens of pagedllm on the packed checkpoint must equal transformers' on the
float one, in float32. The packers follow vLLM's test utilities
(vllm/model_executor/layers/quantization/utils/quant_utils.py: pack_rows for
GPTQ's qweight, pack_cols for its qzeros, awq_pack for AWQ's interleaved
columns), so the readers are checked against an independent writer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
import torch
from helpers.tiny_models import cached_tiny_model
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.model_registry.layers import linear
from pagedllm.model_registry.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.model_registry.loader import ModelLoadError
from pagedllm.quantization.awq import AWQMethod
from pagedllm.quantization.gptq import GPTQMethod
from pagedllm.quantization.grouped_weight import GroupedWeight, pack_w4, reference_linear
from pagedllm.quantization.wna16 import build_grouped_gemm, unpack_int32

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[1, 5, 9, 14], [3, 3, 8]]
# K = 128 for every layer but down_proj (256): room for group_size 128.
MODEL_SIZES = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}


# ---- the writer: vLLM's packing, copied (quant_utils.py) ---------------------------------------


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """vLLM's pack_rows: [K, N] codes -> int32 [K / f, N], row i*f + j in bits j*bits."""
    factor = 32 // bits
    codes = q.numpy().astype(np.uint32)
    packed = np.zeros((codes.shape[0] // factor, codes.shape[1]), dtype=np.uint32)
    for i in range(factor):
        packed |= codes[i::factor, :] << bits * i
    return torch.from_numpy(packed.astype(np.int32))


def pack_cols(q: torch.Tensor, bits: int) -> torch.Tensor:
    """vLLM's pack_cols: [K, N] codes -> int32 [K, N / f], column i*f + j in bits j*bits."""
    factor = 32 // bits
    codes = q.numpy().astype(np.uint32)
    packed = np.zeros((codes.shape[0], codes.shape[1] // factor), dtype=np.uint32)
    for i in range(factor):
        packed |= codes[:, i::factor] << bits * i
    return torch.from_numpy(packed.astype(np.int32))


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """vLLM's awq_pack (AutoAWQ's order): columns interleaved [0, 2, 4, 6, 1, 3, 5, 7], then pack_cols."""
    interleave = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    num_cols = q.shape[1]
    codes = q.numpy().reshape(-1, 8)[:, interleave].reshape(-1, num_cols)
    return pack_cols(torch.from_numpy(np.ascontiguousarray(codes)), 4)


class Quantized(NamedTuple):
    codes: torch.Tensor  # [N, K] integers
    zeros: torch.Tensor  # [N, G] integers
    scales: torch.Tensor  # [N, G] float32, fp16-representable
    g_idx: torch.Tensor  # [K] int32

    def dequantize(self) -> torch.Tensor:
        """The formats' formula: w[n, k] = (q[n, k] - zero[n, g_idx[k]]) * scale[n, g_idx[k]]."""
        index = self.g_idx.long()
        return (self.codes.float() - self.zeros.float()[:, index]) * self.scales[:, index]


def round_to_nearest(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                     order: torch.Tensor | None, min_zero: int = 0) -> Quantized:
    """GPTQ's quantizer without the error feedback: inputs grouped in `order`
    (act-order: g_idx[order[p]] = p // g), one scale and zero per group and row."""
    num_out, num_in = weight.shape
    group_size = num_in if group_size == -1 else group_size
    order = torch.arange(num_in) if order is None else order
    grouped = weight.float()[:, order].view(num_out, num_in // group_size, group_size)
    max_code = 2**bits - 1
    if sym:
        scales = grouped.abs().amax(-1) * 2 / max_code
        zeros = torch.full_like(scales, (max_code + 1) // 2)
    else:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scales = (high - low) / max_code
    scales = scales.clamp(min=1e-6).half().float()
    if not sym:
        zeros = torch.round(-low / scales).clamp(min_zero, max_code)
    codes = torch.clamp(torch.round(grouped / scales[..., None]) + zeros[..., None], 0, max_code)
    in_order = torch.empty(num_out, num_in)
    in_order[:, order] = codes.view(num_out, num_in)
    g_idx = torch.empty(num_in, dtype=torch.int32)
    g_idx[order] = (torch.arange(num_in) // group_size).to(torch.int32)
    return Quantized(in_order.to(torch.int64), zeros.to(torch.int64), scales, g_idx)


class Case(NamedTuple):
    fmt: str  # "gptq" or "awq"
    bits: int = 4
    group_size: int = 32
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # GPTQ: v1 stores zero - 1, gptq_v2 the zero


def _stored(name: str, quantized: Quantized, case: Case) -> dict[str, torch.Tensor]:
    prefix = name.removesuffix("weight")
    scales = quantized.scales.t().half().contiguous()
    if case.fmt == "awq":
        return {prefix + "qweight": awq_pack(quantized.codes.t().contiguous()),
                prefix + "qzeros": awq_pack(quantized.zeros.t().contiguous()), prefix + "scales": scales}
    zero_shift = 1 if case.checkpoint_format == "gptq" else 0
    mask = 2**case.bits - 1
    stored_zeros = (quantized.zeros - zero_shift) & mask
    return {prefix + "qweight": pack_rows(quantized.codes.t().contiguous(), case.bits),
            prefix + "qzeros": pack_cols(stored_zeros.t().contiguous(), case.bits), prefix + "scales": scales,
            prefix + "g_idx": quantized.g_idx}


def _quant_config(case: Case) -> dict[str, object]:
    if case.fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": case.group_size, "zero_point": True,
                "version": "gemm"}
    return {"quant_method": "gptq", "bits": case.bits, "group_size": case.group_size, "desc_act": case.desc_act,
            "sym": case.sym, "checkpoint_format": case.checkpoint_format}


def write_checkpoints(tmp_path: Path, case: Case) -> tuple[Path, Path]:
    """(the packed checkpoint, a float checkpoint of its dequantized weights)."""
    source = cached_tiny_model("llama", with_tokenizer=True, **MODEL_SIZES)
    packed, dequantized = tmp_path / case.fmt, tmp_path / "dequantized"
    shutil.copytree(source, packed)
    shutil.copytree(source, dequantized)
    tensors = load_file(str(source / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if not (name.endswith(".weight") and parts[-2] in LINEAR_SUFFIXES):
            stored[name] = tensor
            continue
        # Act-order: layers that read one input (q/k/v, gate/up) share its permutation.
        reader = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        order = None
        if case.desc_act:
            order = torch.randperm(tensor.shape[1], generator=torch.Generator().manual_seed(len(reader)))
        # v1 cannot store a zero point of 0 (zero - 1 wraps to 15, read back as 16).
        min_zero = 1 if case.fmt == "gptq" and case.checkpoint_format == "gptq" else 0
        quantized = round_to_nearest(tensor, case.bits, case.group_size, case.sym, order, min_zero)
        stored.update(_stored(name, quantized, case))
        tensors[name] = quantized.dequantize().to(tensor.dtype)
    save_file(stored, str(packed / "model.safetensors"))
    save_file(tensors, str(dequantized / "model.safetensors"))
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = _quant_config(case)
    (packed / "config.json").write_text(json.dumps(config))
    return packed, dequantized


def _greedy(path: Path, **kwargs: object) -> list[list[int]]:
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=32, **kwargs)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=8, temperature=0))
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()


def _hf_greedy(path: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return [hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(prompt):]
            .tolist() for prompt in PROMPTS]


# ---- the packing, bit for bit -------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_unpacking_inverts_vllms_row_and_column_packing(bits: int) -> None:
    codes = torch.randint(0, 2**bits, (64, 24), generator=torch.Generator().manual_seed(bits))
    assert torch.equal(unpack_int32(pack_rows(codes, bits), bits, dim=0), codes.to(torch.uint8))
    assert torch.equal(unpack_int32(pack_cols(codes, bits), bits, dim=1), codes.to(torch.uint8))


def test_awq_unpacking_inverts_autoawqs_interleaved_packing() -> None:
    codes = torch.randint(0, 16, (8, 32), generator=torch.Generator().manual_seed(0))
    packed = awq_pack(codes)
    assert torch.equal(AWQMethod(None).unpack_qweight(packed), codes.to(torch.uint8))
    # vLLM's awq_triton dequantizer reads column j of each int32 from bits
    # 4 * [0, 4, 1, 5, 2, 6, 3, 7][j]: its formula, once more by hand.
    shifts = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]) * 4
    by_hand = ((packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF).view(8, 32)
    assert torch.equal(by_hand, codes)


# ---- end to end against transformers ----------------------------------------------------------


@pytest.mark.parametrize("case", [
    Case("gptq", group_size=32),
    Case("gptq", group_size=64, sym=False, checkpoint_format="gptq_v2"),
    Case("gptq", group_size=128, sym=False),
    Case("gptq", group_size=-1),
    Case("gptq", group_size=32, desc_act=True),
    Case("gptq", bits=8, group_size=64, sym=False, checkpoint_format="gptq_v2"),
    Case("awq", group_size=32),
    Case("awq", group_size=64),
    Case("awq", group_size=128),
], ids=lambda case: "-".join(str(value) for value in case))
def test_packed_checkpoint_generates_the_dequantized_models_tokens(case: Case, tmp_path: Path) -> None:
    """Chosen from config.json alone: every linear layer reads the packed
    tensors, and the tokens are transformers' on the dequantized weights."""
    packed, dequantized = write_checkpoints(tmp_path, case)
    assert _greedy(packed) == _hf_greedy(dequantized)


@pytest.mark.slow
def test_gptq_under_tensor_parallelism_splits_groups_by_rank(tmp_path: Path) -> None:
    """Column-parallel layers split N, row-parallel ones K into whole groups."""
    packed, dequantized = write_checkpoints(tmp_path, Case("gptq", group_size=32, sym=False))
    assert _greedy(packed, tensor_parallel_size=2, distributed_executor_backend="mp") == _hf_greedy(dequantized)


# ---- one rank's slice (tensor parallelism without processes) ---------------------------------


def _rank(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    monkeypatch.setattr(linear, "get_tp_group", lambda: SimpleNamespace(rank_in_group=rank, world_size=2))


def _load(method: GPTQMethod, layer: torch.nn.Linear, stored: dict[str, torch.Tensor], *shard_id: int) -> None:
    for name, tensor in stored.items():
        param = getattr(layer, name.rsplit(".", 1)[-1])
        param.weight_loader(param, tensor, *shard_id)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("group_size", [32, -1])
def test_a_row_parallel_rank_reads_the_whole_groups_of_its_inputs(
    monkeypatch: pytest.MonkeyPatch, rank: int, group_size: int
) -> None:
    _rank(monkeypatch, rank)
    case = Case("gptq", group_size=group_size, sym=False)
    quantized = round_to_nearest(torch.randn(16, 128), 4, group_size, sym=False, order=None, min_zero=1)
    method = GPTQMethod.from_checkpoint_config(_quant_config(case))
    layer = RowParallelLinear(128, 16)  # 64 inputs per rank
    assert method.create_weights(layer, "down_proj")
    _load(method, layer, _stored("down_proj.weight", quantized, case))
    assert method.quantize_linear(layer, "down_proj")
    x = torch.randn(3, 64)
    expected = x @ quantized.dequantize()[:, rank * 64:(rank + 1) * 64].t()
    torch.testing.assert_close(build_grouped_gemm(layer)(x, None), expected, rtol=1e-5, atol=1e-5)


def test_a_column_parallel_rank_reads_its_rows_of_each_act_order_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    _rank(monkeypatch, 1)
    case = Case("gptq", group_size=16, desc_act=True)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))  # gate and up read one input
    gate, up = (round_to_nearest(torch.randn(32, 64), 4, 16, sym=True, order=order) for _ in range(2))
    method = GPTQMethod.from_checkpoint_config(_quant_config(case))
    layer = MergedColumnParallelLinear(64, [32, 32])  # 16 rows of each per rank
    assert method.create_weights(layer, "gate_up_proj")
    for shard_id, quantized in enumerate((gate, up)):
        _load(method, layer, _stored("proj.weight", quantized, case), shard_id)
    assert method.quantize_linear(layer, "gate_up_proj")
    x = torch.randn(3, 64)
    expected = x @ torch.cat([gate.dequantize()[16:], up.dequantize()[16:]]).t()
    torch.testing.assert_close(build_grouped_gemm(layer)(x, None), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("quant_config", "message"), [
    ({"group_size": 128}, r"group_size=128 does not divide the inputs of o_proj \(K=64 inputs on each of 2 tensor-"),
    ({"group_size": 32, "desc_act": True}, r"desc_act=True \(act-order\) under tensor parallelism is not supported"),
])
def test_row_parallel_groups_split_across_ranks_are_refused(
    monkeypatch: pytest.MonkeyPatch, quant_config: dict[str, object], message: str
) -> None:
    _rank(monkeypatch, 0)
    method = GPTQMethod.from_checkpoint_config({"bits": 4, **quant_config})
    with pytest.raises(ModelLoadError, match=message):
        method.create_weights(RowParallelLinear(128, 16), "o_proj")


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "quant_config", "message"), [
    (GPTQMethod, {"bits": 3, "group_size": 128}, r"quantization_config.bits=3 is not supported .*supported: 4, 8"),
    (GPTQMethod, {"bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     r"checkpoint_format='marlin' is not supported .*supported: gptq, gptq_v2"),
    (GPTQMethod, {"bits": 4, "group_size": 0}, r"group_size=0 is not supported"),
    (GPTQMethod, {"bits": 4}, r"has no group_size"),
    (GPTQMethod, {"bits": 4, "group_size": 128, "lm_head": True}, r"lm_head=True is not supported"),
    (AWQMethod, {"w_bit": 4, "q_group_size": 128, "version": "gemv"}, r"version='gemv' is not supported"),
    (AWQMethod, {"bits": 4, "group_size": 128, "zero_point": False}, r"zero_point=False is not supported"),
    (AWQMethod, {"bits": 8, "group_size": 128}, r"bits=8 is not supported .*supported: 4"),
])
def test_unsupported_settings_are_load_errors_naming_them(method: type, quant_config: dict[str, object],
                                                          message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        method.from_checkpoint_config(quant_config)


def test_a_checkpoint_with_an_unsupported_setting_fails_to_load(tmp_path: Path) -> None:
    packed, _ = write_checkpoints(tmp_path, Case("gptq"))
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"]["bits"] = 2
    (packed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"quantization_config.bits=2 is not supported"):
        LLM(model=str(packed), dtype="float32", num_kv_blocks=32)


def test_awq_modules_to_not_convert_load_as_float() -> None:
    method = AWQMethod.from_checkpoint_config({"bits": 4, "group_size": 32, "modules_to_not_convert": ["down_proj"]})
    kept, converted = torch.nn.Linear(64, 16), RowParallelLinear(64, 16)
    assert not method.create_weights(kept, "model.layers.0.mlp.down_proj")
    assert isinstance(kept.weight, torch.nn.Parameter) and kept.weight.dtype == torch.float32
    assert method.create_weights(converted, "model.layers.0.self_attn.o_proj")
    assert converted.qweight.shape == (16, 64) and not hasattr(converted, "g_idx")  # AWQ stores no g_idx


def test_moe_experts_in_a_gptq_checkpoint_are_refused() -> None:
    method = GPTQMethod.from_checkpoint_config({"bits": 4, "group_size": 128})
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.experts: mixture-of-experts .* not supported yet"):
        method.create_moe_weights(torch.nn.Module(), "model.layers.0.mlp.experts")


# ---- the Triton W4 GEMM (interpreter on the CPU) ------------------------------------------------


@pytest.mark.parametrize(("dtype", "group_size", "bias"), [(torch.float32, 16, True), (torch.float16, 32, False)])
def test_triton_w4_gemm_matches_the_layouts_reference(dtype: torch.dtype, group_size: int, bias: bool) -> None:
    cuda_grouped_linear = pytest.importorskip("pagedllm.platforms.cuda_grouped_linear")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(group_size)
    num_out, num_in = 40, 64  # N off the 64-wide column tile: the edge is masked
    codes = torch.randint(0, 16, (num_out, num_in), generator=generator).to(torch.uint8)
    scales = torch.rand(num_out, num_in // group_size, generator=generator) / 8
    offsets = -torch.randint(0, 16, scales.shape, generator=generator) * scales
    weight = GroupedWeight(4, group_size, pack_w4(codes), scales, offsets).validate()
    weight = weight._replace(codes=weight.codes.to(device), scales=scales.to(device), offsets=offsets.to(device))
    x = torch.randn(3, num_in, generator=generator).to(device, dtype)
    bias_tensor = torch.randn(num_out, generator=generator).to(device, dtype) if bias else None
    out = cuda_grouped_linear.build(weight)(x, bias_tensor)
    expected = reference_linear(x, weight, bias_tensor)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # float16: the weight tile is rounded to float16
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
