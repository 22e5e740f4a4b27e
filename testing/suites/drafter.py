"""The drafter suite: drafts may be wrong, never harmful.

Every rule runs the drafter in an engine on the shipped tiny model (float32,
``uni`` executor) over prompts with repeated spans (so any sensible drafter
has something to propose), and takes the expected tokens from the same
engine without speculation. A drafter whose registration says
``needs_model=True`` drafts with ``DRAFTER_MODELS[name]`` (default: the
shipped draft model; ``eagle``: the shipped EAGLE head). Its proposals are
recorded by wrapping the registered class's ``propose`` for the run.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

from pagedllm.testing.components import load, registration
from pagedllm.testing.engine_runs import engine_core, generate_tokens, limit_steps, tiny_llm
from pagedllm.testing.suite import ConformanceError, Suite

KIND = "drafter"
SUITE = Suite(KIND)

# The drafting model of a drafter registered with needs_model=True.
DRAFTER_MODELS: dict[str, str] = {"eagle": "tiny-eagle"}
DEFAULT_DRAFTER_MODEL = "tiny-draft"
MAX_NEW_TOKENS = 12
MAX_STEPS = 400


def repeated_span_prompts(num: int, seed: int) -> list[list[int]]:
    """Token ids with repeated spans (so prompt lookup finds matches), of
    varied lengths; the repository's speculative-decoding tests use them too."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        span = [rng.randrange(8, 400) for _ in range(rng.randrange(3, 8))]
        prompt = [rng.randrange(8, 400) for _ in range(rng.randrange(1, 6))]
        for _ in range(rng.randrange(2, 5)):
            prompt += span + [rng.randrange(8, 400)]
        prompts.append(prompt)
    return prompts


def _greedy() -> Any:
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def _speculative(rule: str, name: str, k: int) -> dict[str, Any]:
    # The drafter's rules, not the policy's: drafts every step (the default
    # policy's choices follow measured step times, which vary from run to run).
    config: dict[str, Any] = {"method": name, "num_speculative_tokens": k, "policy": "always"}
    if registration(rule, KIND, name).info.needs_model:
        config["model"] = DRAFTER_MODELS.get(name, DEFAULT_DRAFTER_MODEL)
    return config


def _engine(rule: str, name: str, k: int) -> Any:
    try:
        llm = tiny_llm(num_kv_blocks=256, speculative_config=_speculative(rule, name, k))
    except Exception as exc:
        raise ConformanceError(rule, f"an engine with the drafter did not start: {type(exc).__name__}: {exc}") from exc
    limit_steps(rule, llm, MAX_STEPS)
    return llm


def _run(rule: str, llm: Any, prompts: list[list[int]], params: Any) -> list[list[int]]:
    try:
        return generate_tokens(llm, prompts, params)
    except ConformanceError:
        raise
    except Exception as exc:
        raise ConformanceError(rule, f"generation raised {type(exc).__name__}: {exc}") from exc


_references: dict[str, list[list[int]]] = {}


def _reference(prompts: list[list[int]], params: Any) -> list[list[int]]:
    """Tokens without speculation (the same for every drafter: computed once)."""
    key = repr((prompts, params))
    if key not in _references:
        _references[key] = generate_tokens(tiny_llm(num_kv_blocks=256), prompts, params)
    return _references[key]


Proposal = tuple[list[str], list[list[int]], list[list[int]]]  # req_ids, token_ids, drafts


@contextlib.contextmanager
def _recorded(rule: str, name: str) -> Iterator[list[Proposal]]:
    """Every propose() call of the drafter while inside: its request ids,
    their tokens, and the drafts returned."""
    cls = load(rule, KIND, name)
    original = cls.__dict__.get("propose")
    propose = cls.propose
    calls: list[Proposal] = []

    def recording_propose(self: Any, inputs: Any) -> Any:
        output = propose(self, inputs)
        drafts = getattr(output, "draft_token_ids", None)
        if not isinstance(drafts, list) or len(drafts) != len(inputs.req_ids):
            raise ConformanceError(
                rule, f"propose() for {len(inputs.req_ids)} requests returned draft_token_ids {drafts!r}"
            )
        calls.append(([*inputs.req_ids], [list(t) for t in inputs.token_ids], [list(d) for d in drafts]))
        return output

    cls.propose = recording_propose
    try:
        yield calls
    finally:
        if original is None:
            del cls.propose
        else:
            cls.propose = original


@SUITE.rule("loads")
def check_loads(name: str) -> None:
    """The target imports and subclasses Drafter; an engine starts with it."""
    load("loads", KIND, name)
    _engine("loads", name, 3)


@SUITE.rule("proposes-drafts")
def check_proposes(name: str) -> None:
    """On prompts of repeated spans the drafter proposes drafts (else every other rule checks nothing)."""
    rule = "proposes-drafts"
    llm = _engine(rule, name, 3)
    _run(rule, llm, repeated_span_prompts(5, seed=1), _greedy())
    if engine_core(llm).scheduler.total_spec_decoding_stats.num_draft_tokens == 0:
        raise ConformanceError(rule, "no draft was proposed on prompts of repeated spans")


