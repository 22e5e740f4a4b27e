"""LoRA adapters through the HTTP server: --lora-modules at start-up, vLLM's
runtime load/unload routes, resolver plugins, and the adapter's LoRARef
(its content digest) reaching the engine. The app runs in-process over a
recording engine stand-in (the HTTP layer alone), which sees the
`lora_request` each request carries; the digests are the real loader's,
over random PEFT adapters of a tiny base checkpoint."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from helpers.fake_engine import FakeEngine
from helpers.lora_adapters import write_peft_adapter
from helpers.server import free_port
from safetensors.torch import load_file, save_file

from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.lora_models import LoRAModels, load_lora_resolvers, parse_lora_modules
from pagedllm.entrypoints.openai.request_pool import RequestWorkerPool
from pagedllm.lora.adapter import base_model_modules, load_lora_adapter
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.resolver import FilesystemResolver, LoRAResolver
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl
from pagedllm.testing import run_suite
from pagedllm.testing.checkpoints import config_json, save_random_checkpoint

API_KEY = "lora-key"
KEY = {"Authorization": f"Bearer {API_KEY}"}
MAX_RANK = 8


class RecordingEngine(FakeEngine):
    """FakeEngine that keeps the keyword arguments of every generate() call."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.calls: list[dict[str, Any]] = []

    async def generate(self, prompt_token_ids: list[int], params: Any, request_id: str,
                       **kwargs: Any) -> AsyncGenerator[Any, None]:
        self.calls.append(kwargs)
        async for output in super().generate(prompt_token_ids, params, request_id, **kwargs):
            yield output


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_checkpoint(config_json("LlamaForCausalLM"), tmp_path_factory.mktemp("lora-server") / "base")


@pytest.fixture(scope="module")
def adapters(base: Path) -> dict[str, Path]:
    """Good adapters, and one folder per way an adapter can be bad."""
    root = base.parent
    good = {
        "sql": write_peft_adapter(base, root / "sql", rank=4, target_modules=["q_proj", "v_proj"], seed=1),
        "chat": write_peft_adapter(base, root / "chat", rank=8, target_modules=["o_proj", "down_proj"], seed=2),
    }
    bad = {
        "too_wide": write_peft_adapter(base, root / "too_wide", rank=MAX_RANK * 2, target_modules=["q_proj"], seed=3),
        "dora": _copy(good["sql"], root / "dora", config={"use_dora": True}),
        "bin_only": _copy(good["sql"], root / "bin_only"),
        "lacks_module": _copy(good["sql"], root / "lacks_module"),
        "other_base": _copy(good["sql"], root / "other_base"),
    }
    (bad["bin_only"] / "adapter_model.safetensors").rename(bad["bin_only"] / "adapter_model.bin")
    _edit_tensors(bad["lacks_module"], lambda key, t: (key.replace("q_proj", "rotary_proj"), t))
    _edit_tensors(bad["other_base"], lambda key, t: (key, t.repeat(1, 2) if "lora_A" in key else t))
    return {**good, **bad}


def _copy(adapter: Path, to: Path, config: dict[str, Any] | None = None) -> Path:
    shutil.copytree(adapter, to)
    if config is not None:
        raw = json.loads((to / "adapter_config.json").read_text())
        (to / "adapter_config.json").write_text(json.dumps({**raw, **config}))
    return to


def _edit_tensors(adapter: Path, edit: Any) -> None:
    file = adapter / "adapter_model.safetensors"
    tensors = dict(edit(key, tensor) for key, tensor in load_file(file).items())
    save_file({key: tensor.contiguous() for key, tensor in tensors.items()}, file)


def _digest(base: Path, adapter: Path, name: str) -> str:
    loaded = load_lora_adapter(adapter, name=name, max_rank=MAX_RANK, max_bytes=1 << 30,
                               base_modules=base_model_modules(base))
    return loaded.ref.digest


