"""The shipped tiny model's held-out text, scored through the engine's own
prompt logprobs: what the quality bounds of int8 weights and fp8 KV caches
are measured on."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

from pagedllm import LLM, SamplingParams


class ValidationScore(NamedTuple):
    perplexity: float
    top1: list[int]  # the most likely next token at every scored position


def validation_sample(num_windows: int = 32) -> tuple[list[list[int]], int]:
    """`num_windows` windows of 256 tokens from across the validation files, and the BOS id."""
    from pagedllm.model_registry import tiny
    from pagedllm.training.tiny.evaluate import validation_windows

    all_windows, bos_id = validation_windows(tiny.get_tokenizer_dir())
    step = len(all_windows) // num_windows
    return [w.tolist() for w in all_windows[::step][:num_windows]], bos_id


def validation_score(llm: LLM, windows: list[list[int]], bos_id: int) -> ValidationScore:
    """exp(mean NLL) of every window token but the first (and BOS), from
    prompt logprobs, and the argmax next token at each of those positions."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, count, top1 = 0.0, 0, []
    for window, output in zip(windows, outputs, strict=True):
        assert output.prompt_logprobs is not None
        for token, entry in zip(window[1:], output.prompt_logprobs[1:], strict=True):
            if token != bos_id:
                nll -= entry[token].logprob
                count += 1
                top1.append(next(t for t, logprob in entry.items() if logprob.rank == 1))
    return ValidationScore(math.exp(nll / count), top1)


def greedy_token_ids(model: str | Path, prompts: list[list[int]], max_tokens: int = 8,
                     **llm_kwargs: Any) -> list[list[int]]:
    """pagedllm's greedy continuation of each prompt, in float32, one engine
    built and shut down (the checkpoint-format tests compare it to transformers')."""
    llm = LLM(model=str(model), dtype="float32", num_kv_blocks=32, **llm_kwargs)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()
