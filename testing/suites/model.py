"""The model suite: a registered architecture computes what Hugging Face
transformers computes, with every checkpoint weight used and none invented.

Each rule builds a random-weight checkpoint of the architecture from a
config.json (``pagedllm.testing.checkpoints``: the architecture's entry in
``MODEL_CONFIGS``, else transformers' config for it shrunk to 2 layers of
width 64) and loads it in an engine (float32, CPU). An architecture that
transformers does not know and ``MODEL_CONFIGS`` does not list cannot be
compared: its rules are skipped.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pagedllm.testing.components import load
from pagedllm.testing.engine_runs import engine_core, generate_tokens
from pagedllm.testing.suite import ConformanceError, RuleSkipped, Suite

KIND = "model"
SUITE = Suite(KIND)

PROMPT_LENGTHS = (5, 17, 33)
NUM_NEW_TOKENS = 8


def _config(rule: str, name: str) -> dict[str, Any]:
    from pagedllm.testing.checkpoints import config_json

    config = config_json(name)
    if config is None:
        raise RuleSkipped(rule, f"transformers has no {name} and MODEL_CONFIGS no config.json for it")
    return config


def _engine(rule: str, path: Path) -> Any:
    from pagedllm import LLM

    try:
        return LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    except Exception as exc:
        raise ConformanceError(rule, f"the checkpoint did not load: {type(exc).__name__}: {exc}") from exc


def _model_of(llm: Any) -> Any:
    return engine_core(llm).model_executor.driver_worker.model_runner.model


@SUITE.rule("loads")
def check_loads(name: str) -> None:
    """The target imports and is a ModelForCausalLM (subclass or 1.0 duck type)."""
    load("loads", KIND, name)


@SUITE.rule("greedy-matches-hf")
def check_greedy(name: str) -> None:
    """Greedy tokens of a batch of prompts of different lengths equal transformers' for each prompt."""
    import random

    from pagedllm import SamplingParams
    from pagedllm.testing.checkpoints import hf_greedy, save_random_checkpoint

    rule = "greedy-matches-hf"
    config = _config(rule, name)
    with tempfile.TemporaryDirectory(prefix="pagedllm-conformance-model-") as folder:
        path = save_random_checkpoint(config, Path(folder), seed=1)
        rng = random.Random(0)
        prompts = [[rng.randrange(8, config["vocab_size"]) for _ in range(n)] for n in PROMPT_LENGTHS]
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        tokens = generate_tokens(_engine(rule, path), prompts, params)
        for prompt, got in zip(prompts, tokens, strict=True):
            expected = hf_greedy(path, prompt, NUM_NEW_TOKENS)
            if got != expected:
                raise ConformanceError(
                    rule, f"a {len(prompt)}-token prompt: greedy tokens {got}, transformers gives {expected}"
                )


@SUITE.rule("weights-round-trip")
def check_round_trip(name: str) -> None:
    """Every checkpoint value lands in the model unchanged: the loaded
    parameters hold as many values as the checkpoint, with the same sum and
    sum of squares (layout-free, so packed or transposed weights pass)."""
    import torch
    from safetensors.torch import load_file

    from pagedllm.testing.checkpoints import save_random_checkpoint

    rule = "weights-round-trip"
    config = _config(rule, name)
    with tempfile.TemporaryDirectory(prefix="pagedllm-conformance-model-") as folder:
        path = save_random_checkpoint(config, Path(folder), seed=2)
        model = _model_of(_engine(rule, path))
        checkpoint: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            checkpoint.update(load_file(str(file)))
    is_ignored = getattr(model, "is_ignored_weight", lambda weight: False)
    given = [t.double() for n, t in checkpoint.items() if not is_ignored(n)]
    held = [p.detach().double().cpu() for p in model.parameters()]
    facts = {
        "values": (sum(t.numel() for t in given), sum(t.numel() for t in held)),
        "sum": (sum(t.sum().item() for t in given), sum(t.sum().item() for t in held)),
        "sum of squares": (sum(t.square().sum().item() for t in given), sum(t.square().sum().item() for t in held)),
    }
    for what, (expected, actual) in facts.items():
        if abs(expected - actual) > 1e-6 * max(1.0, abs(expected)):
            raise ConformanceError(rule, f"the checkpoint's {what} is {expected:.8g}, the loaded model's {actual:.8g}")


@SUITE.rule("strict-loading")
def check_strict(name: str) -> None:
    """A checkpoint missing one weight, or holding one the model does not
    have, is a ModelLoadError naming that weight."""
    from safetensors.torch import load_file, save_file

    from pagedllm.model_registry.loader import ModelLoadError
    from pagedllm.testing.checkpoints import save_random_checkpoint

    rule = "strict-loading"
    config = _config(rule, name)
    with tempfile.TemporaryDirectory(prefix="pagedllm-conformance-model-") as folder:
        path = save_random_checkpoint(config, Path(folder), seed=3)
        (file,) = sorted(path.glob("*.safetensors"))
        weights = load_file(str(file))
        dropped = next(n for n in sorted(weights) if ".0." in n and n.endswith("weight"))
        extra = "model.conformance_unexpected.weight"
        for what, changed in (
            (f"missing {dropped}", {n: t for n, t in weights.items() if n != dropped}),
            (f"unexpected {extra}", {**weights, extra: weights[dropped].clone()}),
        ):
            save_file(changed, str(file), metadata={"format": "pt"})
            try:
                _engine_raw(path)
            except ModelLoadError as exc:
                if what.split()[1] not in str(exc):
                    raise ConformanceError(rule, f"{what}: the ModelLoadError does not name it: {exc}") from exc
                continue
            except Exception as exc:
                raise ConformanceError(rule, f"{what}: {type(exc).__name__}, not ModelLoadError: {exc}") from exc
            raise ConformanceError(rule, f"a checkpoint with {what} loaded without an error")


def _engine_raw(path: Path) -> Any:
    from pagedllm import LLM

    return LLM(model=str(path), dtype="float32", num_kv_blocks=64)
