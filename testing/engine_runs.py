"""Engines on the shipped tiny model, for the suites that judge a component
by what an engine does with it (drafters, KV connectors)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.testing.suite import ConformanceError

if TYPE_CHECKING:
    from pagedllm.engine.llm import LLM

BLOCK_SIZE = 16
MODEL: dict[str, Any] = dict(model="tiny", dtype="float32")


def random_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 400) for _ in range(length)] for _ in range(num)]


def tiny_llm(**kwargs: Any) -> LLM:
    from pagedllm import LLM

    return LLM(**{**MODEL, **kwargs})


def generate_tokens(llm: LLM, prompts: list[list[int]], params: Any) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def engine_core(llm: LLM) -> Any:
    """The in-process EngineCore behind an LLM."""
    return llm.engine_core.engine_core  # type: ignore[attr-defined]


def limit_steps(rule: str, llm: LLM, max_steps: int) -> Callable[[], int]:
    """Make the engine raise ConformanceError(rule) past ``max_steps`` steps
    (a component that keeps the engine busy for ever); returns a counter."""
    core = engine_core(llm)
    step = core.step
    steps = [0]

    def limited_step() -> Any:
        steps[0] += 1
        if steps[0] > max_steps:
            raise ConformanceError(rule, f"the engine still had work after {max_steps} steps")
        return step()

    core.step = limited_step
    return lambda: steps[0]


def block_leak(llm: LLM) -> str | None:
    """Why the KV pool is not whole again (None: every block is free)."""
    manager = engine_core(llm).kv_cache_manager
    if manager.num_free_blocks != manager.num_blocks:
        return f"{manager.num_blocks - manager.num_free_blocks} of {manager.num_blocks} KV blocks still allocated"
    try:
        manager.check_invariants([])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
