"""The shipped model family: pagedllm-tiny (trained target) and
pagedllm-tiny-draft, their aliases, their quality on the validation files,
agreement with Hugging Face transformers, and serving them."""

from __future__ import annotations

import fnmatch
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers.server import start_server

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_llm import served_name_of
from pagedllm.model_registry import tiny
from pagedllm.model_registry.tiny import corpus
from pagedllm.model_registry.tiny.tokenizer import IM_END_TOKEN, IM_START_TOKEN, source_encoder

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_DIR = tiny.get_tiny_model_dir("tiny")
DRAFT_DIR = tiny.get_tiny_model_dir("tiny-draft")
MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "README.md",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CODE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.",
]
VAL_WINDOW = 256  # the training sequence length
VAL_STRIDE = 4  # the perplexity tests score every 4th validation window


# ------------------------------------------------------------------ names


def test_aliases_resolve_to_the_shipped_folders() -> None:
    weights = Path(tiny.__file__).resolve().parent / "weights"
    for alias, folder in [
        ("tiny", "pagedllm-tiny"),
        ("pagedllm-tiny", "pagedllm-tiny"),
        ("tiny-draft", "pagedllm-tiny-draft"),
        ("pagedllm-tiny-draft", "pagedllm-tiny-draft"),
        ("tiny-eagle", "pagedllm-tiny-eagle"),
        ("pagedllm-tiny-eagle", "pagedllm-tiny-eagle"),
    ]:
        assert tiny.resolve_model_path(alias) == str(weights / folder)
        assert served_name_of(alias) == folder
    assert tiny.resolve_model_path(None) == str(weights / "pagedllm-tiny") == str(tiny.get_default_model_dir())
    assert served_name_of(None) == "pagedllm-tiny"
    assert tiny.resolve_model_path("some/model") == "some/model"
    assert served_name_of("/models/my-llama") == "my-llama"
    assert tiny.get_tokenizer_dir() == weights / "tokenizer"
    with pytest.raises(ValueError, match="not a shipped tiny model"):
        tiny.get_tiny_model_dir("tiny-huge")


def test_alias_works_as_a_tokenizer_path_and_in_a_config_file(tmp_path: Path) -> None:
    from pagedllm.core.config import EngineConfig
    from pagedllm.model_registry.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("tiny-draft")
    assert len(tokenizer) == 8192 and tokenizer.convert_tokens_to_ids(IM_START_TOKEN) == 3
    config_file = tmp_path / "engine.yaml"
    config_file.write_text("model:\n  model: tiny-draft\n  tokenizer: tiny\n")
    llm = LLM(config_file=str(config_file), num_kv_blocks=16)
    assert llm.engine_core.ready.model_path == str(DRAFT_DIR)
    assert llm.get_tokenizer().name_or_path == str(TARGET_DIR)
    assert EngineConfig.from_flat(config_file=str(config_file)).model.model == "tiny-draft"


# ----------------------------------------------------------- the folders


def _num_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (not iterable)


