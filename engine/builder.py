"""The builder: the one place that turns an EngineConfig into engine parts.

    plugins -> platform -> model facts (path, HF config, dtype, heads)
    -> attention backend -> model -> KV cache size -> KV caches
    -> drafter, KV connector, decode graphs -> ModelRunner
    -> KVCacheManager, grammar manager, Scheduler -> EngineCore

Every implementation comes from a plugin registry by the name the config
gives; each constructor receives its parts, and nothing is set on a built
object afterwards. `build_engine_core(config)` is what clients, tests and
benchmarks call; `build_engine(config)` also returns what was chosen on the way
(the READY message and `pagedllm env` report it).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from pagedllm.attention_backends.selector import select_attention_backend
from pagedllm.core.engine import EngineCore
from pagedllm.core.errors import ConfigError
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.model_source import resolve_model_path
from pagedllm.engine.tokenizer import config_eos_token_id
from pagedllm.kv_connectors.base import KVConnectorContext, model_fingerprint
from pagedllm.model_registry.loader import get_architecture, load_hf_config, load_model
from pagedllm.platforms import resolve_platform
from pagedllm.plugins import get_plugin_manager
from pagedllm.spec_decode.interface import DrafterContext
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.worker.compile import compile_outside_attention
from pagedllm.worker.decode_graphs import DecodeGraphRunner, default_graph_sizes
from pagedllm.worker.kv_cache import allocate_kv_caches
from pagedllm.worker.memory_profiler import profile_run
from pagedllm.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.attention_backends.selector import BackendSelection
    from pagedllm.core.config import EngineConfig, SpeculativeConfig
    from pagedllm.kv_connectors.base import KVConnectorBase
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.platforms.interface import Platform
    from pagedllm.plugins.manager import PluginManager
    from pagedllm.spec_decode.interface import Drafter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFacts:
    """What the model's config says, read before anything is built from it."""

    path: str  # the model folder (a model source's name resolved) or hub id
    hf_config: PretrainedConfig
    architecture: str
    dtype: torch.dtype
    head_size: int
    num_kv_heads: int
    sliding_window: int | None

    @property
    def position_limit(self) -> int | None:
        return getattr(self.hf_config, "max_position_embeddings", None)


@dataclass(frozen=True)
class EngineParts:
    """The built engine core and what the builder chose on the way."""

    engine_core: EngineCore
    model: ModelFacts
    platform: Platform
    device: torch.device
    attn_selection: BackendSelection
    model_runner: ModelRunner
    num_blocks: int
    kv_connector: KVConnectorBase | None


@dataclass(frozen=True)
class _Target:
    """The loaded target model and what every later step builds around it."""

    config: EngineConfig
    platform: Platform
    device: torch.device
    facts: ModelFacts
    attn_backend: type[AttentionBackend]
    model: ModelForCausalLM
    # config.speculative with its model name resolved to a folder: drafters
    # get a folder, whatever name the config gave.
    speculative: SpeculativeConfig

    @property
    def num_layers(self) -> int:
        return len(self.model.get_attention_layers())


def build_engine_core(config: EngineConfig) -> EngineCore:
    """The engine core `config` describes (clients, tests, benchmarks)."""
    return build_engine(config).engine_core


def build_engine(config: EngineConfig) -> EngineParts:
    """Load the plugins `config` enables, choose and build every part, and
    start the engine core (the `on_engine_start` hook runs last)."""
    plugin_manager = get_plugin_manager()
    plugins = config.plugins
    plugin_manager.load(enabled=plugins.enabled, disabled=plugins.disabled, strict=plugins.strict)
    platform = resolve_platform(config.device.platform, plugin_manager)
    facts = read_model_facts(config, platform, plugin_manager)
    attn_selection = select_attention_backend(
        platform,
        config.device.attention_backend,
        head_size=facts.head_size,
        dtype=facts.dtype,
        block_size=config.cache.block_size,
        sliding_window=facts.sliding_window,
        plugin_manager=plugin_manager,
    )
    logger.info("attention backend: %s (rejected: %s)", attn_selection.name, attn_selection.rejected)
    target = _load_target(config, platform, facts, attn_selection.backend_cls, plugin_manager)
    method = config.speculative.method
    drafter_cls = None if method is None else plugin_manager.drafters.load(method)
    num_blocks = determine_num_blocks(target, drafter_cls)
    max_model_len = determine_max_model_len(config, facts.position_limit, num_blocks * config.cache.block_size)
    runner, drafter, kv_connector = _build_model_runner(target, drafter_cls, num_blocks, max_model_len)
    engine_core = _build_engine_core(target, runner, drafter, kv_connector, num_blocks, max_model_len)
    plugin_manager.hook.on_engine_start(config=config)
    return EngineParts(
        engine_core, facts, platform, target.device, attn_selection, runner, num_blocks, kv_connector
    )


