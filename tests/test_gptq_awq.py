"""GPTQ and AWQ checkpoints (quantization/gptq.py, awq.py, wna16.py) and the
CUDA platform's Triton W4 GEMM (platforms/cuda_grouped_linear.py).

A test-only writer (helpers/gptq_awq_writer.py) packs a tiny float Llama into each format with the
format's own packing (round to nearest, no calibration) and writes a float
checkpoint of the weights the format's formula dequantizes them to; greedy
tokens of pagedllm on the packed checkpoint must equal transformers' on the
float one, in float32. The packers follow vLLM's test utilities
(vllm/model_executor/layers/quantization/utils/quant_utils.py: pack_rows for
GPTQ's qweight, pack_cols for its qzeros, awq_pack for AWQ's interleaved
columns), so the readers are checked against an independent writer."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.gptq_awq_writer import (
    Case,
    awq_pack,
    pack_cols,
    pack_rows,
    quant_config,
    round_to_nearest,
    stored_tensors,
    write_gptq_awq,
)
from helpers.tiny_models import cached_tiny_model
from helpers.validation import greedy_token_ids

from pagedllm import LLM
from pagedllm.model_registry.layers import linear
from pagedllm.model_registry.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.model_registry.loader import ModelLoadError
from pagedllm.quantization.awq import AWQMethod
from pagedllm.quantization.gptq import GPTQMethod
from pagedllm.quantization.grouped_weight import GroupedWeight, pack_w4, reference_linear
from pagedllm.quantization.wna16 import build_grouped_gemm, unpack_int32

PROMPTS = [[1, 5, 9, 14], [3, 3, 8]]
# K = 128 for every layer but down_proj (256): room for group_size 128.
MODEL_SIZES = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}


def write_checkpoints(tmp_path: Path, case: Case) -> tuple[Path, Path]:
    """The tiny Llama packed as `case` says (helpers/gptq_awq_writer.py)."""
    return write_gptq_awq(cached_tiny_model("llama", with_tokenizer=True, **MODEL_SIZES), tmp_path, case)


def _greedy(path: Path, **kwargs: Any) -> list[list[int]]:
    return greedy_token_ids(path, PROMPTS, 8, **kwargs)


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
    method = GPTQMethod.from_checkpoint_config(quant_config(case))
    layer = RowParallelLinear(128, 16)  # 64 inputs per rank
    assert method.create_weights(layer, "down_proj")
    _load(method, layer, stored_tensors("down_proj.weight", quantized, case))
    assert method.quantize_linear(layer, "down_proj")
    x = torch.randn(3, 64)
    expected = x @ quantized.dequantize()[:, rank * 64:(rank + 1) * 64].t()
    torch.testing.assert_close(build_grouped_gemm(layer)(x, None), expected, rtol=1e-5, atol=1e-5)


def test_a_column_parallel_rank_reads_its_rows_of_each_act_order_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    _rank(monkeypatch, 1)
    case = Case("gptq", group_size=16, desc_act=True)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))  # gate and up read one input
    gate, up = (round_to_nearest(torch.randn(32, 64), 4, 16, sym=True, order=order) for _ in range(2))
    method = GPTQMethod.from_checkpoint_config(quant_config(case))
    layer = MergedColumnParallelLinear(64, [32, 32])  # 16 rows of each per rank
    assert method.create_weights(layer, "gate_up_proj")
    for shard_id, quantized in enumerate((gate, up)):
        _load(method, layer, stored_tensors("proj.weight", quantized, case), shard_id)
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