def test_shipped_folders_are_complete_half_precision_and_small() -> None:
    from safetensors import safe_open

    total_bytes = 0
    for model_dir in (TARGET_DIR, DRAFT_DIR):
        assert {p.name for p in model_dir.iterdir()} >= MODEL_FILES
        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.float16}  # noqa: SIM118
        config = json.loads((model_dir / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 8192
        for name in TOKENIZER_FILES:  # one tokenizer for the family
            assert (model_dir / name).read_bytes() == (tiny.get_tokenizer_dir() / name).read_bytes()
        total_bytes += sum(p.stat().st_size for p in model_dir.iterdir())
    total_bytes += sum(p.stat().st_size for p in tiny.get_tokenizer_dir().iterdir())
    assert total_bytes <= 30 * 1024 * 1024
    assert sorted(p.name for p in tiny.get_tokenizer_dir().iterdir()) == sorted(TOKENIZER_FILES)

    target_params, draft_params = _num_parameters(TARGET_DIR), _num_parameters(DRAFT_DIR)
    assert 5_000_000 <= target_params <= 15_000_000
    assert draft_params * 4 <= target_params


def test_pyproject_ships_every_weights_file_as_package_data() -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["pagedllm.model_registry.tiny"]
    package_dir = Path(tiny.__file__).resolve().parent
    shipped = [p.relative_to(package_dir).as_posix() for p in (package_dir / "weights").rglob("*") if p.is_file()]
    assert len(shipped) >= 2 * len(MODEL_FILES) + len(TOKENIZER_FILES)
    unmatched = [path for path in shipped if not any(fnmatch.fnmatch(path, pattern) for pattern in patterns)]
    assert unmatched == []


# ------------------------------------------------------ corpus and tokens


def test_corpus_split_is_by_file_deterministic_and_stdlib_only() -> None:
    train = corpus.load_split("train")
    validation = corpus.load_split("validation")
    train_paths = {f.rel_path for f in train}
    validation_paths = {f.rel_path for f in validation}
    assert train_paths and validation_paths and not train_paths & validation_paths
    assert all(corpus.split_of(path) == "validation" for path in validation_paths)
    assert not any("site-packages" in path for path in train_paths | validation_paths)
    metric_paths = {f.rel_path for f in corpus.load_split("validation", for_metric=True)}
    assert metric_paths == {p for p in validation_paths if not p.startswith("encodings/")}
    # The split depends on the relative path alone.
    assert corpus.split_of("json/decoder.py") == corpus.split_of("json/decoder.py")


def test_source_text_keeps_special_token_strings_as_text() -> None:
    encoder = source_encoder(tiny.get_tokenizer_dir())
    source = 'MARKER = "<|im_start|>"  # and <|eos|>, <|bos|>\n'
    ids = encoder.encode(source, add_special_tokens=False).ids
    assert not set(ids) & {0, 1, 2, 3, 4}
    assert encoder.decode(ids, skip_special_tokens=False) == source


# ------------------------------------------------- pagedllm vs transformers


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny", dtype="float32", num_kv_blocks=64)


def test_chat_template_still_gives_the_marker_tokens(llm: LLM) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def main():"}]
    hf_tokenizer = AutoTokenizer.from_pretrained(str(TARGET_DIR))
    hf_ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    (output,) = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    assert output.prompt_token_ids == list(hf_ids)
    start, end = (hf_tokenizer.convert_tokens_to_ids(t) for t in (IM_START_TOKEN, IM_END_TOKEN))
    assert output.prompt_token_ids[0] == start
    assert output.prompt_token_ids.count(start) == 3 and output.prompt_token_ids.count(end) == 2


@pytest.mark.slow
def test_hf_transformers_and_pagedllm_greedy_tokens_match(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(TARGET_DIR), dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(
        CODE_PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    for prompt, output in zip(CODE_PROMPTS, outputs, strict=True):
        prompt_ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            expected = hf_model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt_ids) :].tolist()
        assert output.outputs[0].token_ids == expected


def test_llm_without_a_model_uses_pagedllm_tiny() -> None:
    default = LLM(num_kv_blocks=16)
    assert default.engine_core.ready.model_path == str(TARGET_DIR)
    (output,) = default.generate(["def main():\n"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4


# --------------------------------------------------- validation perplexity


def _validation_windows() -> tuple[list[torch.Tensor], int]:
    """Every validation file but `encodings/`, BOS before each, cut into
    non-overlapping VAL_WINDOW-token windows (the tail is a shorter one)."""
    encoder = source_encoder(tiny.get_tokenizer_dir())
    bos_id = encoder.token_to_id("<|bos|>")
    files = corpus.load_split("validation", for_metric=True)
    stream: list[int] = []
    for encoding in encoder.encode_batch([f.text for f in files], add_special_tokens=False):
        stream += [bos_id, *encoding.ids]
    windows = list(torch.tensor(stream).split(VAL_WINDOW))
    assert sum(len(w) for w in windows) == len(stream) > 300_000
    return windows, bos_id


def _perplexity(model_dir: Path, windows: list[torch.Tensor], bos_id: int) -> float:
    """exp(mean NLL) over every predicted token: all but each window's first
    token and BOS (file starts)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total_nll, num_tokens = 0.0, 0
    # Every VAL_STRIDE-th full window, spread over every validation file: a
    # quarter of the tokens (~75k), which keeps the suite's time and moves
    # the figure by well under the margins below (training/tiny/evaluate.py
    # reports the full split).
    full = [w for w in windows if len(w) == VAL_WINDOW][::VAL_STRIDE]
    batches = [full[i : i + 16] for i in range(0, len(full), 16)]
    with torch.inference_mode():
        for batch in batches:
            input_ids = torch.stack(batch)
            logits = model(input_ids=input_ids).logits[:, :-1]
            targets = input_ids[:, 1:].masked_fill(input_ids[:, 1:] == bos_id, -100)
            total_nll += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
            ).item()
            num_tokens += int((targets != -100).sum())
    return math.exp(total_nll / num_tokens)


@pytest.fixture(scope="module")
def validation_windows() -> tuple[list[torch.Tensor], int]:
    return _validation_windows()


@pytest.mark.slow
def test_target_validation_perplexity_is_at_most_40(validation_windows: tuple[list[torch.Tensor], int]) -> None:
    perplexity = _perplexity(TARGET_DIR, *validation_windows)
    assert perplexity <= 40.0, f"pagedllm-tiny: validation perplexity {perplexity:.2f}"


@pytest.mark.slow
def test_draft_validation_perplexity_is_at_most_80(validation_windows: tuple[list[torch.Tensor], int]) -> None:
    perplexity = _perplexity(DRAFT_DIR, *validation_windows)
    assert perplexity <= 80.0, f"pagedllm-tiny-draft: validation perplexity {perplexity:.2f}"


# ------------------------------------------------------------- real text


WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@pytest.fixture(scope="module")
def corpus_words() -> set[str]:
    words: set[str] = set()
    for source in corpus.load_split("train"):
        words.update(WORD.findall(source.text))
    return words


def looks_like_corpus_text(samples: list[tuple[str, int]], tokenizer: Any, corpus_words: set[str]) -> bool:
    """Texts made of the corpus's own tokens, not byte soup. `samples` holds
    (text, number of generated tokens) pairs.

    A trained model emits the tokenizer's own segmentation of words it has
    seen: its text re-encodes to the same number of tokens, and its words
    (identifier-like runs of letters) are words of the corpus. Random weights
    emit arbitrary token sequences: pieces that merge or split differently
    when the text is re-encoded, glued into words the corpus never had
    (measured: 21-60 % known words, 1.04-1.19 tokens per generated token,
    against 89-100 % and 1.00 for pagedllm-tiny).
    """
    words = [w for text, _ in samples for w in WORD.findall(text) if len(w) >= 2]
    if len(words) < 10:
        return False
    known_words = sum(w in corpus_words for w in words) / len(words)
    reencoded = sum(len(tokenizer.encode(text, add_special_tokens=False)) for text, _ in samples)
    tokens_per_token = reencoded / sum(num_tokens for _, num_tokens in samples)
    return known_words >= 0.8 and abs(tokens_per_token - 1.0) <= 0.02


CHAT = [{"role": "user", "content": "Write a Python function that reads a file and returns its lines."}]
SEEDS = range(4)


def _sampling(seed: int) -> dict[str, Any]:
    # Seeded sampling: greedy decoding of a model this small loops on one line.
    return {"temperature": 0.7, "top_p": 0.95, "seed": seed, "max_tokens": 48, "ignore_eos": True}


@pytest.mark.slow
def test_random_weights_fail_the_real_text_check(corpus_words: set[str]) -> None:
    random_llm = LLM(model=str(tiny.get_benchmark_model_dir()), num_kv_blocks=16)
    samples = []
    for seed in SEEDS:
        (output,) = random_llm.chat(CHAT, SamplingParams(**_sampling(seed)), use_tqdm=False)
        samples.append((output.outputs[0].text, len(output.outputs[0].token_ids)))
    assert not looks_like_corpus_text(samples, random_llm.get_tokenizer(), corpus_words)


@pytest.mark.slow
def test_serve_without_a_model_chats_in_real_corpus_tokens(corpus_words: set[str]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TARGET_DIR))
    samples = []
    with start_server(None, "--num-kv-blocks", "64") as server:
        models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["pagedllm-tiny"]
        for seed in SEEDS:
            response = httpx.post(
                f"{server.base_url}/v1/chat/completions", json={"messages": CHAT, **_sampling(seed)}, timeout=60
            ).json()
            assert response["model"] == "pagedllm-tiny" and response["usage"]["completion_tokens"] == 48
            samples.append((response["choices"][0]["message"]["content"], 48))
    assert looks_like_corpus_text(samples, tokenizer, corpus_words), samples