def _config(**lora: Any) -> EngineConfig:
    return EngineConfig.load(server={"api_key": API_KEY}, lora={"enable_lora": True, "max_lora_rank": MAX_RANK, **lora})


def _app(base: Path, config: EngineConfig, resolvers: list[Any] | None = None) -> tuple[Any, RecordingEngine]:
    """build_app over a RecordingEngine, with config's --lora-modules loaded."""
    engine = RecordingEngine(config)
    pool = RequestWorkerPool(2)
    lora_models = LoRAModels(config.lora, [engine.model_name], pool.run,
                             register=LoRARegistry(str(base), config.lora).register, resolvers=resolvers)
    asyncio.run(lora_models.load_startup_modules())
    return build_app(engine, config, lora_models), engine  # type: ignore[arg-type]


class Client:
    """Synchronous calls into an in-process app (one event loop per call)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        async def call() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.request(method, path, json=body, headers=KEY if headers is None else headers)

        return asyncio.run(call())

    def complete(self, model: str, **fields: Any) -> httpx.Response:
        return self.request("POST", "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 2, **fields})

    def models(self) -> dict[str, dict[str, Any]]:
        return {card["id"]: card for card in self.request("GET", "/v1/models").json()["data"]}


@pytest.fixture(scope="module")
def served(base: Path, adapters: dict[str, Path]) -> tuple[Client, RecordingEngine]:
    spec = json.dumps({"name": "chat", "path": str(adapters["chat"]), "base_model_name": "llama-base"})
    config = _config(lora_modules=[f"sql={adapters['sql']}", spec], allow_runtime_lora_updating=True)
    app, engine = _app(base, config)
    return Client(app), engine


def test_lora_modules_parse_both_forms_and_name_what_is_wrong() -> None:
    spec = '{"name": "b", "path": "/p/b", "base_model_name": "base"}'
    lora = _config(lora_modules=["a=/p/a=x", spec]).lora
    assert [(m.name, m.path, m.base_model_name) for m in parse_lora_modules(lora)] == [
        ("a", "/p/a=x", None), ("b", "/p/b", "base")
    ]
    for items in (["no-equals"], ["=/p"], ['{"name": "x"}'], ["{not json"], ["a=/p", "a=/q"]):
        with pytest.raises(ConfigError) as caught:
            parse_lora_modules(_config(lora_modules=items).lora)
        assert caught.value.key == "lora.lora_modules"
    off = EngineConfig.load(lora={"lora_modules": ["a=/p"]}).lora
    with pytest.raises(ConfigError, match="--enable-lora"):
        parse_lora_modules(off)


def test_models_list_each_adapter_with_parent_path_and_digest(
    served: tuple[Client, RecordingEngine], base: Path, adapters: dict[str, Path]
) -> None:
    models = served[0].models()
    assert models["sql"]["parent"] == "fake" and models["chat"]["parent"] == "llama-base"
    assert models["sql"]["root"] == str(adapters["sql"].resolve())
    assert models["sql"]["lora_digest"] == _digest(base, adapters["sql"], "sql")
    assert models["fake"]["lora_digest"] is None and models["fake"]["parent"] is None


def test_request_naming_an_adapter_reaches_the_engine_as_its_lora_request(
    served: tuple[Client, RecordingEngine], base: Path, adapters: dict[str, Path]
) -> None:
    client, engine = served
    engine.calls.clear()
    response = client.complete("sql")
    assert response.status_code == 200 and response.json()["model"] == "sql"
    chat = client.request("POST", "/v1/chat/completions", {
        "model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
    })
    assert chat.status_code == 200 and chat.json()["model"] == "chat"
    stream = client.complete("sql", stream=True)
    assert stream.status_code == 200 and '"model":"sql"' in stream.text.replace(" ", "")
    assert client.request("POST", "/tokenize", {"model": "sql", "prompt": "hi"}).status_code == 200
    base_response = client.complete("fake")
    assert base_response.json()["model"] == "fake"
    sql = LoRARequest("sql", 1, str(adapters["sql"].resolve()), "fake")
    assert [call.get("lora_request") for call in engine.calls] == [
        sql, LoRARequest("chat", 2, str(adapters["chat"].resolve()), "llama-base"), sql, None
    ]


def test_unknown_model_is_404(served: tuple[Client, RecordingEngine]) -> None:
    response = served[0].complete("no-such-adapter")
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_runtime_load_use_unload_and_reload_other_weights(
    served: tuple[Client, RecordingEngine], base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    client, engine = served
    body = {"lora_name": "tmp", "lora_path": str(adapters["chat"])}
    loaded = client.request("POST", "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    again = client.request("POST", "/v1/load_lora_adapter", body)
    assert again.status_code == 200 and "already loaded" in again.text
    other = client.request("POST", "/v1/load_lora_adapter", {"lora_name": "tmp", "lora_path": str(adapters["sql"])})
    assert other.status_code == 400 and other.json()["error"]["param"] == "lora_name"
    engine.calls.clear()
    assert client.complete("tmp").status_code == 200
    assert engine.calls[0]["lora_request"].lora_path == str(adapters["chat"].resolve())
    first_digest = client.models()["tmp"]["lora_digest"]
    assert first_digest == _digest(base, adapters["chat"], "tmp")
    assert client.request("POST", "/v1/unload_lora_adapter", {"lora_name": "tmp"}).status_code == 200
    assert client.complete("tmp").status_code == 404
    missing = client.request("POST", "/v1/unload_lora_adapter", {"lora_name": "tmp"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"
    # Other weights under the same name: another digest, so another KV identity.
    retrained = write_peft_adapter(base, tmp_path / "retrained", rank=8, target_modules=["o_proj", "down_proj"],
                                   seed=9)
    assert client.request("POST", "/v1/load_lora_adapter",
                          {"lora_name": "tmp", "lora_path": str(retrained)}).status_code == 200
    assert client.complete("tmp").status_code == 200
    assert engine.calls[-1]["lora_request"].lora_path == str(retrained.resolve())
    assert client.models()["tmp"]["lora_digest"] not in (first_digest, None)
    client.request("POST", "/v1/unload_lora_adapter", {"lora_name": "tmp"})


BAD_ADAPTERS = [
    ("missing", "lora_path"), ("bin_only", "lora_path"), ("too_wide", "r"), ("lacks_module", "target_modules"),
    ("other_base", "weights"), ("dora", "use_dora"),
]


@pytest.mark.parametrize(("adapter", "param"), BAD_ADAPTERS)
def test_bad_adapter_is_a_400_naming_it_and_changes_nothing(
    served: tuple[Client, RecordingEngine], adapters: dict[str, Path], tmp_path: Path, adapter: str, param: str
) -> None:
    client = served[0]
    before = client.models()
    path = adapters.get(adapter, tmp_path / "missing")
    response = client.request("POST", "/v1/load_lora_adapter", {"lora_name": f"bad-{adapter}", "lora_path": str(path)})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert client.models() == before


def test_too_big_adapter_is_a_400(base: Path, adapters: dict[str, Path]) -> None:
    client = Client(_app(base, _config(allow_runtime_lora_updating=True, max_lora_bytes=1024))[0])
    response = client.request("POST", "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["sql"])})
    assert response.status_code == 400 and "at most 1024" in response.json()["error"]["message"]


def test_bad_startup_adapter_fails_naming_it(base: Path, adapters: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as caught:
        _app(base, _config(lora_modules=[f"ok={adapters['sql']}", f"wide={adapters['too_wide']}"]))
    assert caught.value.key == "lora.lora_modules[wide]" and "max_lora_rank" in str(caught.value)


def test_runtime_routes_are_404_unless_allowed_and_need_the_key(
    base: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"lora_name": "x", "lora_path": str(adapters["sql"])}
    closed = Client(_app(base, _config())[0])
    assert closed.request("POST", "/v1/load_lora_adapter", body).status_code == 404
    assert closed.request("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 404
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    opened = Client(_app(base, _config())[0])
    assert opened.request("POST", "/v1/load_lora_adapter", body, headers={}).status_code == 401
    assert opened.request("POST", "/v1/load_lora_adapter", body).status_code == 200


# ------------------------------------------------------------------ resolvers

class FolderResolver(LoRAResolver):
    """Resolves every name to the folder the test put in `folders`."""

    folders: ClassVar[dict[str, str]] = {}
    asked: ClassVar[list[tuple[str, str]]] = []

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> str | None:
        self.asked.append((base_model_name, lora_name))
        if lora_name == "raises":
            raise RuntimeError("the artifact store is down")
        return self.folders.get(lora_name)


class ResolverTestPlugin:
    @hookimpl
    def register_lora_resolvers(self, register: RegisterFn) -> None:
        register("test-folders", FolderResolver)


@pytest.fixture
def resolver_plugin() -> Iterator[None]:
    pm = get_plugin_manager()
    name = pm.register(ResolverTestPlugin(), name="lora-resolver-test-plugin")
    yield
    pm.unregister(name=name)


def test_resolver_plugin_finds_an_unknown_name_on_first_use(
    resolver_plugin: None, base: Path, adapters: dict[str, Path]
) -> None:
    config = _config(allow_runtime_lora_updating=True, lora_resolvers=["test-folders"])
    FolderResolver.folders = {"found": str(adapters["sql"])}
    FolderResolver.asked = []
    app, engine = _app(base, config, resolvers=load_lora_resolvers(config.lora))
    client = Client(app)
    assert client.complete("found").status_code == 200
    assert engine.calls[-1]["lora_request"].lora_path == str(adapters["sql"].resolve())
    assert client.models()["found"]["lora_digest"] == _digest(base, adapters["sql"], "found")
    assert client.complete("found").status_code == 200
    assert FolderResolver.asked == [("fake", "found")]  # later requests find it loaded
    assert client.complete("nowhere").status_code == 404
    assert client.complete("raises").status_code == 404  # a failing resolver knows nothing
    assert "found" in client.models()


def test_filesystem_resolver_serves_its_folder_only(adapters: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copytree(adapters["sql"], cache / "sql")
    (cache / "escape").symlink_to(adapters["chat"])
    resolver = FilesystemResolver(_config(lora_resolver_cache_dir=str(cache)).lora)
    assert resolver.resolve_lora("base", "sql") == str((cache / "sql").resolve())
    for name in ("chat", "escape", "..", "../chat", "", "sql/../sql"):
        assert resolver.resolve_lora("base", name) is None, name
    assert run_suite("lora_resolver", "filesystem") == []


def test_serve_exits_1_naming_a_bad_startup_adapter(base: Path, adapters: dict[str, Path]) -> None:
    """`pagedllm serve` itself: the adapter is checked in the API process
    after the engine core started; the server stops both and exits 1.
    Adapters without --enable-lora fail before the engine core starts."""
    def serve(*flags: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(base), "--num-kv-blocks", "16",
                   "--max-lora-rank", str(MAX_RANK), "--host", "127.0.0.1", "--port", str(free_port()), *flags]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)

    modules = ["--lora-modules", f"ok={adapters['sql']}", f"wide={adapters['too_wide']}"]
    bad = serve("--enable-lora", *modules, timeout_s=120)
    assert bad.returncode == 1
    assert "lora.lora_modules[wide]" in bad.stderr and "max_lora_rank=8" in bad.stderr
    unflagged = serve(*modules, timeout_s=60)
    assert unflagged.returncode == 1 and "adapters need --enable-lora" in unflagged.stderr
