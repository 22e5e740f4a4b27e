"""Adapter identity outside the engine core: the router's prompt hashes
carry the adapter's content digest exactly as the engine's block hashes
do, so a prefix match for an adapter request counts only blocks of the
same digest (never the base model's, never another adapter's or another
version's under the same name); the HTTP router learns the digests from a
backend's /v1/models (asked again every few seconds); the conformance
kit's connector rule catches a connector that looks blocks up by tokens
alone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from pagedllm.core.config import EngineConfig
from pagedllm.core.kv_cache.events import BlockStored
from pagedllm.core.kv_cache.hashing import get_hash_fn, get_request_block_hasher
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.lora import LoRARef
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine.dp_router import ReplicaRouter
from pagedllm.engine.wire import EngineCoreOutputs
from pagedllm.entrypoints.router.app import build_app
from pagedllm.kv_connectors.cpu_offload import CpuOffloadConnector
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl
from pagedllm.routers.cache_mirror import PromptHasher, ReplicaCacheMirror
from pagedllm.testing.suite import ConformanceError, load_suite

BLOCK = 4
TOKENS = list(range(3, 3 + 3 * BLOCK + 1))  # three hittable blocks
SQL_V1 = LoRARef("sql", "a" * 64, "/adapters/sql")
SQL_V2 = LoRARef("sql", "b" * 64, "/adapters/sql")  # the same name reloaded with other weights
SQL_ALIAS = LoRARef("sql-alias", "a" * 64, "/adapters/other-copy")  # the same files under another name


def _engine_hashes(lora: LoRARef | None) -> list[bytes]:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_caching=True, hash_algo="sha256")
    request = Request("r", TOKENS, SamplingParams(max_tokens=2), None, lora=lora)
    manager.ensure_block_hashes(request)
    return list(request.block_hashes)


def test_the_router_hashes_an_adapter_prompt_as_the_engine_does() -> None:
    hasher = PromptHasher(BLOCK, "sha256")
    for lora in (None, SQL_V1, SQL_V2):
        assert hasher(TOKENS, None, None if lora is None else lora.digest) == _engine_hashes(lora)


def test_a_prefix_match_counts_only_blocks_of_the_same_digest() -> None:
    hasher = PromptHasher(BLOCK, "sha256")
    mirror = ReplicaCacheMirror()
    mirror.apply([BlockStored(hasher(TOKENS, None, SQL_V1.digest))])
    assert mirror.num_cached_blocks(hasher(TOKENS, None, SQL_V1.digest)) == 3
    assert mirror.num_cached_blocks(hasher(TOKENS, None, SQL_ALIAS.digest)) == 3  # two names, one content
    assert mirror.num_cached_blocks(hasher(TOKENS, None, None)) == 0  # the base model
    assert mirror.num_cached_blocks(hasher(TOKENS, None, SQL_V2.digest)) == 0  # new weights, same name


def test_the_data_parallel_router_reads_the_requests_adapter() -> None:
    router = ReplicaRouter(EngineConfig.from_flat(data_parallel_size=2, routing_policy="prefix_aware",
                                                  block_size=BLOCK))
    hasher = PromptHasher(BLOCK, "sha256")
    router.observe(1, EngineCoreOutputs([], None, 0, 0.0, [BlockStored(hasher(TOKENS, None, SQL_V1.digest))]))

    def request(request_id: str, lora: LoRARef | None) -> SimpleNamespace:
        # NOTE: EngineCoreRequest's fields; `lora` is the adapter the request carries.
        return SimpleNamespace(request_id=request_id, prompt_token_ids=TOKENS, cache_salt=None, lora=lora)

    assert router.route([request("adapter", SQL_V1)]) == 1  # where its blocks are
    router.route([request("base", None)])
    router.route([request("v2", SQL_V2)])
    predicted = {request_id: hit for book in router.books for request_id, hit in book.in_flight.items()}
    assert predicted == {"adapter": 3 * BLOCK, "base": 0, "v2": 0}


def test_the_http_router_learns_digests_from_a_backends_models(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.entrypoints.router import app as router_app

    digests = iter([SQL_V1.digest, SQL_V2.digest])
    asked: list[str] = []

    def backend(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        cards = [{"id": "base", "lora_digest": None}, {"id": "sql", "lora_digest": next(digests)}]
        return httpx.Response(200, json={"object": "list", "data": cards})

    app = build_app(["http://127.0.0.1:1"])
    router = app.state.router
    router.pool.client = httpx.AsyncClient(transport=httpx.MockTransport(backend))
    for replica in router.pool.backends:
        replica.alive, replica.error = True, None
    clock = [100.0]
    monkeypatch.setattr(router_app.time, "monotonic", lambda: clock[0])

    async def lookups() -> list[str | None]:
        found = [await router.lora_digest(model) for model in ("sql", "base", 7, "sql")]
        clock[0] += router_app.LORA_DIGESTS_TTL_S  # the name was reloaded meanwhile: asked again
        return [*found, await router.lora_digest("sql")]

    assert asyncio.run(lookups()) == [SQL_V1.digest, None, None, SQL_V1.digest, SQL_V2.digest]
    assert asked == ["/v1/models"] * 2


class TokenKeyedConnector(CpuOffloadConnector):
    """A connector that looks blocks up by tokens alone (the adapter
    ignored): what the kit's identity rule exists to catch."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        if request.lora is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        as_base = Request(request.request_id, list(request.prompt_token_ids), request.sampling_params, None)
        get_request_block_hasher(self.context.block_size, get_hash_fn("sha256"))(as_base)
        return super().get_num_new_matched_tokens(as_base, num_computed_tokens)


class TokenKeyedPlugin:
    @hookimpl
    def register_kv_connectors(self, register: RegisterFn) -> None:
        register("token_keyed", TokenKeyedConnector, roles=["both"])


def test_the_kit_catches_a_connector_serving_base_blocks_to_an_adapter() -> None:
    manager = get_plugin_manager()
    name = manager.register(TokenKeyedPlugin(), name="token-keyed-connector")
    try:
        with pytest.raises(ConformanceError) as failure:
            load_suite("kv_connector").get("adapter-blocks-kept-apart").check("token_keyed")
    finally:
        manager.unregister(name=name)
    # (cpu_offload itself keeps the rule: test_conformance_kit runs it on every connector.)
    assert failure.value.rule == "adapter-blocks-kept-apart" and "adapter-a" in str(failure.value)