def read_model_facts(config: EngineConfig, platform: Platform, plugin_manager: PluginManager) -> ModelFacts:
    path = resolve_model_path(config.model.model, plugin_manager)
    hf = load_hf_config(path)
    sliding_window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
    return ModelFacts(
        path=path,
        hf_config=hf,
        architecture=get_architecture(hf, config.model.architecture),
        dtype=platform.resolve_dtype(config.model.dtype, _config_dtype(hf)),
        head_size=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        sliding_window=sliding_window,
    )


def _load_target(
    config: EngineConfig,
    platform: Platform,
    facts: ModelFacts,
    attn_backend: type[AttentionBackend],
    plugin_manager: PluginManager,
) -> _Target:
    device = platform.device()
    model_cls = plugin_manager.models.load(facts.architecture)
    # load_model builds model_cls (a ModelForCausalLM, checked by the registry).
    model = cast("ModelForCausalLM", load_model(
        facts.path,
        model_cls=model_cls,
        attn_backend=attn_backend,
        dtype=facts.dtype,
        device=device,
        hf_config=facts.hf_config,
    ))
    platform.optimize_model(model)
    if config.device.compile_model:
        compile_outside_attention(model)
    speculative = config.speculative
    if speculative.model is not None:
        speculative = speculative.model_copy(update={"model": resolve_model_path(speculative.model, plugin_manager)})
    return _Target(config, platform, device, facts, attn_backend, model, speculative)


# ---------------------------------------------------------------- sizing


def determine_num_blocks(target: _Target, drafter_cls: type[Drafter] | None) -> int:
    """`cache.num_kv_blocks`, else the memory budget (given, or the platform's
    after a profile run) over the bytes of one block of every layer."""
    cache, facts = target.config.cache, target.facts
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    layout = target.attn_backend.get_kv_cache_layout()
    bytes_per_block = target.num_layers * layout.bytes_per_block(
        cache.block_size, facts.num_kv_heads, facts.head_size, facts.dtype
    )
    if drafter_cls is not None:
        # A model drafter's cache has as many blocks as the target's.
        bytes_per_block += drafter_cls.kv_cache_bytes_per_block(target.speculative, cache.block_size, facts.dtype)
    budget = cache.kv_cache_memory_bytes
    if budget is None:
        scheduler = target.config.scheduler
        position_limit = target.config.model.max_model_len or facts.position_limit or 1 << 30
        budget = target.platform.kv_cache_budget_bytes(
            cache.gpu_memory_utilization,
            functools.partial(
                profile_run,
                target.model,
                target.attn_backend,
                num_tokens=min(scheduler.max_num_batched_tokens, position_limit),
                num_logit_rows=scheduler.max_num_seqs,
                block_size=cache.block_size,
                num_kv_heads=facts.num_kv_heads,
                head_size=facts.head_size,
                dtype=facts.dtype,
                device=target.device,
            ),
        )
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ConfigError("cache.kv_cache_memory_bytes", budget, f">= {bytes_per_block} (one block of this model)")
    return num_blocks


def determine_max_model_len(config: EngineConfig, position_limit: int | None, kv_capacity_tokens: int) -> int:
    """`model.max_model_len`, checked against the model and the KV cache; by
    default the model's limit, lowered to what the KV cache holds."""
    configured = config.model.max_model_len
    if configured is None:
        max_model_len = position_limit or kv_capacity_tokens
        if max_model_len > kv_capacity_tokens:
            logger.warning(
                "max_model_len lowered from %d to %d: the KV cache holds no more tokens",
                max_model_len,
                kv_capacity_tokens,
            )
            max_model_len = kv_capacity_tokens
        return max_model_len
    if position_limit is not None and configured > position_limit:
        raise ConfigError("model.max_model_len", configured, f"<= {position_limit} (max_position_embeddings)")
    if configured > kv_capacity_tokens:
        raise ConfigError(
            "model.max_model_len",
            configured,
            f"<= {kv_capacity_tokens} tokens, what the KV cache holds; raise cache.num_kv_blocks "
            "or cache.kv_cache_memory_bytes",
        )
    return configured


# ---------------------------------------------------------------- worker


def _build_model_runner(
    target: _Target, drafter_cls: type[Drafter] | None, num_blocks: int, max_model_len: int
) -> tuple[ModelRunner, Drafter | None, KVConnectorBase | None]:
    config, facts = target.config, target.facts
    block_size = config.cache.block_size
    drafter = None if drafter_cls is None else _build_drafter(target, drafter_cls, num_blocks, max_model_len)
    kv_caches = allocate_kv_caches(
        target.model,
        target.attn_backend,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=facts.num_kv_heads,
        head_size=facts.head_size,
        dtype=facts.dtype,
        device=target.device,
    )
    connector_name = config.kv_transfer.connector
    kv_connector = None if connector_name is None else _build_kv_connector(target, connector_name)
    if kv_connector is not None:
        kv_connector.register_kv_caches(kv_caches)
    runner = ModelRunner(
        target.model,
        target.attn_backend,
        kv_caches,
        block_size=block_size,
        device=target.device,
        vocab_size=facts.hf_config.vocab_size,
        seed=config.model.seed,
        drafter=drafter,
        kv_connector=kv_connector,
        graph_runner=_capture_decode_graphs(target, max_model_len),
    )
    return runner, drafter, kv_connector