@SUITE.rule("greedy-output-unchanged")
def check_greedy(name: str) -> None:
    """Greedy tokens with the drafter (k = 1 and 4) equal those without."""
    rule = "greedy-output-unchanged"
    prompts = repeated_span_prompts(5, seed=1)
    expected = _reference(prompts, _greedy())
    for k in (1, 4):
        tokens = _run(rule, _engine(rule, name, k), prompts, _greedy())
        if tokens != expected:
            raise ConformanceError(rule, f"k={k}: greedy tokens {tokens} differ from no speculation {expected}")


@SUITE.rule("respects-k")
def check_k(name: str) -> None:
    """No proposal is longer than num_speculative_tokens, and every draft token is in the vocabulary."""
    rule = "respects-k"
    for k in (1, 3):
        llm = _engine(rule, name, k)
        vocab_size = engine_core(llm).vocab_size
        with _recorded(rule, name) as calls:
            _run(rule, llm, repeated_span_prompts(4, seed=2), _greedy())
        for req_ids, _, drafts in calls:
            for req_id, draft in zip(req_ids, drafts, strict=True):
                if len(draft) > k:
                    raise ConformanceError(rule, f"k={k}: proposed {len(draft)} drafts for {req_id}: {draft}")
                if any(not 0 <= t < vocab_size for t in draft):
                    raise ConformanceError(rule, f"draft {draft} for {req_id} leaves the vocabulary ({vocab_size})")


@SUITE.rule("handles-empty-proposals")
def check_empty(name: str) -> None:
    """Prompts with nothing to repeat (where a drafter may propose nothing) and
    one-token prompts still generate exactly the non-speculative tokens; a
    drafter without a model answers an empty batch with no drafts."""
    from pagedllm.spec_decode.interface import DraftInputs

    rule = "handles-empty-proposals"
    rng = random.Random(3)
    prompts = [rng.sample(range(8, 400), 20), [rng.randrange(8, 400)], rng.sample(range(8, 400), 7)]
    expected = _reference(prompts, _greedy())
    llm = _engine(rule, name, 3)
    tokens = _run(rule, llm, prompts, _greedy())
    if tokens != expected:
        raise ConformanceError(rule, f"tokens {tokens} differ from no speculation {expected}")
    if not registration(rule, KIND, name).info.needs_model:
        # The engine's own instance (built with its real context), called outside a step.
        drafter = engine_core(llm).model_executor.driver_worker.model_runner.drafter
        output = drafter.propose(DraftInputs(req_ids=[], token_ids=[], sampling_params=[]))
        if list(output.draft_token_ids) != []:
            raise ConformanceError(rule, f"an empty batch got drafts {output.draft_token_ids!r}")


@SUITE.rule("batch-order")
def check_batch_order(name: str) -> None:
    """Each request gets the drafts it gets alone, wherever it sits in a batch."""
    rule = "batch-order"
    prompts = repeated_span_prompts(4, seed=4)
    alone: dict[int, list[list[int]]] = {}
    llm = _engine(rule, name, 3)
    for index, prompt in enumerate(prompts):
        with _recorded(rule, name) as calls:
            _run(rule, llm, [prompt], _greedy())
        alone[index] = [drafts[0] for _, _, drafts in calls]
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        with _recorded(rule, name) as calls:
            _run(rule, llm, [prompts[i] for i in order], _greedy())
        by_prompt: dict[int, list[list[int]]] = {i: [] for i in order}
        for _, token_ids, drafts in calls:
            for tokens, draft in zip(token_ids, drafts, strict=True):
                by_prompt[_which(prompts, tokens)].append(draft)
        for index in order:
            if by_prompt[index] != alone[index]:
                raise ConformanceError(
                    rule,
                    f"batch order {order}: prompt {index} got drafts {by_prompt[index]}, "
                    f"alone it got {alone[index]}",
                )


def _which(prompts: list[list[int]], tokens: list[int]) -> int:
    for index, prompt in enumerate(prompts):
        if tokens[: len(prompt)] == prompt:
            return index
    raise ValueError("tokens of no prompt")


@SUITE.rule("seeded-sampling")
def check_seeded(name: str) -> None:
    """Seeded random requests with drafts are reproducible run to run, and a
    seeded request gets the same tokens alone and in a batch of unseeded ones."""
    from pagedllm import SamplingParams

    rule = "seeded-sampling"
    prompts = repeated_span_prompts(4, seed=5)
    seeded = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        for i in range(len(prompts))
    ]
    first = _run(rule, _engine(rule, name, 3), prompts, seeded)
    second = _run(rule, _engine(rule, name, 3), prompts, seeded)
    if first != second:
        raise ConformanceError(rule, f"the same seeded requests gave {first}, then {second}")
    unseeded = SamplingParams(temperature=1.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    llm = _engine(rule, name, 3)
    (alone,) = _run(rule, llm, prompts[:1], seeded[0])
    in_batch = _run(rule, llm, [prompts[1], prompts[0], prompts[2]], [unseeded, seeded[0], unseeded])
    if in_batch[1] != alone:
        raise ConformanceError(rule, f"a seeded request gave {alone} alone and {in_batch[1]} in a batch")
