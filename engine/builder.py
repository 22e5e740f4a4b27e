"""The builder: the one place that turns an EngineConfig into engine parts.

    plugins -> executor (its workers: platform, model facts, attention
    backend, model) -> KV cache size (min over ranks) -> max_model_len
    -> executor.initialize_cache (each rank: KV caches, drafter, KV
    connector's worker side, decode graphs, ModelRunner)
    -> KVCacheManager, grammar manager, KV connector's scheduler side,
    Scheduler -> EngineCore

Every implementation comes from a plugin registry by the name the config
gives; each constructor receives its parts, and nothing is set on a built
object afterwards. The builder decides what the core needs; the executor
(worker/worker.py per rank) builds what runs the model. `build_engine_core(config)`
is what clients, tests and benchmarks call; `build_engine(config)` also
returns what was chosen on the way (the READY message and `pagedllm env`
report it).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from pagedllm.core.custom_stats import MetricSpec
from pagedllm.core.engine import EngineCore
from pagedllm.core.errors import ConfigError
from pagedllm.core.generation_config import GenerationDefaults
from pagedllm.core.kv_cache.hybrid_manager import make_kv_cache_manager
from pagedllm.core.lora_slots import LoRASlotTable
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.custom_stats_sources import build_custom_stats
from pagedllm.kv_connectors.base import KVConnectorContext, KVConnectorRole, KVConnectorShard
from pagedllm.kv_connectors.factory import build_kv_connector
from pagedllm.lora.store import LoRAStore
from pagedllm.model_registry.generation_config import load_generation_defaults
from pagedllm.model_registry.tokenizer import config_eos_token_id
from pagedllm.plugins import get_plugin_manager
from pagedllm.reasoning.select import reasoning_parser_class
from pagedllm.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import EngineConfig
    from pagedllm.core.kv_cache.kv_cache_interface import KVCacheConfig
    from pagedllm.executors.base import AttentionSelection, Executor
    from pagedllm.kv_connectors.base import KVConnectorBase
    from pagedllm.platforms.interface import Platform
    from pagedllm.plugins.manager import PluginManager
    from pagedllm.worker.model_facts import ModelFacts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    """The built engine core and what the builder chose on the way."""

    engine_core: EngineCore
    model: ModelFacts
    platform: Platform
    device: torch.device
    attn_selection: AttentionSelection
    executor: Executor  # the engine core's model_executor; its owner shuts it down
    executor_name: str  # its registered name (`auto` resolved)
    num_blocks: int
    kv_connector: KVConnectorBase | None  # the scheduler side
    # The generation config's sampling defaults and extra EOS ids (READY carries them).
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)


def build_engine_core(config: EngineConfig) -> EngineCore:
    """The engine core `config` describes (clients, tests, benchmarks)."""
    return build_engine(config).engine_core


def build_engine(config: EngineConfig) -> EngineParts:
    """Load the plugins `config` enables, start the executor (its workers load
    the model), size the KV cache, build the engine core (the
    `on_engine_start` hook runs last)."""
    plugin_manager = get_plugin_manager()
    plugins = config.plugins
    plugin_manager.load(
        enabled=plugins.enabled, disabled=plugins.disabled, strict=plugins.strict, config=plugins.config
    )
    if config.structured_output.reasoning_parser is not None:
        # Before any model loads: an unknown name is a ConfigError at start, not at the first request.
        reasoning_parser_class(config.structured_output.reasoning_parser)
    executor = select_executor(config, plugin_manager)(config)
    try:
        facts = executor.model_facts
        num_blocks = executor.determine_num_kv_blocks()
        kv_cache_config = executor.kv_cache_config()
        max_model_len = determine_max_model_len(
            config, facts.position_limit, kv_capacity_tokens(config, kv_cache_config, num_blocks)
        )
        executor.initialize_cache(num_blocks, max_model_len)
        generation = load_generation_defaults(facts.path, config.model, facts.hf_config, facts.hf_config.vocab_size)
        engine_core = _build_engine_core(config, executor, plugin_manager, num_blocks, max_model_len, kv_cache_config)
        plugin_manager.hook.on_engine_start(config=config)
    except BaseException:
        executor.shutdown()  # NOTE: a failed start must not leave workers behind
        raise
    return EngineParts(
        engine_core,
        facts,
        executor.platform,
        executor.device,
        executor.attn_selection,
        executor,
        executor_name(config),
        num_blocks,
        engine_core.kv_connector,
        generation,
    )


# What to pip-install for a missing package an executor requires, where that is
# not the import name itself (pagedllm's extras pin the versions it was tested with).
INSTALL_HINTS = {"ray": "'pagedllm[ray]'"}


def select_executor(config: EngineConfig, plugin_manager: PluginManager) -> type[Executor]:
    """The executor class `parallel.distributed_executor_backend` names
    (`auto`: `uni` at tensor_parallel_size 1, `mp` above), checked against the size."""
    tp_size = config.parallel.tensor_parallel_size
    name = executor_name(config)
    registry = plugin_manager.executors
    info = registry.get(name).info  # UnknownComponentError lists the names
    if tp_size > 1 and not info.supports_tensor_parallel:
        raise ConfigError(
            "parallel.tensor_parallel_size",
            tp_size,
            f"1 with executor {name!r}: it runs one rank (not registered with supports_tensor_parallel=True)",
        )
    # NOTE: before loading it: an executor's module imports what it requires.
    missing = [module for module in info.requires if importlib.util.find_spec(module) is None]
    if missing:
        install = " ".join(INSTALL_HINTS.get(module, module) for module in missing)
        raise ConfigError(
            "parallel.distributed_executor_backend", name, f"an executor whose packages are installed "
            f"({name!r} needs {', '.join(missing)}: pip install {install})"
        )
    return registry.load(name)


def executor_name(config: EngineConfig) -> str:
    """`parallel.distributed_executor_backend`, with `auto` resolved."""
    name = config.parallel.distributed_executor_backend
    if name == "auto":
        return "mp" if config.parallel.tensor_parallel_size > 1 else "uni"
    return name


def kv_capacity_tokens(config: EngineConfig, kv_cache_config: KVCacheConfig, num_blocks: int) -> int:
    """The longest sequence `num_blocks` KV blocks hold (with KV cache groups:
    every group's blocks of it, a sliding window's only the window's)."""
    if kv_cache_config.is_plain:
        return num_blocks * config.cache.block_size
    usable_blocks = num_blocks - kv_cache_config.needs_null_block
    return kv_cache_config.max_num_tokens(usable_blocks, config.scheduler.max_num_batched_tokens)


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


# ------------------------------------------------------------------ core


def _build_engine_core(
    config: EngineConfig,
    executor: Executor,
    plugin_manager: PluginManager,
    num_blocks: int,
    max_model_len: int,
    kv_cache_config: KVCacheConfig | None = None,
) -> EngineCore:
    facts = executor.model_facts
    vocab_size = facts.hf_config.vocab_size
    kv_cache_manager = make_kv_cache_manager(
        kv_cache_config,
        num_blocks,
        config.cache.block_size,
        enable_caching=config.cache.enable_prefix_caching,
        hash_algo=config.cache.prefix_caching_hash_algo,
    )
    if config.cache.enable_kv_events:
        kv_cache_manager.record_kv_events()
    # The tokenizer loads only when the first structured-output request
    # needs a grammar backend (xgrammar's TokenizerInfo).
    structured_output_manager = StructuredOutputManager(
        config.structured_output,
        vocab_size=vocab_size,
        tokenizer=config.model.tokenizer or facts.path,
        eos_token_id=config_eos_token_id(facts.hf_config),
        max_num_rows=config.scheduler.max_num_seqs,
        trust_remote_code=config.model.trust_remote_code,
    )
    method = config.speculative.method
    # The scheduler's share of speculative decoding reads the drafter's class
    # (a ClassVar): the drafters themselves live on the ranks.
    drafter_cls = None if method is None else plugin_manager.drafters.load(method)
    num_spec_tokens = config.speculative.num_speculative_tokens if drafter_cls is not None else 0
    kv_connector = build_scheduler_kv_connector(config, executor, plugin_manager)
    scheduler = Scheduler(
        config.scheduler,
        kv_cache_manager,
        max_model_len,
        structured_output_manager,
        num_spec_tokens=num_spec_tokens,
        num_lookahead_tokens=num_spec_tokens if drafter_cls is not None and drafter_cls.needs_lookahead_slots else 0,
        kv_connector=kv_connector,
        lora_slots=build_lora_slots(config, executor),
    )
    return EngineCore(
        config,
        scheduler=scheduler,
        kv_cache_manager=kv_cache_manager,
        model_executor=executor,
        structured_output_manager=structured_output_manager,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        custom_stats=build_custom_stats(config, kv_connector, plugin_manager, model_custom_metrics(executor)),
    )


def build_lora_slots(config: EngineConfig, executor: Executor) -> LoRASlotTable | None:
    """The adapters' slots and store (None unless lora.enable_lora): the
    store loads adapters in its own thread, as requests name them, checked
    against the modules the ranks hold slots for."""
    if not config.lora.enable_lora:
        return None
    store = LoRAStore(config.lora, adaptable_modules=executor.lora_supported_modules())
    return LoRASlotTable(config.lora.max_loras, store)


def model_custom_metrics(executor: Executor) -> list[MetricSpec]:
    """The custom figures rank 0 reports for its loaded model (an MoE
    model's expert load)."""
    # NOTE: a rank in another process answers with the structs' fields.
    return msgspec.convert(executor.collective_rpc("model_custom_metrics")[0], list[MetricSpec])


def build_scheduler_kv_connector(
    config: EngineConfig, executor: Executor, plugin_manager: PluginManager
) -> KVConnectorBase | None:
    """The KV connector's scheduler side (None without `kv_transfer.connector`),
    the same for every executor: its context names what each rank holds of a
    block (the ranks built their worker sides in `initialize_cache`)."""
    if config.kv_transfer.connector is None:
        return None
    # NOTE: a rank in another process answers with the struct's fields.
    shards = [msgspec.convert(shard, KVConnectorShard) for shard in executor.collective_rpc("kv_connector_shard")]
    facts = executor.model_facts
    context = KVConnectorContext(
        model_path=facts.path,
        model_fingerprint=shards[0].fingerprint,
        block_size=config.cache.block_size,
        num_layers=shards[0].num_layers,
        num_kv_heads=shards[0].num_kv_heads,
        head_size=facts.head_size,
        dtype=facts.kv_cache_dtype,
        device=executor.device,
        kv_cache_layout=facts.kv_cache_layout(executor.attn_selection.backend_cls),
        side=KVConnectorRole.SCHEDULER,
        tp_size=len(shards),
        rank_fingerprints=tuple(shard.fingerprint for shard in shards),
    )
    return build_kv_connector(config, plugin_manager, context)

