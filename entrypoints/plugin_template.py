"""`pagedllm plugins new NAME --kind attention|model|platform`: a package skeleton.

The generated package is the smallest real plugin of its kind, shaped like
the packages in examples/plugins: a pyproject.toml with the ``pagedllm.plugins``
entry point, a module with the ``@hookimpl`` registration and the declared
plugin API range, a working implementation to start from (the attention kind
subclasses torch_native, the model kind the built-in Llama under a new
architecture name, the platform kind an env-var-gated CPU platform), a README,
and a test that passes once the package is pip-installed.
"""

from __future__ import annotations

import re
from pathlib import Path

from pagedllm.core.errors import ConfigError
from pagedllm.plugins import API_VERSION

KINDS = ("attention", "model", "platform")
_DIST_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9._-]*$")


def _api_range() -> str:
    major = int(API_VERSION.split(".")[0])
    return f">={major}.0,<{major + 1}"


PYPROJECT = '''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "__DIST__"
version = "0.1.0"
description = "A pagedllm plugin: __DESCRIPTION__"
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["pagedllm"]

[project.optional-dependencies]
test = ["pytest>=8"]

# pagedllm loads this module, in every process it starts, and calls its hooks.
[project.entry-points."pagedllm.plugins"]
__MODULE__ = "__MODULE__"

[tool.setuptools]
packages = ["__MODULE__"]

[tool.pytest.ini_options]
addopts = "--import-mode=importlib -p no:cacheprovider"
testpaths = ["tests"]
'''

INIT_HEADER = '''\
"""__DIST__: __DESCRIPTION__.

The ``pagedllm.plugins`` entry point names this module. NOTE: keep it cheap:
register "module:Attr" strings, so the implementation is imported only when
pagedllm selects it.
"""

from __future__ import annotations

from pagedllm.plugins import RegisterFn, hookimpl

# The pagedllm plugin API versions this plugin supports (pagedllm.plugins.API_VERSION);
# an incompatible pagedllm skips the plugin and says why.
PAGEDLLM_API_VERSION = "__API_RANGE__"

'''

ATTENTION_INIT = '''\
BACKEND_NAME = "__SHORT__"


@hookimpl
def register_attention_backends(register: RegisterFn) -> None:
    register(
        BACKEND_NAME,
        "__MODULE__.backend:__CAMEL__Backend",
        # What the selector checks before importing anything; tighten these to
        # what your kernel really supports (min_capability, head_sizes, ...).
        device_types=["cpu", "cuda"],
        dtypes=["float32", "float16", "bfloat16"],
        supports_sliding_window=True,
    )
'''

ATTENTION_IMPL = '''\
"""The __SHORT__ attention backend. Starts as pagedllm's torch_native: replace
``forward`` with your kernel and keep the contract of
pagedllm.attention_backends.base.AttentionImpl (write the new K/V at
``slot_mapping`` first, then attend causally on absolute positions)."""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedllm.attention_backends.base import AttentionImpl, AttentionMetadata
from pagedllm.attention_backends.torch_native import TorchNativeAttentionImpl, TorchNativeBackend


class __CAMEL__AttentionImpl(TorchNativeAttentionImpl):
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_size]
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # get_kv_cache_shape(...)
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_size]
        return super().forward(query, key, value, kv_cache, attn_metadata)


class __CAMEL__Backend(TorchNativeBackend):
    name: ClassVar[str] = "__SHORT__"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return __CAMEL__AttentionImpl
'''

ATTENTION_TEST = '''\
"""__DIST__ is found through its entry point and computes what torch_native does."""

from __future__ import annotations

import torch

from pagedllm.attention_backends.base import AttentionMetadata
from pagedllm.attention_backends.selector import select_attention_backend
from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.plugins import PluginManager

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 16, 4


def loaded_plugin_manager() -> PluginManager:
    pm = PluginManager()
    pm.load()
    assert [e for e in pm.load_errors if e.plugin == "__MODULE__"] == []
    return pm


def one_prompt_batch(num_tokens: int) -> AttentionMetadata:
    block_table = torch.tensor([[3, 0, 2, 1]], dtype=torch.int32)
    positions = torch.arange(num_tokens)
    slot_mapping = block_table[0, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    starts = torch.tensor([0, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    return AttentionMetadata(num_tokens, 1, num_tokens, num_tokens, starts, seq_lens, block_table,
                             slot_mapping, starts, seq_lens)


def attend(backend: type, metadata: AttentionMetadata) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    shape = metadata.num_actual_tokens, NUM_HEADS, HEAD_SIZE
    q = torch.randn(shape, generator=generator)
    k, v = (torch.randn(shape[0], NUM_KV_HEADS, HEAD_SIZE, generator=generator) for _ in range(2))
    kv_cache = torch.zeros(backend.get_kv_cache_shape(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE))
    impl = backend.get_impl_cls()(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS)
    return impl.forward(q, k, v, kv_cache, backend.build_metadata(metadata, BLOCK_SIZE))


def test_backend_is_registered_through_the_entry_point() -> None:
    pm = loaded_plugin_manager()
    assert pm.registry("attention_backend").get("__SHORT__").source == "__DIST__ 0.1.0"


def test_backend_is_selected_by_name_and_matches_torch_native() -> None:
    from __MODULE__.backend import __CAMEL__Backend

    selection = select_attention_backend(
        CpuPlatform(), "__SHORT__", head_size=HEAD_SIZE, dtype=torch.float32, block_size=BLOCK_SIZE,
        plugin_manager=loaded_plugin_manager(),
    )
    assert selection.backend_cls is __CAMEL__Backend
    metadata = one_prompt_batch(10)
    torch.testing.assert_close(attend(__CAMEL__Backend, metadata), attend(TorchNativeBackend, metadata))
'''

