"""The three example plugin packages under examples/plugins, installed with pip
(`make test` runs `pip install -e examples/plugins/...`) and found only
through their `pagedllm.plugins` entry points:

- pagedllm-example-model: GPT-2, greedy tokens equal transformers';
- pagedllm-example-attention: `sdpa`, outputs equal torch_native's;
- pagedllm-example-platform: `example_accel`, wins platform=auto only while
  PAGEDLLM_EXAMPLE_PLATFORM is set; two available out-of-tree platforms is an
  error naming both.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from helpers.server import start_server
from helpers.tiny_gpt2 import cached_tiny_gpt2, transformers_greedy
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.attention_backends.base import AttentionMetadata
from pagedllm.attention_backends.selector import select_attention_backend
from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import AttentionBackendError, ConfigError
from pagedllm.engine.builder import build_engine
from pagedllm.entrypoints.cli import main as cli_main
from pagedllm.platforms import resolve_platform
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl

# distribution -> (entry point name, kind, registered component name)
EXAMPLES = {
    "pagedllm-example-model": ("example_model", "model", "GPT2LMHeadModel"),
    "pagedllm-example-attention": ("example_attention", "attention_backend", "sdpa"),
    "pagedllm-example-platform": ("example_platform", "platform", "example_accel"),
    "pagedllm-example-drafter": ("example_drafter", "drafter", "suffix_window"),
}
EXAMPLE_API_RANGE = ">=1.0,<2"
PLATFORM_ENV = "PAGEDLLM_EXAMPLE_PLATFORM"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox jumps over the lazy dog. " * 3]


def _source(distribution: str) -> str:
    return f"{distribution} {importlib.metadata.version(distribution)}"


def _greedy(max_tokens: int = 8, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


@pytest.fixture(autouse=True)
def _example_platform_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PLATFORM_ENV, raising=False)


# ---- discovery ---------------------------------------------------------------


@pytest.mark.parametrize("distribution", sorted(EXAMPLES))
def test_example_is_discovered_through_its_installed_entry_point(distribution: str) -> None:
    entry_point_name, kind, component = EXAMPLES[distribution]
    dist = importlib.metadata.distribution(distribution)
    [entry_point] = [ep for ep in dist.entry_points if ep.group == "pagedllm.plugins"]
    assert entry_point.name == entry_point_name

    pm = get_plugin_manager()
    registration = pm.registry(kind).get(component)
    assert registration.source == f"{distribution} {dist.version}"
    [info] = [p for p in pm.plugins() if p.name == entry_point_name]
    assert (info.distribution, info.version, info.api_range) == (distribution, dist.version, EXAMPLE_API_RANGE)
    assert pm.api_compatibility(entry_point_name).compatible
    assert entry_point_name not in [error.plugin for error in pm.load_errors]


def test_plugins_list_shows_the_examples_with_versions_and_api(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plugins", "list", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    plugins = {p["name"]: p for p in payload["plugins"]}
    for distribution, (entry_point_name, kind, component) in EXAMPLES.items():
        version = importlib.metadata.version(distribution)
        assert plugins[entry_point_name] == {
            "name": entry_point_name,
            "source": f"{distribution} {version}",
            "distribution": distribution,
            "version": version,
            "api_range": EXAMPLE_API_RANGE,
            "api_compatible": True,
            "api": f"{EXAMPLE_API_RANGE} (compatible)",
            "config_model": None,  # these declare no options of their own
            "options": None,
        }
        assert {"name": component, "source": f"{distribution} {version}"}.items() <= next(
            c for c in payload["components"][kind] if c["name"] == component
        ).items()
    # The example connector declares its own options (its README): none set, the defaults.
    connector = plugins["example_connector"]
    assert (connector["config_model"], connector["options"]) == (
        "pagedllm_example_connector.options:MemoryStoreOptions", {"max_blocks": None})

    assert cli_main(["plugins", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for distribution, (entry_point_name, _, _) in EXAMPLES.items():
        [line] = [line for line in lines if line.split()[:1] == [entry_point_name]]
        assert line.split() == [entry_point_name, distribution, importlib.metadata.version(distribution),
                                EXAMPLE_API_RANGE, "(compatible)"]


def test_trace_env_logs_every_hook_call_of_the_cli_at_the_default_log_level() -> None:
    env = {**os.environ, "PAGEDLLM_TRACE_PLUGINS": "1"}
    env.pop("PAGEDLLM_LOG_LEVEL", None)  # WARNING: the trace must show anyway
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "plugins", "list"],
                            env=env, capture_output=True, text=True, timeout=60, check=True)
    trace = result.stderr.splitlines()
    for hook_name in ("register_platforms", "register_attention_backends", "register_models"):
        assert any(f"hook {hook_name}(register=" in line for line in trace), hook_name
    # one call per plugin, each naming the implementation it reached
    for entry_point_name, kind, _ in EXAMPLES.values():
        hook_name = {"model": "register_models", "attention_backend": "register_attention_backends",
                     "platform": "register_platforms", "drafter": "register_drafters"}[kind]
        assert any(line.startswith(f"INFO:pagedllm.plugins:hook {hook_name}(") and
                   line.endswith(f"-> ['{entry_point_name}']") for line in trace), entry_point_name
    assert any(line.endswith("hook register_models returned []") for line in trace)


# ---- GPT-2 (pagedllm-example-model) -------------------------------------------


def test_gpt2_greedy_tokens_equal_transformers() -> None:
    from pagedllm_example_model.gpt2 import GPT2LMHeadModel

    path = cached_tiny_gpt2()
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    assert type(llm.engine_core.engine_core.model_executor.driver_worker.model) is GPT2LMHeadModel
    outputs = llm.generate(PROMPTS, _greedy(10), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.outputs[0].token_ids == transformers_greedy(path, tokenizer.encode(prompt), 10)


def test_gpt2_checkpoint_with_untied_head_and_exact_gelu_loads_strictly(tmp_path: Path) -> None:
    """Config variants the loader must honour: an untied lm_head is a real
    weight, activation_function picks the GELU flavour."""
    from helpers.tiny_gpt2 import build_tiny_gpt2

    path = build_tiny_gpt2(tmp_path / "gpt2", seed=3, tie_word_embeddings=False, activation_function="gelu")
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=32)
    [output] = llm.generate([PROMPTS[0]], _greedy(6), use_tqdm=False)
    assert output.outputs[0].token_ids == transformers_greedy(path, llm.get_tokenizer().encode(PROMPTS[0]), 6)


# ---- sdpa (pagedllm-example-attention) ----------------------------------------

BLOCK_SIZE = 4


def _batch(shapes: list[tuple[int, int]], skip_rows: tuple[int, ...] = ()) -> AttentionMetadata:
    """Requests given as (context after this step, new tokens), each on its
    own shuffled blocks; `skip_rows` get slot -1 (not written)."""
    generator = torch.Generator().manual_seed(len(shapes))
    blocks_needed = [-(-seq_len // BLOCK_SIZE) for seq_len, _ in shapes]
    pool = torch.randperm(sum(blocks_needed), generator=generator).tolist()
    block_tables, slots, query_start_loc = [], [], [0]
    for (seq_len, query_len), num_blocks in zip(shapes, blocks_needed, strict=True):
        blocks, pool = pool[:num_blocks], pool[num_blocks:]
        block_tables.append(blocks)
        for pos in range(seq_len - query_len, seq_len):
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        query_start_loc.append(query_start_loc[-1] + query_len)
    for row in skip_rows:
        slots[row] = -1
    width = max(map(len, block_tables))
    table = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int32)
    starts = torch.tensor(query_start_loc, dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in shapes], dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=query_start_loc[-1],
        num_reqs=len(shapes),
        max_query_len=max(q for _, q in shapes),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def _attend(backend: type, metadata: AttentionMetadata, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, ...]:
    head_size = 16
    generator = torch.Generator().manual_seed(7)
    num_tokens = metadata.num_actual_tokens
    q = torch.randn(num_tokens, num_heads, head_size, generator=generator)
    k = torch.randn(num_tokens, num_kv_heads, head_size, generator=generator)
    v = torch.randn(num_tokens, num_kv_heads, head_size, generator=generator)
    num_blocks = int(metadata.block_table.max()) + 1
    # Cached context: whatever earlier steps left in the pool.
    kv_cache_shape = backend.get_kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    kv_cache = torch.randn(kv_cache_shape, generator=generator)
    impl = backend.get_impl_cls()(num_heads, head_size, head_size**-0.5, num_kv_heads)
    out = impl.forward(q, k, v, kv_cache, backend.build_metadata(metadata, BLOCK_SIZE))
    return out, kv_cache


@pytest.mark.parametrize(
    ("shapes", "skip_rows"),
    [
        ([(9, 9)], ()),  # one whole prompt
        ([(5, 1), (17, 1), (3, 1)], ()),  # decodes only
        ([(5, 1), (7, 7), (12, 4), (30, 1)], ()),  # decode, prompt, chunk after context, decode
        ([(13, 6), (2, 1), (8, 8)], (0, 7)),  # rows whose slot is -1 are not written
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2)])
def test_sdpa_outputs_equal_torch_native_on_mixed_batches(
    shapes: list[tuple[int, int]], skip_rows: tuple[int, ...], num_heads: int, num_kv_heads: int
) -> None:
    from pagedllm_example_attention.sdpa import SdpaBackend

    metadata = _batch(shapes, skip_rows)
    sdpa_out, sdpa_cache = _attend(SdpaBackend, metadata, num_heads, num_kv_heads)
    native_out, native_cache = _attend(TorchNativeBackend, metadata, num_heads, num_kv_heads)
    torch.testing.assert_close(sdpa_out, native_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(sdpa_cache, native_cache)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_sdpa_generates_what_torch_native_generates(model: str) -> None:
    """Through LLM.generate, with a token budget small enough that prompt
    chunks and decodes share steps."""
    path = cached_tiny_gpt2() if model == "gpt2" else cached_tiny_model("llama", with_tokenizer=True, seed=5)
    results = {}
    for backend in ("sdpa", "cpu"):  # the built-in formerly called torch_native
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, attention_backend=backend,
                  max_num_batched_tokens=16)
        assert llm.engine_core.ready.attention_backend == backend
        results[backend] = llm.generate(PROMPTS, _greedy(8, logprobs=1), use_tqdm=False)
    for sdpa, native in zip(results["sdpa"], results["cpu"], strict=True):
        assert sdpa.outputs[0].token_ids == native.outputs[0].token_ids
        assert sdpa.outputs[0].cumulative_logprob == pytest.approx(native.outputs[0].cumulative_logprob, abs=1e-4)


def test_sdpa_support_rules_come_from_its_registration_metadata() -> None:
    registration = get_plugin_manager().registry("attention_backend").get("sdpa")
    assert registration.metadata["supports_sliding_window"] is False
    with pytest.raises(AttentionBackendError, match=r"sliding window \(64\) is not supported"):
        select_attention_backend(CpuPlatform(), "sdpa", head_size=16, dtype=torch.float32, block_size=16,
                                 sliding_window=64, load=False)
    with pytest.raises(AttentionBackendError, match="head size 12 is not a multiple of 8"):
        select_attention_backend(CpuPlatform(), "sdpa", head_size=12, dtype=torch.float32, block_size=16, load=False)


def _write_config(path: Path, model: Path, *, attention_backend: str = "sdpa") -> Path:
    path.write_text(
        f"model:\n  model: {model}\n  dtype: float32\n"
        f"cache:\n  num_kv_blocks: 64\n"
        f"device:\n  attention_backend: {attention_backend}\n"
    )
    return path


def test_config_file_selects_the_plugin_backend_and_model(tmp_path: Path) -> None:
    from pagedllm_example_attention.sdpa import SdpaBackend
    from pagedllm_example_model.gpt2 import GPT2LMHeadModel

    gpt2 = cached_tiny_gpt2()
    config_file = _write_config(tmp_path / "engine.yaml", gpt2)
    config = EngineConfig.load(config_file)
    assert (config.device.attention_backend, config.model.model) == ("sdpa", str(gpt2))

    llm = LLM(config_file=str(config_file))
    runner = llm.engine_core.engine_core.model_executor.driver_worker
    assert runner.attn_backend is SdpaBackend
    assert type(runner.model) is GPT2LMHeadModel
    [output] = llm.generate([PROMPTS[0]], _greedy(6), use_tqdm=False)
    assert output.outputs[0].token_ids == transformers_greedy(gpt2, llm.get_tokenizer().encode(PROMPTS[0]), 6)


# ---- example_accel (pagedllm-example-platform) ---------------------------------


def test_example_platform_wins_auto_only_when_its_env_var_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm_example_platform.platform import ExampleAcceleratorPlatform

    assert type(resolve_platform("auto")) is CpuPlatform
    with pytest.raises(ConfigError, match="platform='example_accel'"):
        resolve_platform("example_accel")  # named, but not available without the variable

    monkeypatch.setenv(PLATFORM_ENV, "1")
    assert type(resolve_platform("auto")) is ExampleAcceleratorPlatform
    assert type(resolve_platform("cpu")) is CpuPlatform  # a named built-in is still honoured
    # The engine follows: its platform, its backend priority (sdpa first).
    parts = build_engine(EngineConfig.from_flat(model=str(cached_tiny_gpt2()), dtype="float32", num_kv_blocks=32))
    assert (parts.platform.name, parts.attn_selection.name) == ("example_accel", "sdpa")


class SecondAccelerator(CpuPlatform):
    name = "second_accel"


class SecondPlatformPlugin:
    @hookimpl
    def register_platforms(self, register: RegisterFn) -> None:
        register("second_accel", SecondAccelerator, device_type="cpu")


@pytest.fixture
def second_platform() -> Iterator[None]:
    pm = get_plugin_manager()
    pm.register(SecondPlatformPlugin(), name="second-platform")
    try:
        yield
    finally:
        pm.unregister(name="second-platform")


def test_two_available_out_of_tree_platforms_is_an_error_naming_both(
    second_platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert type(resolve_platform("auto")) is SecondAccelerator  # the only available one wins
    monkeypatch.setenv(PLATFORM_ENV, "1")
    with pytest.raises(ConfigError) as info:
        resolve_platform("auto")
    message = str(info.value)
    assert f"example_accel (from {_source('pagedllm-example-platform')})" in message
    assert "second_accel (from second-platform)" in message
    assert "2 are available" in message
    assert resolve_platform("example_accel").name == "example_accel"  # naming one resolves it


# ---- every process: `pagedllm serve --config FILE` -----------------------------


@pytest.mark.slow
def test_serve_with_config_file_runs_plugin_model_and_backend_in_the_engine_core(tmp_path: Path) -> None:
    gpt2 = cached_tiny_gpt2()
    config_file = _write_config(tmp_path / "engine.yaml", gpt2)
    offline = LLM(config_file=str(config_file)).generate([PROMPTS[0]], _greedy(8), use_tqdm=False)[0].outputs[0]

    # NOTE: the server and its spawned engine core are fresh interpreters: the
    # only way GPT-2 and sdpa reach them is the installed entry points.
    with start_server(gpt2, "--config", str(config_file), env={"PAGEDLLM_TRACE_PLUGINS": "1"}) as server:
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": gpt2.name, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0,
                  "ignore_eos": True},
            timeout=60.0,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        log = server.log()
    assert body["choices"][0]["text"] == offline.text
    assert body["usage"]["completion_tokens"] == len(offline.token_ids) == 8
    core_lines = [line for line in log.splitlines() if "[EngineCore pid=" in line]
    assert any("attention backend: sdpa" in line for line in core_lines), log
    # PAGEDLLM_TRACE_PLUGINS=1: the engine core itself called the hooks and got
    # the entry-point plugins' implementations.
    traced = [line for line in core_lines if "hook register_models(" in line]
    assert any(line.endswith("-> ['example_model']") for line in traced), log
