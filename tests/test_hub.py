"""Hub ids through huggingface_hub: `LLM(model="org/name")`, `--revision`,
`--tokenizer-revision`, `--download-dir`, the token, offline mode and the
start-up failures, against a fake hub on 127.0.0.1 (tests/helpers/fake_hub.py)
that records every request. Nothing here touches the internet."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.fake_hub import FakeHub
from huggingface_hub import constants

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig
from pagedllm.model_registry.hub import HubModelError
from pagedllm.model_registry.model_source import resolve_hub_models
from pagedllm.model_registry.tiny import get_default_model_dir

TINY_REPO = "org/tiny-hub"
# The files a load of the tiny model reads; the repo also holds decoys.
TINY_LOAD_FILES = {"config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                   "tokenizer.json", "tokenizer_config.json"}
DECOYS = {"original/consolidated.pth": b"decoy pth", "pytorch_model.bin": b"decoy bin", "consolidated.safetensors":
          b"decoy", "README.md": b"readme"}
PROMPTS = ["def fibonacci(n):", "The capital of France is"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SERVE_GUARD_S = 120


def small_repo(weights: bytes, tokenizer: bytes = b'{"v": 1}') -> dict[str, bytes]:
    """A repo the tests resolve but never load: what is requested is what counts."""
    return {"config.json": b'{"architectures": ["LlamaForCausalLM"]}', "tokenizer.json": tokenizer,
            "model.safetensors": weights, **DECOYS}


def point_hub_at(patch: pytest.MonkeyPatch, endpoint: str) -> None:
    """HF_ENDPOINT, as huggingface_hub read it at import."""
    patch.setattr(constants, "ENDPOINT", endpoint)
    patch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    """The fake hub, with huggingface_hub's import-time constants pointed at
    it (endpoint, cache, token file) and online."""
    fake = FakeHub().start()
    tiny_files = {path.name: path.read_bytes() for path in get_default_model_dir().iterdir()}
    fake.commit(TINY_REPO, {**tiny_files, **DECOYS})
    home = tmp_path_factory.mktemp("hf_home")
    with pytest.MonkeyPatch.context() as patch:
        point_hub_at(patch, fake.endpoint)
        patch.setattr(constants, "HF_HUB_OFFLINE", False)
        patch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        patch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
        patch.delenv("HF_TOKEN", raising=False)
        patch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        yield fake
    fake.stop()


@pytest.fixture(scope="module")
def hub_llm(hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    llm = LLM(model=TINY_REPO, download_dir=str(tmp_path_factory.mktemp("download")), num_kv_blocks=64)
    yield llm
    llm.engine_core.shutdown()


def _texts_and_tokens(llm: LLM) -> list[tuple[str, list[int]]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(out.outputs[0].text, list(out.outputs[0].token_ids)) for out in outputs]


def test_hub_id_generates_the_local_folders_greedy_tokens(hub_llm: LLM) -> None:
    from_hub = _texts_and_tokens(hub_llm)
    local = LLM(model=str(get_default_model_dir()), num_kv_blocks=64)
    try:
        assert from_hub == _texts_and_tokens(local)
    finally:
        local.engine_core.shutdown()
    assert hub_llm.config.server.served_model_name == TINY_REPO  # the hub id, not the snapshot folder's name


def test_only_the_files_the_load_reads_are_downloaded(hub: FakeHub, hub_llm: LLM) -> None:
    requested = {path for _, path in hub.file_requests(TINY_REPO)}
    assert requested == TINY_LOAD_FILES  # no original/, no .bin beside safetensors, no consolidated.*
    assert {path.name for path in Path(hub_llm.config.model.model).iterdir()} == TINY_LOAD_FILES


def test_every_file_comes_from_the_commit_pinned_before_the_branch_moves(hub: FakeHub, tmp_path: Path) -> None:
    first = hub.commit("org/moving", small_repo(b"weights of commit 1"))
    hub.after_revision_lookup("org/moving", lambda: hub.commit("org/moving", small_repo(b"weights of commit 2")))
    config = resolve_hub_models(EngineConfig.from_flat(model="org/moving", download_dir=str(tmp_path)))
    folder = Path(config.model.model)
    assert folder == tmp_path / "models--org--moving" / "snapshots" / first  # --download-dir is where files land
    assert (folder / "model.safetensors").read_bytes() == b"weights of commit 1"
    revisions = {revision for revision, _ in hub.file_requests("org/moving")}
    assert revisions == {first}
    assert hub.repos["org/moving"].refs["main"] != first  # the branch did move


def test_revision_and_tokenizer_revision_pick_their_commits(hub: FakeHub, tmp_path: Path) -> None:
    main = hub.commit("org/revs", small_repo(b"main weights", tokenizer=b'{"main": 1}'))
    tagged = hub.commit("org/revs", small_repo(b"v2 weights", tokenizer=b'{"v2": 1}'), ref="v2")
    config = resolve_hub_models(EngineConfig.from_flat(model="org/revs", revision="v2", download_dir=str(tmp_path)))
    assert Path(config.model.model).name == tagged
    assert (Path(config.model.model) / "model.safetensors").read_bytes() == b"v2 weights"
    assert config.model.tokenizer is None  # the model's own folder

    seen = len(hub.file_requests("org/revs"))
    config = resolve_hub_models(EngineConfig.from_flat(model="org/revs", tokenizer_revision="v2",
                                                       download_dir=str(tmp_path / "fresh")))
    assert Path(config.model.model).name == main
    assert Path(config.model.tokenizer or "").name == tagged
    assert (Path(config.model.tokenizer or "") / "tokenizer.json").read_bytes() == b'{"v2": 1}'
    at_tagged = {path for revision, path in hub.file_requests("org/revs")[seen:] if revision == tagged}
    assert at_tagged == {"config.json", "tokenizer.json"}  # the tokenizer's files only


def test_tokenizer_and_draft_model_hub_ids_resolve_to_folders(hub: FakeHub, tmp_path: Path) -> None:
    sha = hub.commit("org/draft", small_repo(b"draft weights"))
    config = resolve_hub_models(EngineConfig.from_flat(
        model=str(get_default_model_dir()), tokenizer="org/draft", speculative_method="draft_model",
        speculative_model="org/draft", download_dir=str(tmp_path)))
    assert config.model.model == str(get_default_model_dir())
    assert Path(config.speculative.model or "").name == sha
    assert Path(config.model.tokenizer or "").name == sha
    assert config.server.served_model_name is None  # a local model keeps its folder's name


def test_hf_token_is_sent_as_a_bearer_token(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.commit("org/gated-ok", small_repo(b"gated weights"), gated=True)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    resolve_hub_models(EngineConfig.from_flat(model="org/gated-ok", download_dir=str(tmp_path)))
    authorizations = {r.authorization for r in hub.requests if "org/gated-ok" in r.path}
    assert authorizations == {"Bearer hf_test_token"}


FAILURES = {  # name -> (flags, offline, what the message must say)
    "missing repo": (["org/no-such-repo"], False, ["'org/no-such-repo'", "no such repo", "HF_TOKEN"]),
    "missing revision": (["org/failing", "--revision", "nope"], False, ["'org/failing'", "'nope'", "--revision"]),
    "gated without token": (["org/gated"], False, ["'org/gated'", "gated", "HF_TOKEN", "hf auth login", "terms"]),
    "offline, not cached": (["org/failing"], True, ["'org/failing'", "not in the cache", "unset HF_HUB_OFFLINE"]),
}


@pytest.fixture(scope="module")
def failing_repos(hub: FakeHub) -> FakeHub:
    hub.commit("org/failing", small_repo(b"w"))
    hub.commit("org/gated", small_repo(b"w"), gated=True)
    return hub


@pytest.mark.parametrize("case", FAILURES)
def test_start_up_failure_names_the_repo_and_what_to_do(
    failing_repos: FakeHub, case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags, offline, needles = FAILURES[case]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    kwargs = {"model": flags[0], "download_dir": str(tmp_path), "revision": flags[2] if len(flags) > 2 else None}
    with pytest.raises(HubModelError) as raised:
        resolve_hub_models(EngineConfig.from_flat(**kwargs))
    for needle in needles:
        assert needle in str(raised.value)


@pytest.mark.parametrize("case", FAILURES)
def test_serve_exits_non_zero_without_a_traceback(failing_repos: FakeHub, case: str, tmp_path: Path) -> None:
    flags, offline, needles = FAILURES[case]
    env = {**os.environ, "HF_ENDPOINT": failing_repos.endpoint, "HF_HOME": str(tmp_path),
           "HF_HUB_OFFLINE": "1" if offline else "0"}
    env.pop("HF_TOKEN", None)
    done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *flags, "--port", "1"],
                          env=env, capture_output=True, text=True, timeout=SERVE_GUARD_S)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in done.stderr


def test_offline_loads_the_cached_snapshot_without_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           hub: FakeHub) -> None:
    own_hub = FakeHub().start()  # stopped below: a request would fail
    sha = own_hub.commit("org/cached", small_repo(b"cached weights"))
    point_hub_at(monkeypatch, own_hub.endpoint)
    online = resolve_hub_models(EngineConfig.from_flat(model="org/cached", download_dir=str(tmp_path)))
    own_hub.stop()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    offline = resolve_hub_models(EngineConfig.from_flat(model="org/cached", download_dir=str(tmp_path)))
    assert offline.model.model == online.model.model
    assert Path(offline.model.model or "").name == sha
    assert (Path(offline.model.model or "") / "model.safetensors").read_bytes() == b"cached weights"


REPO_LISTING = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer.model", "README.md",
                "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.safetensors",
                "original/consolidated.00.pth", "original/params.json"]
PT_WEIGHTS = ["pytorch_model.bin", "pytorch_model.bin.index.json"]
CONFIGS_AND_TOKENIZER = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer.model"]


@pytest.mark.parametrize(("load_format", "repo_files", "weights"), [
    ("auto", REPO_LISTING, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                            "model.safetensors.index.json"]),
    ("pt", REPO_LISTING, PT_WEIGHTS),
    ("auto", [n for n in REPO_LISTING if "safetensors" not in n], PT_WEIGHTS),
    ("dummy", REPO_LISTING, []),
])
def test_files_to_download_take_one_weight_format_and_no_other_copies(
    load_format: str, repo_files: list[str], weights: list[str]
) -> None:
    from pagedllm.model_registry.hub_files import files_to_download

    assert files_to_download(repo_files, load_format) == sorted(CONFIGS_AND_TOKENIZER + weights)
    assert files_to_download(repo_files, load_format, tokenizer_only=True) == CONFIGS_AND_TOKENIZER


def test_an_unreachable_hub_is_a_start_up_error_naming_the_repo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hub: FakeHub
) -> None:
    """The network fails (nothing listens at HF_ENDPOINT) with HF_HUB_OFFLINE
    unset: the same kind of message as the other failures, no raw httpx error."""
    own_hub = FakeHub().start()
    endpoint = own_hub.endpoint
    own_hub.stop()  # the port is closed now: every request fails to connect
    point_hub_at(monkeypatch, endpoint)
    with pytest.raises(HubModelError, match=r"'org/anything'.*cannot be reached.*HF_HUB_OFFLINE=1"):
        resolve_hub_models(EngineConfig.from_flat(model="org/anything", download_dir=str(tmp_path)))