MODEL_INIT = '''\
ARCHITECTURE = "__CAMEL__ForCausalLM"


@hookimpl
def register_models(register: RegisterFn) -> None:
    # A config.json with "architectures": ["__CAMEL__ForCausalLM"] loads this class.
    register(ARCHITECTURE, "__MODULE__.model:__CAMEL__ForCausalLM")
'''

MODEL_IMPL = '''\
"""__CAMEL__ForCausalLM. Starts as pagedllm's built-in Llama under a new
architecture name: change the modules. The contract is
pagedllm.model_registry.interface.ModelForCausalLM (built as
``__init__(hf_config, attn_backend, dtype)``; ``forward``, ``compute_logits``,
``load_weights``, ``get_attention_layers``); Llama implements it, see
pagedllm/model_registry/models/llama.py."""

from __future__ import annotations

from pagedllm.model_registry.models.llama import LlamaForCausalLM


class __CAMEL__ForCausalLM(LlamaForCausalLM):
    pass
'''

MODEL_TEST = '''\
"""__DIST__: a checkpoint naming __CAMEL__ForCausalLM loads through the entry
point, and greedy tokens equal transformers' Llama on the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model_registry.tiny import get_tokenizer_dir
from pagedllm.plugins import PluginManager


def save_checkpoint(path: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer_dir = Path(get_tokenizer_dir())
    for item in tokenizer_dir.iterdir():
        if item.is_file():
            shutil.copy(item, path / item.name)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    # save_pretrained writes the saving class's name: point config.json at ours.
    config_file = path / "config.json"
    config_json = json.loads(config_file.read_text())
    config_json["architectures"] = ["__CAMEL__ForCausalLM"]
    config_file.write_text(json.dumps(config_json))
    return path


def transformers_greedy(path: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(max_tokens):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def test_architecture_is_registered_through_the_entry_point() -> None:
    pm = PluginManager()
    pm.load()
    assert [e for e in pm.load_errors if e.plugin == "__MODULE__"] == []
    assert pm.registry("model").get("__CAMEL__ForCausalLM").source == "__DIST__ 0.1.0"


def test_greedy_tokens_equal_transformers(tmp_path: Path) -> None:
    from __MODULE__.model import __CAMEL__ForCausalLM

    path = save_checkpoint(tmp_path)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=32)
    assert type(llm.engine_core.engine_core.model_executor.driver_worker.model) is __CAMEL__ForCausalLM
    prompt = "def main():"
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    prompt_ids = llm.get_tokenizer().encode(prompt)
    assert output.outputs[0].token_ids == transformers_greedy(path, prompt_ids, 6)
'''

PLATFORM_INIT = '''\
PLATFORM_NAME = "__SHORT__"
ENABLE_ENV = "__ENV__"


@hookimpl
def register_platforms(register: RegisterFn) -> None:
    register(PLATFORM_NAME, "__MODULE__.platform:__CAMEL__Platform", device_type="cpu")
'''

PLATFORM_IMPL = '''\
"""The __SHORT__ platform. Starts as the CPU, available only when __ENV__=1:
probe your device in ``is_available`` and list your attention backends, best
first, in ``get_attention_backend_priority``. With ``device.platform: auto``
an available out-of-tree platform wins over the built-in cpu/cuda."""

from __future__ import annotations

import os

from pagedllm.platforms.cpu import CpuPlatform
from __MODULE__ import ENABLE_ENV, PLATFORM_NAME


class __CAMEL__Platform(CpuPlatform):
    name = PLATFORM_NAME
    device_type = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return os.environ.get(ENABLE_ENV, "") not in ("", "0")

    def get_device_name(self) -> str:
        return "__SHORT__ (CPU stand-in)"

    def get_attention_backend_priority(self) -> list[str]:
        return ["torch_native"]
'''

PLATFORM_TEST = '''\
"""__DIST__ is found through its entry point and wins platform=auto only
while __ENV__ is set."""

from __future__ import annotations

import pytest

from pagedllm.platforms import resolve_platform
from pagedllm.plugins import PluginManager


@pytest.fixture
def pm() -> PluginManager:
    manager = PluginManager()
    manager.load()
    assert [e for e in manager.load_errors if e.plugin == "__MODULE__"] == []
    return manager


def test_platform_is_registered_through_the_entry_point(pm: PluginManager) -> None:
    assert pm.registry("platform").get("__SHORT__").source == "__DIST__ 0.1.0"


def test_auto_picks_the_platform_only_when_enabled(pm: PluginManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("__ENV__", raising=False)
    assert resolve_platform("auto", pm).name != "__SHORT__"
    monkeypatch.setenv("__ENV__", "1")
    platform = resolve_platform("auto", pm)
    assert platform.name == "__SHORT__"
    assert platform.get_attention_backend_priority() == ["torch_native"]
'''

