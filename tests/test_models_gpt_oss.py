"""GPT-OSS against transformers (float32): attention sinks, alternating
sliding-window and full layers, q/k/v/o biases and the experts (the FusedMoE layer).

The checkpoint is built here from transformers' GptOssConfig (2 layers: one
sliding with a window of 8 tokens, shorter than every long prompt, one full;
4 experts, top-2) with weights scaled so that every mechanism acts: sinks
of mean 1 take a real share of each softmax, the experts' SwiGLU clamp
(limit 3) clips, and the router's top-2 is decisive. `test_each_mechanism_matters`
switches each off in our model alone and checks the logits then differ.
The engine at -tp 1 and 2 with chunks, preemption and drafts: test_models_engine_matrix.py.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from test_models import PagedBatchRunner, run_mixed_schedule, save_with_tokenizer

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.model_registry.loader import load_model
from pagedllm.model_registry.models.gpt_oss import GptOssForCausalLM

WINDOW = 8
SWIGLU_LIMIT = 3.0


def build_gpt_oss(path: Path, seed: int = 0) -> Path:
    from transformers import AutoTokenizer, GptOssConfig
    from transformers import GptOssForCausalLM as HfGptOss

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    tokenizer_dir = Path(get_tokenizer_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4, num_experts_per_tok=2, swiglu_limit=SWIGLU_LIMIT,
        # GPT-OSS's YaRN, its original length shorter than the prompts so that the scaling shows.
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 16, "truncate": False},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = HfGptOss(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(1.0, 1.5)  # 0.1-0.9 of a row's probability mass
            elif "experts" in name or "router" in name:
                param.normal_(0.0, 0.5)  # the clamp clips, the top-2 is clear
            else:
                param.add_(torch.randn_like(param) * 0.02)  # norms away from 1, biases away from 0
    return save_with_tokenizer(model, path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "model")


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


def run_paged_batches(checkpoint: Path) -> PagedBatchRunner:
    return run_mixed_schedule(load_model(checkpoint, model_cls=GptOssForCausalLM, attn_backend=TorchNativeBackend,
                                         dtype=torch.float32, device="cpu"), first_id=8)


def max_logit_error(runner: PagedBatchRunner, hf_model: Any) -> float:
    """The largest difference from transformers' logits over every position
    we computed (each request's whole sequence in one HF forward)."""
    worst = 0.0
    for r, tokens in enumerate(runner.tokens):
        num_computed = runner.num_computed[r]
        with torch.no_grad():
            expected = hf_model(torch.tensor([tokens[:num_computed]])).logits[0]
        ours = torch.stack([runner.logits[r][pos] for pos in range(num_computed)])
        worst = max(worst, float((ours - expected).abs().max()))
    return worst


def test_paged_batches_match_hf_logits_and_greedy_tokens(checkpoint: Path, hf_model: Any) -> None:
    runner = run_paged_batches(checkpoint)
    assert max_logit_error(runner, hf_model) < 1e-4
    for r, tokens in enumerate(runner.tokens):
        prompt_len = runner.prompt_lens[r]
        with torch.no_grad():
            expected = hf_model(torch.tensor([tokens[:-1]])).logits[0]
        assert tokens[prompt_len:] == expected[prompt_len - 1 :].argmax(-1).tolist()


def _without_sinks(model: GptOssForCausalLM) -> None:
    for attn in model.get_attention_layers():
        attn.impl.sinks = None


def _without_window(model: GptOssForCausalLM) -> None:
    for attn in model.get_attention_layers():
        attn.impl.sliding_window = None


def _without_clamp(model: GptOssForCausalLM) -> None:
    for layer in model.model.layers:
        layer.mlp.experts.swiglu_limit = math.inf  # type: ignore[union-attr]


@pytest.mark.parametrize("switch_off", [_without_sinks, _without_window, _without_clamp],
                         ids=["sinks", "sliding-window", "swiglu-clamp"])
def test_each_mechanism_matters(checkpoint: Path, hf_model: Any, monkeypatch: pytest.MonkeyPatch,
                                switch_off: Any) -> None:
    """Guards the equality test against a mechanism the tiny model never
    exercises: with it switched off in our model only, the logits are off."""
    original_init = GptOssForCausalLM.__init__

    def init_then_switch_off(self: GptOssForCausalLM, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        switch_off(self)

    monkeypatch.setattr(GptOssForCausalLM, "__init__", init_then_switch_off)
    assert max_logit_error(run_paged_batches(checkpoint), hf_model) > 1e-2


def test_attention_requirements_ask_for_sinks_and_the_window(checkpoint: Path) -> None:
    from pagedllm.attention_backends.base import AttentionRequirements
    from pagedllm.model_registry.loader import load_hf_config

    requirements = GptOssForCausalLM.attention_requirements(load_hf_config(checkpoint))
    assert requirements == AttentionRequirements((16,), sliding_window=WINDOW, sinks=True)
    layers = load_model(checkpoint, model_cls=GptOssForCausalLM, attn_backend=TorchNativeBackend,
                        dtype=torch.float32, device="cpu").get_attention_layers()
    assert [layer.sliding_window for layer in layers] == [WINDOW, None]


def test_env_checks_the_backends_for_the_models_layers(checkpoint: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`pagedllm env --model PATH` reads what GPT-OSS's layers ask; a plugin
    backend without sinks is named with the reason (auto still picks cpu)."""
    import json

    from pagedllm.entrypoints.cli import main
    from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl

    class NoSinksPlugin:
        @hookimpl
        def register_attention_backends(self, register: RegisterFn) -> None:
            register("no_sinks", "pagedllm_test_plugin.backend:TestEchoBackend", device_types=["cpu"],
                     supports_sliding_window=True)

    manager = get_plugin_manager()
    manager.register(NoSinksPlugin(), name="no-sinks")
    try:
        assert main(["env", "--json", "--platform", "cpu", "--model", str(checkpoint)]) == 0
        payload = json.loads(capsys.readouterr().out)
        assert main(["env", "--platform", "cpu", "--model", str(checkpoint)]) == 0
        text = capsys.readouterr().out
    finally:
        manager.unregister(name="no-sinks")
    assert (payload["head_sizes"], payload["sliding_window"], payload["sinks"]) == ([16], WINDOW, True)
    assert payload["attention_backend"] == "cpu"
    assert payload["backends"]["no_sinks"] == ["attention sinks are not supported"]
    assert f"head_size=16 block_size=16 sliding_window={WINDOW} sinks" in text


# ---- the engine ---------------------------------------------------------------


def hf_generate(hf_model: Any, prompt: list[int], num_new_tokens: int) -> list[int]:
    output = hf_model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )
    return output[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_engine_greedy_tokens_match_hf_generate_with_a_prefix_hit(checkpoint: Path, hf_model: Any) -> None:
    """Prompts longer than the window through the whole engine; the second
    batch shares a 2-block prefix with the first and hits the prefix cache."""
    from pagedllm import LLM, SamplingParams

    rng = random.Random(3)
    vocab = hf_model.config.vocab_size
    prefix = [rng.randrange(8, vocab) for _ in range(32)]
    first = [[rng.randrange(8, vocab) for _ in range(n)] for n in (5, 19)] + [prefix + [rng.randrange(8, vocab)]]
    second = [prefix + [rng.randrange(8, vocab) for _ in range(n)] for n in (3, 9)]
    llm = LLM(model=str(checkpoint), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for batch, expect_hit in ((first, False), (second, True)):
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        for prompt, output in zip(batch, outputs, strict=True):
            assert list(output.outputs[0].token_ids) == hf_generate(hf_model, prompt, 12)
            assert (output.num_cached_tokens >= 32) is expect_hit
