"""An EAGLE head with a reduced draft vocabulary (draft_vocab_size + d2t, the
EAGLE-3 layout; FR-Spec's cut of the target's lm_head): its draft logits are
the target's logits restricted to the draft tokens (-inf elsewhere), random
drafts are a distribution over the draft tokens only, and greedy output is
the one without speculation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.loader import ModelLoadError, iterate_safetensors, load_hf_config
from pagedllm.model_registry.tiny import WEIGHTS_DIR
from pagedllm.spec_decode.eagle import EagleHead
from pagedllm.spec_decode.model_drafter import DraftSampling
from pagedllm.testing.suites.drafter import repeated_span_prompts
from pagedllm.training.draft_vocab import draft_vocab_tensors, most_frequent_tokens, write_draft_vocab

VOCAB = 8192
DRAFT_VOCAB = 1024
EAGLE_HEAD = WEIGHTS_DIR / "pagedllm-tiny-eagle"


def _draft_ids() -> torch.Tensor:
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:DRAFT_VOCAB].sort().values


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eagle-draft-vocab") / "head"
    write_draft_vocab(EAGLE_HEAD, out, _draft_ids())
    return out


def _llm(head: Path | None, **kwargs: Any) -> LLM:
    extra = {} if head is None else {
        "speculative_config": {"method": "eagle", "model": str(head), "num_speculative_tokens": 3,
                               "policy": "always"}}
    return LLM(model="tiny", dtype="float32", num_kv_blocks=128, **extra, **kwargs)


def _drafter(llm: LLM) -> Any:
    return llm.engine_core.engine_core.model_executor.driver_worker.model_runner.drafter  # type: ignore[attr-defined]


def test_most_frequent_tokens_and_the_d2t_layout() -> None:
    ids = most_frequent_tokens([7, 3, 3, 9, 7, 3, 5], vocab_size=10, num_tokens=3)
    assert ids.tolist() == [3, 5, 7]  # 3 x3, 7 x2, then 5 and 9 once each: the smaller id
    tensors = draft_vocab_tensors(ids, vocab_size=10)
    assert tensors["d2t"].tolist() == [3, 4, 5]  # target id = draft id + d2t
    assert tensors["t2d"].nonzero().flatten().tolist() == [3, 5, 7]


def test_reduced_draft_logits_are_the_target_logits_on_the_draft_tokens(head_dir: Path) -> None:
    llm = _llm(head_dir, enforce_eager=True)
    drafter = _drafter(llm)
    target = drafter.target
    ids = _draft_ids()
    assert drafter.head.draft_target_ids().tolist() == ids.tolist()
    features = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = drafter._compute_logits(features)
        full = target.compute_logits(features)
    weight = target.lm_head.weight.detach()  # tied: the embedding
    reference = features @ weight[ids].T  # plain torch
    assert logits.shape == (5, VOCAB) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[:, ids], reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert bool((logits[:, outside] == float("-inf")).all())
    # random drafting: q is a distribution over the draft tokens only
    sampling = DraftSampling(temperatures=torch.ones(5), is_greedy=torch.zeros(5, dtype=torch.bool),
                             all_greedy=False, seeds=[None] * 5)
    tokens, probs = drafter._sample_drafts(logits, sampling, 0)
    assert probs is not None
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(5))
    assert bool((probs[:, outside] == 0).all()) and bool(torch.isin(tokens, ids).all())
    torch.testing.assert_close(probs[:, ids], reference.softmax(dim=-1), rtol=1e-5, atol=1e-6)


def test_greedy_output_with_a_reduced_draft_vocabulary_is_the_one_without_speculation(head_dir: Path) -> None:
    prompts = repeated_span_prompts(6, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def generate(llm: LLM) -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    llm = _llm(head_dir)  # draft steps replay graphs (the default)
    assert generate(llm) == generate(_llm(None))
    stats = llm.engine_core.engine_core.scheduler.total_spec_decoding_stats
    assert stats.num_draft_tokens > 0 and _drafter(llm).draft_graphs.num_replays > 0


def test_a_reduced_head_without_d2t_or_with_a_bad_one_is_refused(head_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(head_dir / "model.safetensors"))
    (tmp_path / "config.json").write_text((head_dir / "config.json").read_text())
    head = EagleHead(load_hf_config(str(tmp_path)), TorchNativeBackend)
    save_file({k: v for k, v in weights.items() if k != "d2t"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="d2t"):
        head.load_checkpoint(iterate_safetensors(tmp_path), str(tmp_path))
    d2t = weights["d2t"].clone()
    d2t[-1] = VOCAB  # past the target's vocabulary
    save_file({**weights, "d2t": d2t}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="distinct target ids"):
        head.load_checkpoint(iterate_safetensors(tmp_path), str(tmp_path))
    assert json.loads((head_dir / "config.json").read_text())["draft_vocab_size"] == DRAFT_VOCAB