def _build_drafter(target: _Target, drafter_cls: type[Drafter], num_blocks: int, max_model_len: int) -> Drafter:
    speculative = target.speculative
    context = DrafterContext(
        target_model=target.model,
        attn_backend=target.attn_backend,
        device=target.device,
        dtype=target.facts.dtype,
        vocab_size=target.facts.hf_config.vocab_size,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size=target.config.cache.block_size,
    )
    drafter = drafter_cls(speculative, context)
    logger.info("speculative decoding: %s, k=%d", speculative.method, speculative.num_speculative_tokens)
    return drafter


def _build_kv_connector(target: _Target, name: str) -> KVConnectorBase:
    transfer, facts = target.config.kv_transfer, target.facts
    registry = get_plugin_manager().kv_connectors
    connector_cls = registry.load(name)  # UnknownComponentError lists the names
    roles = registry.get(name).info.roles
    if roles is not None and transfer.role not in roles:
        raise ConfigError("kv_transfer.role", transfer.role, f"{', '.join(roles)} for connector {name!r}")
    block_size = target.config.cache.block_size
    context = KVConnectorContext(
        model_path=facts.path,
        model_fingerprint=model_fingerprint(
            facts.path, facts.dtype, block_size, target.num_layers, facts.num_kv_heads, facts.head_size
        ),
        block_size=block_size,
        num_layers=target.num_layers,
        num_kv_heads=facts.num_kv_heads,
        head_size=facts.head_size,
        dtype=facts.dtype,
        device=target.device,
        kv_cache_layout=target.attn_backend.get_kv_cache_layout(),
    )
    connector = connector_cls(transfer, context)
    logger.info("kv transfer: %s", connector.describe())
    return connector


def _capture_decode_graphs(target: _Target, max_model_len: int) -> DecodeGraphRunner | None:
    """Decode graphs for the configured batch sizes, when the platform and the
    backend can capture them (after the KV caches are bound: graphs read them)."""
    device_config, block_size = target.config.device, target.config.cache.block_size
    if device_config.enforce_eager or not target.platform.supports_graph_capture():
        return None
    if not target.attn_backend.supports_graph_capture(block_size):
        logger.info("decode graphs: off (attention backend %s cannot be captured)", target.attn_backend.__name__)
        return None
    runner = DecodeGraphRunner(
        target.model,
        target.attn_backend,
        target.platform,
        sizes=device_config.cuda_graph_sizes or default_graph_sizes(target.config.scheduler.max_num_seqs),
        max_model_len=max_model_len,
        block_size=block_size,
        device=target.device,
    )
    runner.capture()
    logger.info("decode graphs captured for batch sizes %s", runner.sizes)
    return runner


# ------------------------------------------------------------------ core


def _build_engine_core(
    target: _Target,
    runner: ModelRunner,
    drafter: Drafter | None,
    kv_connector: KVConnectorBase | None,
    num_blocks: int,
    max_model_len: int,
) -> EngineCore:
    config, facts = target.config, target.facts
    vocab_size = facts.hf_config.vocab_size
    kv_cache_manager = KVCacheManager(
        num_blocks,
        config.cache.block_size,
        enable_caching=config.cache.enable_prefix_caching,
        hash_algo=config.cache.prefix_caching_hash_algo,
    )
    # The tokenizer loads only when the first structured-output request
    # needs a grammar backend (xgrammar's TokenizerInfo).
    structured_output_manager = StructuredOutputManager(
        config.structured_output,
        vocab_size=vocab_size,
        tokenizer=config.model.tokenizer or facts.path,
        eos_token_id=config_eos_token_id(facts.hf_config),
        max_num_rows=config.scheduler.max_num_seqs,
    )
    num_spec_tokens = config.speculative.num_speculative_tokens if drafter is not None else 0
    scheduler = Scheduler(
        config.scheduler,
        kv_cache_manager,
        max_model_len,
        structured_output_manager,
        num_spec_tokens=num_spec_tokens,
        num_lookahead_tokens=num_spec_tokens if drafter is not None and drafter.needs_lookahead_slots else 0,
        kv_connector=kv_connector,
    )
    return EngineCore(
        config,
        scheduler=scheduler,
        kv_cache_manager=kv_cache_manager,
        model_executor=runner,
        structured_output_manager=structured_output_manager,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
    )


def _config_dtype(hf_config: PretrainedConfig) -> torch.dtype:
    import torch

    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
