"""MoE models through the engine on a CUDA device (skipped without one; run
by benchmarks/gpu_check.sh): the experts on the Triton fused-MoE kernel,
decode steps replayed from CUDA graphs (DeepSeek's latent attention on
the triton backend's MLA kernel), greedy tokens equal to transformers' `generate` on
the CPU in float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_deepseek import build_deepseek
from test_models_gpt_oss import build_gpt_oss
from test_models_moe import build_moe

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[8 + (7 * i + 3 * j) % 300 for j in range(n)] for i, n in enumerate((5, 17, 33, 9))]
NUM_NEW_TOKENS = 12


def _hf_greedy(path: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in PROMPTS:
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def _skip_unless_hf_reads_swiglu_limit() -> None:
    """The tiny GPT-OSS clamps at 3; transformers before 5.2x (5.17 on the
    GPU image) hard-codes the released models' 7.0 and is no reference."""
    import inspect

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    if "swiglu_limit" not in inspect.getsource(GptOssExperts.__init__):
        pytest.skip("this transformers' GptOssExperts ignores config.swiglu_limit")


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM"])
def test_moe_engine_on_cuda_equals_transformers(tmp_path: Path, architecture: str) -> None:
    if architecture == "GptOssForCausalLM":
        _skip_unless_hf_reads_swiglu_limit()
        path = build_gpt_oss(tmp_path / "model")
    elif architecture == "DeepseekV3ForCausalLM":
        path = build_deepseek(architecture, tmp_path / "model")
    else:
        path = build_moe(architecture, tmp_path / "model")
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    try:
        runner: Any = llm.engine_core.engine_core.model_executor.driver_worker.model_runner  # type: ignore[attr-defined]
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)  # type: ignore[misc]
        impls = {module.op_impl for module in runner.model.modules() if type(module).__name__ == "FusedMoE"}
        replays = runner.graph_runner.num_replays if runner.graph_runner is not None else 0
    finally:
        llm.shutdown()
    assert impls == {"triton_fused_moe"}
    assert replays > 0
    assert [list(o.outputs[0].token_ids) for o in outputs] == _hf_greedy(path)
