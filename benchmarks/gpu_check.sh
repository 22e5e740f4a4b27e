#!/usr/bin/env bash
# One command for a CUDA machine; ends within 8 minutes.
#
#   bash benchmarks/gpu_check.sh                # on a GPU: compiled kernels
#   bash benchmarks/gpu_check.sh --cpu-dry-run  # the same plumbing on CPU (CI)
#
# On a GPU: the attention backend tests compiled (TRITON_INTERPRET=0, tensors
# on cuda), the end-to-end greedy equality test (Triton forced vs
# torch_native), the backend-selection tests, the fused-MoE and latent
# attention (MLA) kernel tests,
# MoE models through the engine (tests/test_moe_cuda.py),
# and the kernel benchmarks (Triton vs FlashAttention if installed vs torch
# SDPA; the Triton MoE kernel vs the MoE layer's torch reference). With --cpu-dry-run
# each stage runs through the Triton interpreter on a few small cases.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
STAGE_TIMEOUT="${STAGE_TIMEOUT:-150}"

stage() {
    local name="$1"; shift
    echo "=== ${name}"
    local started=$SECONDS
    timeout --kill-after=10 "${STAGE_TIMEOUT}" "$@"
    echo "=== ${name}: ok ($((SECONDS - started)) s)"
}

if [ "${1:-}" = "--cpu-dry-run" ]; then
    export TRITON_INTERPRET=1 PAGEDLLM_TEST_DEVICE=cpu
    stage "triton kernels (interpreter, subset)" \
        "$PYTHON" -m pytest -q tests/test_attention_triton.py \
        -k "(test_mixed_batch_equals_torch_native and float32) or (test_cache_write_kernel_skips_slot_minus_one and float32) or (test_split_kv_decode_equals_one_segment and float32)"
    stage "backend selection" "$PYTHON" -m pytest -q tests/test_backend_selection.py
    stage "latent attention kernels (interpreter, subset)" \
        "$PYTHON" -m pytest -q tests/test_attention_triton_mla.py -k "float32"
    stage "fused-MoE kernel (interpreter, subset)" \
        "$PYTHON" -m pytest -q tests/test_triton_fused_moe.py -k "align or registers or (33-4 and float32)"
    stage "GPTQ/AWQ W4 GEMM (interpreter)" "$PYTHON" -m pytest -q tests/test_gptq_awq.py -k triton
    stage "kernel benchmark (dry run)" "$PYTHON" benchmarks/attention_kernels.py --cpu-dry-run
    stage "MoE kernel benchmark (dry run)" "$PYTHON" benchmarks/moe_kernels.py --cpu-dry-run
    echo "gpu_check --cpu-dry-run: all stages passed"
    exit 0
fi

if [ -n "${1:-}" ]; then
    echo "usage: $0 [--cpu-dry-run]" >&2
    exit 2
fi

export TRITON_INTERPRET=0 PAGEDLLM_TEST_DEVICE=cuda
"$PYTHON" - <<'PY'
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: no CUDA device (use --cpu-dry-run on CPU)")
print("device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0), "torch", torch.__version__)
PY
"$PYTHON" -m pagedllm.entrypoints.cli env || true
stage "attention backend tests (compiled)" \
    "$PYTHON" -m pytest -q tests/test_attention_triton.py -m "not slow"
stage "end-to-end greedy equality (triton vs torch_native)" \
    "$PYTHON" -m pytest -q tests/test_attention_triton.py -k greedy_tokens_with_triton_forced
stage "backend selection" "$PYTHON" -m pytest -q tests/test_backend_selection.py
stage "engine on the GPU (auto backend, profiled KV budget, decode graphs)" "$PYTHON" - <<'PY'
import time
from pagedllm import LLM, SamplingParams
started = time.perf_counter()
llm = LLM(model="tiny", dtype="float16")
core = llm.engine_core.engine_core
runner = core.model_executor.driver_worker.model_runner.graph_runner
print("backend:", llm.engine_core.ready.attention_backend, "| kv blocks:", core.kv_cache_manager.num_blocks,
      "| graphs:", None if runner is None else runner.sizes, f"| start-up {time.perf_counter() - started:.1f} s")
prompts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n"] * 8
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
llm.generate(prompts, params, use_tqdm=False)
started = time.perf_counter()
outputs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - started
print(f"24 requests x 64 tokens: {24 * 64 / elapsed:.0f} tok/s; graph replays: {runner.num_replays if runner else 0}")
print(repr(outputs[0].outputs[0].text[:80]))
assert runner is not None and runner.num_replays > 0
PY
stage "fused-MoE kernel tests (compiled)" "$PYTHON" -m pytest -q tests/test_triton_fused_moe.py
stage "latent attention (MLA) kernel tests (compiled)" "$PYTHON" -m pytest -q tests/test_attention_triton_mla.py
stage "GPTQ/AWQ W4 GEMM (compiled)" "$PYTHON" -m pytest -q tests/test_gptq_awq.py -k triton
stage "MoE models on the GPU (Triton experts, CUDA graphs, greedy = transformers)" \
    "$PYTHON" -m pytest -q tests/test_moe_cuda.py
stage "kernel benchmark" "$PYTHON" benchmarks/attention_kernels.py
stage "MoE kernel benchmark" "$PYTHON" benchmarks/moe_kernels.py
echo "gpu_check: all stages passed"