README = '''\
# __DIST__

A pagedllm plugin: __DESCRIPTION__. Generated by
`pagedllm plugins new __DIST__ --kind __KIND__`.

```bash
pip install -e .
pagedllm plugins list        # __KIND_LABEL__ __COMPONENT__ from __DIST__ 0.1.0
python -m pytest -q          # its own test
```

__USAGE__

How it plugs in: `pyproject.toml` declares the entry point
`[project.entry-points."pagedllm.plugins"] __MODULE__ = "__MODULE__"`; pagedllm
imports `__MODULE__` in every process it starts and calls its `@hookimpl`
functions. `PAGEDLLM_API_VERSION = "__API_RANGE__"` in `__MODULE__/__init__.py`
says which pagedllm plugin API versions it supports. See pagedllm's
docs/plugins.md for every hook.
'''

_KIND_FILES: dict[str, dict[str, str]] = {
    "attention": {"init": ATTENTION_INIT, "impl": ATTENTION_IMPL, "impl_file": "backend.py", "test": ATTENTION_TEST},
    "model": {"init": MODEL_INIT, "impl": MODEL_IMPL, "impl_file": "model.py", "test": MODEL_TEST},
    "platform": {"init": PLATFORM_INIT, "impl": PLATFORM_IMPL, "impl_file": "platform.py", "test": PLATFORM_TEST},
}


def _substitutions(name: str, kind: str) -> dict[str, str]:
    module = re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_").lower()
    short = module.removeprefix("pagedllm_") or module
    camel = "".join(part.capitalize() for part in short.split("_"))
    env = f"{module.upper()}_ENABLED"
    descriptions = {
        "attention": f"the {short} attention backend",
        "model": f"the {camel}ForCausalLM model architecture",
        "platform": f"the {short} platform",
    }
    usage = {
        "attention": f"Select it with `attention_backend: {short}` (config file, `device` section) or\n"
        f"`LLM(model=..., attention_backend=\"{short}\")`.",
        "model": f"Any model folder whose config.json says `\"architectures\": [\"{camel}ForCausalLM\"]` now loads.",
        "platform": f"`{env}=1 pagedllm env` shows platform `{short}`; `platform: auto` picks it\n"
        "while the variable is set (an available out-of-tree platform wins over cpu/cuda).",
    }
    components = {"attention": short, "model": f"{camel}ForCausalLM", "platform": short}
    kind_labels = {"attention": "attention_backend", "model": "model", "platform": "platform"}
    return {
        "__DIST__": name,
        "__MODULE__": module,
        "__SHORT__": short,
        "__CAMEL__": camel,
        "__ENV__": env,
        "__KIND__": kind,
        "__KIND_LABEL__": kind_labels[kind],
        "__COMPONENT__": components[kind],
        "__DESCRIPTION__": descriptions[kind],
        "__USAGE__": usage[kind],
        "__API_RANGE__": _api_range(),
    }


def _fill(template: str, substitutions: dict[str, str]) -> str:
    # Longest keys first: "__DIST__" must not eat part of another placeholder.
    for key in sorted(substitutions, key=len, reverse=True):
        template = template.replace(key, substitutions[key])
    return template


def create_plugin_package(name: str, kind: str, parent_dir: str | Path = ".") -> Path:
    """Write ``parent_dir/name`` and return it; ConfigError for a bad name or
    kind, or when the folder already exists and is not empty."""
    if kind not in KINDS:
        raise ConfigError("kind", kind, ", ".join(KINDS))
    if not _DIST_NAME.match(name):
        raise ConfigError("name", name, "a distribution name: a letter, then letters, digits, '-', '_' or '.'")
    subs = _substitutions(name, kind)
    if not subs["__MODULE__"].isidentifier():
        raise ConfigError("name", name, "a name whose module form is a Python identifier")
    package_dir = Path(parent_dir) / name
    if package_dir.exists() and any(package_dir.iterdir()):
        raise ConfigError("dir", str(package_dir), "a folder that does not exist yet or is empty")

    files = _KIND_FILES[kind]
    module_dir = package_dir / subs["__MODULE__"]
    (package_dir / "tests").mkdir(parents=True, exist_ok=True)
    module_dir.mkdir(exist_ok=True)
    outputs = {
        package_dir / "pyproject.toml": PYPROJECT,
        package_dir / "README.md": README,
        module_dir / "__init__.py": INIT_HEADER + files["init"],
        module_dir / files["impl_file"]: files["impl"],
        package_dir / "tests" / f"test_{subs['__MODULE__']}.py": files["test"],
    }
    for path, template in outputs.items():
        path.write_text(_fill(template, subs))
    return package_dir


__all__ = ["KINDS", "create_plugin_package"]
