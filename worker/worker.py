"""The Worker: one rank's model, KV cache and ModelRunner (vLLM's `Worker`).

An executor starts one Worker per rank (in its own process for the
multi-rank executors, in the engine's for `uni`) and drives each the same way:

    Worker(config, rank=...) -> load_model() -> determine_num_kv_blocks()
    -> initialize_cache(num_blocks, max_model_len) -> execute_model(...) ...

The engine side decides what is shared by every rank (the number of KV
blocks: the minimum over ranks; max_model_len) and passes it back in;
everything a rank allocates it builds itself: model weights, KV caches,
drafter, KV connector, decode graphs, ModelRunner.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, cast

from pagedllm.attention_backends.selector import select_attention_backend
from pagedllm.core.custom_stats import CustomStatsCollector, MetricSpec
from pagedllm.core.errors import ConfigError, GraphCaptureError
from pagedllm.core.kv_cache.kv_cache_interface import KVCacheConfig, KVCacheSpec
from pagedllm.distributed.parallel_state import (
    get_ep_group,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from pagedllm.kv_connectors.base import KVConnectorContext, KVConnectorRole, KVConnectorShard, model_fingerprint
from pagedllm.kv_connectors.factory import build_kv_connector, check_kv_connector_supports
from pagedllm.logits_processors.factory import build_logits_processors
from pagedllm.lora.model import LoRAModelSlots, attach_lora_slots
from pagedllm.model_registry.interface import attention_requirements_of
from pagedllm.model_registry.kv_cache import allocate_kv_caches, get_model_kv_cache_config
from pagedllm.model_registry.layers.expert_parallel import EP_FIELD, num_routed_experts, place_experts
from pagedllm.model_registry.layers.ops import OpRegistry, bind_layer_ops
from pagedllm.model_registry.loader import (
    ModelLoadError,
    get_architecture,
    load_hf_config,
    load_model,
)
from pagedllm.model_registry.model_impl import ModelImplChoice, resolve_model_impl
from pagedllm.model_registry.model_source import resolve_model_path
from pagedllm.model_registry.transformers_fallback.model import TransformersForCausalLM
from pagedllm.model_registry.transformers_fallback.tensor_parallel import check_fallback_tensor_parallel
from pagedllm.platforms import resolve_platform
from pagedllm.platforms.cpu.host_memory import resident_bytes
from pagedllm.plugins import get_plugin_manager
from pagedllm.spec_decode.interface import DrafterContext
from pagedllm.worker.compile import compile_outside_attention
from pagedllm.worker.decode_graphs import DecodeGraphRunner, default_graph_sizes
from pagedllm.worker.expert_stats import ExpertLoadStats, moe_layers
from pagedllm.worker.layer_ops import build_op_registry
from pagedllm.worker.memory_profiler import profile_run
from pagedllm.worker.model_facts import ModelFacts
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.quantize import (
    QuantizationPlan,
    create_checkpoint_weights,
    load_quantization_method,
    plan_quantization,
    quantize_model,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.attention_backends.selector import BackendSelection
    from pagedllm.core.config import EngineConfig, ParallelConfig, SpeculativeConfig
    from pagedllm.core.custom_stats import CustomStatsSource
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from pagedllm.kv_connectors.base import KVConnectorBase
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.platforms.interface import Platform
    from pagedllm.plugins.manager import PluginManager
    from pagedllm.quantization.base import QuantizationMethod
    from pagedllm.spec_decode.interface import Drafter
    from pagedllm.spec_decode.policy import SpeculationPolicy

logger = logging.getLogger(__name__)


def read_model_facts(config: EngineConfig, platform: Platform, plugin_manager: PluginManager) -> ModelFacts:
    path = resolve_model_path(config.model.model, plugin_manager)
    hf = load_hf_config(path, config.model.trust_remote_code)
    sliding_window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
    dtype = platform.resolve_dtype(config.model.dtype, _config_dtype(hf))
    architecture = get_architecture(hf, config.model.architecture)
    model_impl = resolve_model_impl(architecture, config.model.model_impl, plugin_manager.models)
    requirements = attention_requirements_of(load_model_class(model_impl, plugin_manager), hf)
    head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if requirements.latent_kv_size is not None:  # MLA: one latent vector per token, on every rank
        head_size, num_kv_heads = requirements.latent_kv_size, 1
    return ModelFacts(
        path=path,
        hf_config=hf,
        architecture=architecture,
        dtype=dtype,
        kv_cache_dtype=platform.resolve_kv_cache_dtype(config.cache.cache_dtype, dtype),
        head_size=head_size,
        num_kv_heads=num_kv_heads,
        sliding_window=sliding_window,
        attention_requirements=requirements,
        model_impl=model_impl,
    )


def plan_ranks(
    config: EngineConfig, plugin_manager: PluginManager
) -> tuple[Platform, ModelFacts, BackendSelection]:
    """What every rank will run on and run, decided from the config alone
    (each Worker calls it; a multi-rank executor also does, to report it
    without asking a rank): the platform, the model's facts, the attention
    backend."""
    platform = resolve_platform(config.device.platform, plugin_manager)
    facts = read_model_facts(config, platform, plugin_manager)
    attn_selection = select_attention_backend(
        platform,
        config.device.attention_backend,
        head_size=facts.head_size,
        dtype=facts.dtype,
        block_size=config.cache.block_size,
        sliding_window=facts.sliding_window,
        kv_cache_dtype=facts.kv_cache_dtype,
        requirements=facts.attention_requirements,
        plugin_manager=plugin_manager,
    )
    check_tensor_parallel(config, facts, plugin_manager)
    quantization = plan_model_quantization(config, facts, plugin_manager)  # before any rank starts
    check_expert_parallel(config, facts)
    if quantization.name is not None and facts.impl().impl == "transformers":
        raise ConfigError(
            "model.quantization",
            quantization.name,
            f"None for {facts.architecture} on the Transformers fallback (its linear layers are transformers')",
        )
    return platform, facts, attn_selection


def plan_model_quantization(config: EngineConfig, facts: ModelFacts, plugin_manager: PluginManager) -> QuantizationPlan:
    """model.quantization, or the method that reads the checkpoint's format
    (dummy weights read no checkpoint: only model.quantization applies)."""
    if config.model.load_format == "dummy":
        return QuantizationPlan(config.model.quantization)
    return plan_quantization(config.model.quantization, facts.hf_config,
                             load_model_class(facts.impl(), plugin_manager), plugin_manager, facts.path)


def check_tensor_parallel(config: EngineConfig, facts: ModelFacts, plugin_manager: PluginManager) -> None:
    """A ConfigError, before any rank starts, for what cannot run at
    tensor_parallel_size > 1: a model that does not declare
    `supports_tensor_parallel`, heads that do not split, a KV connector
    not registered with `supports_tensor_parallel`."""
    tp_size = config.parallel.tensor_parallel_size
    if tp_size == 1:
        return
    model_impl = facts.impl()
    if model_impl.impl == "transformers":  # transformers' TP plan decides
        check_fallback_tensor_parallel(facts.hf_config, facts.architecture, tp_size)
    model_cls = load_model_class(model_impl, plugin_manager)
    if not getattr(model_cls, "supports_tensor_parallel", False):  # duck-typed models do not say so
        raise ConfigError(
            "parallel.tensor_parallel_size",
            tp_size,
            f"1: architecture {facts.architecture} does not support tensor parallelism "
            "(its model class does not declare supports_tensor_parallel = True)",
        )
    facts.heads_per_rank(tp_size)  # the ConfigError QKVParallelLinear would raise in every rank
    check_kv_connector_supports(config, plugin_manager)


def check_expert_parallel(config: EngineConfig, facts: ModelFacts) -> None:
    """`parallel.enable_expert_parallel` at tensor_parallel_size > 1: a
    ConfigError, before any rank starts, when the experts do not split
    evenly over the ranks or the model runs on the Transformers fallback
    (its experts are transformers' modules). A model without experts keeps
    every layer tensor parallel (vLLM ignores the flag there too): logged."""
    parallel = config.parallel
    if not parallel.enable_expert_parallel or parallel.tensor_parallel_size == 1:
        return
    num_experts = num_routed_experts(facts.hf_config)
    if num_experts is None:
        logger.info("enable_expert_parallel: %s has no experts, every layer stays tensor parallel",
                    facts.architecture)
        return
    if facts.impl().impl == "transformers":
        raise ConfigError(EP_FIELD, True, f"False for {facts.architecture} on the Transformers fallback "
                          "(expert parallelism needs a native model's FusedMoE layers)")
    place_experts(num_experts, 0, parallel.tensor_parallel_size)


def load_model_class(choice: ModelImplChoice, plugin_manager: PluginManager) -> type[ModelForCausalLM]:
    """The class to build for `choice`: the registered one, or the Transformers fallback."""
    if choice.impl == "native":
        return plugin_manager.models.load(choice.architecture)
    return TransformersForCausalLM


def check_fallback_attention_layers(model: ModelForCausalLM, facts: ModelFacts, num_kv_heads: int) -> None:
    """The Transformers fallback's layers took their heads from transformers'
    modules, this rank's KV cache takes them from the config: a ModelLoadError
    where they disagree (an architecture whose config names its heads otherwise)."""
    for idx, layer in enumerate(model.get_attention_layers()):
        if (layer.num_kv_heads, layer.head_size) != (num_kv_heads, facts.head_size):
            raise ModelLoadError(facts.path, detail=(
                f"{facts.architecture} layer {idx} attends with {layer.num_kv_heads} KV heads of size "
                f"{layer.head_size} on this rank, the KV cache is sized for {num_kv_heads} of size {facts.head_size}"
            ))


def rank_on_host(parallel: ParallelConfig, local_rank: int) -> tuple[int, int]:
    """(this rank's index, the number of ranks) among the ranks of every
    data-parallel engine on this host: `-dp 2 -tp 2` is ranks 0-1 (replica
    0) and 2-3 (replica 1), which the platform places apart."""
    return (parallel.data_parallel_rank * parallel.tensor_parallel_size + local_rank,
            parallel.data_parallel_size * parallel.tensor_parallel_size)


class Worker:
    """One rank. `rank` is its place in the world, `local_rank` its device
    index on this host; `distributed_init_method` (``tcp://addr:port``) is
    where the ranks of a multi-rank executor meet (None for one rank)."""

    # The model's KV cache groups, once `kv_cache_config()` has grouped its layers.
    _kv_cache_config: KVCacheConfig | None = None
    # The target model's adapter slots (config.lora.enable_lora), once load_model has attached them.
    lora_slots: LoRAModelSlots | None = None

    def __init__(
        self,
        config: EngineConfig,
        *,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        # A rank in its own process loads the plugins the config enables; in
        # the engine's process this is the builder's call again (a no-op).
        self.plugin_manager = get_plugin_manager()
        plugins = config.plugins
        self.plugin_manager.load(
            enabled=plugins.enabled, disabled=plugins.disabled, strict=plugins.strict, config=plugins.config
        )
        self.platform, self.model_facts, self.attn_selection = plan_ranks(config, self.plugin_manager)
        self.world_size = config.parallel.tensor_parallel_size
        # NOTE: this rank's KV heads, the layers' split: its cache holds only these.
        self.num_kv_heads = self.model_facts.heads_per_rank(self.world_size).num_kv_heads
        if distributed_init_method is not None or config.parallel.data_parallel_size > 1:
            # A rank in its own process: its device (CUDA) or share of the cores (CPU).
            self.platform.init_rank(*rank_on_host(config.parallel, local_rank))
        self.device: torch.device = self.platform.device()
        logger.info("dtype %s (%s); KV cache %s (cache_dtype %s)", self.model_facts.dtype, self.platform.explain_dtype(
            config.model.dtype, _config_dtype(self.model_facts.hf_config)), self.model_facts.kv_cache_dtype,
            config.cache.cache_dtype)
        logger.info("model %s: implementation %s; attention backend: %s (rejected: %s; rank %d)",
                    self.model_facts.architecture, self.model_facts.impl().describe(), self.attn_selection.name,
                    self.attn_selection.rejected, rank)
        method = config.speculative.method
        self.drafter_cls: type[Drafter] | None = None if method is None else self.plugin_manager.drafters.load(method)
        # How many tokens each request drafts per step (an unknown name fails here).
        self.spec_policy_cls: type[SpeculationPolicy] | None = (
            None if method is None else self.plugin_manager.spec_policies.load(config.speculative.policy))
        # Checked here, before any weight is loaded: an unknown or unfit method is a ConfigError.
        self.quantization = plan_model_quantization(config, self.model_facts, self.plugin_manager)
        self.quantization_cls: type[QuantizationMethod] | None = None if self.quantization.name is None else (
            load_quantization_method(self.quantization.name, self.plugin_manager, self.platform,
                                     self.model_facts.dtype))
        # config.speculative with its model name resolved to a folder: drafters
        # get a folder, whatever name the config gave.
        speculative = config.speculative
        if speculative.model is not None:
            speculative = speculative.model_copy(
                update={"model": resolve_model_path(speculative.model, self.plugin_manager)}
            )
        self.speculative: SpeculativeConfig = speculative
        self._model: ModelForCausalLM | None = None
        self.op_registry = OpRegistry()  # load_model fills it for this platform and quantization
        self._model_runner: ModelRunner | None = None
        self._is_shut_down = False
        self.num_steps = 0
        self.drafter: Drafter | None = None
        self.kv_connector: KVConnectorBase | None = None
        # This rank's components that report custom figures (None: none does).
        self.custom_stats: CustomStatsCollector | None = None

    @property
    def attn_backend(self) -> type[AttentionBackend]:
        return self.attn_selection.backend_cls

    @property
    def model(self) -> ModelForCausalLM:
        if self._model is None:
            raise RuntimeError(self._not_ready("load_model"))
        return self._model

    @property
    def model_runner(self) -> ModelRunner:
        if self._model_runner is None:
            raise RuntimeError(self._not_ready("initialize_cache"))
        return self._model_runner

    def _not_ready(self, step: str) -> str:
        if self._is_shut_down:
            return f"rank {self.rank} has been shut down"
        return f"Worker.{step}() has not run on rank {self.rank}"

    @property
    def num_layers(self) -> int:
        return len(self.model.get_attention_layers())

    # ------------------------------------------------------------ lifecycle

    def init_distributed(self) -> None:
        """Join the other ranks' process groups (the world, then the tensor
        parallel group) over the platform's backend; nothing for one rank."""
        if self.distributed_init_method is None:
            if self.world_size > 1:
                raise RuntimeError(f"rank {self.rank} of {self.world_size} has no distributed_init_method")
            return
        init_distributed_environment(
            self.world_size, self.rank, self.distributed_init_method, self.platform.dist_backend, self.local_rank
        )
        initialize_model_parallel(self.world_size, platform=self.platform,
                                  enable_expert_parallel=self.config.parallel.enable_expert_parallel)

    def load_model(self) -> None:
        """Build the model from its weights, on this rank's device (its slice
        of every layer at tensor_parallel_size > 1)."""
        self.init_distributed()
        facts = self.model_facts
        model_cls = load_model_class(facts.impl(), self.plugin_manager)
        quantization = None if self.quantization_cls is None else self.quantization.build(
            self.quantization_cls, facts.path)
        create_quantized_weights = None
        if quantization is not None and self.quantization.checkpoint_format is not None:
            create_quantized_weights = functools.partial(create_checkpoint_weights, method=quantization,
                                                         model_path=facts.path)
        # load_model builds model_cls (a ModelForCausalLM, checked by the registry).
        model = cast("ModelForCausalLM", load_model(
            facts.path,
            model_cls=model_cls,
            attn_backend=self.attn_backend,
            dtype=facts.dtype,
            device=self.device,
            hf_config=facts.hf_config,
            load_format=self.config.model.load_format,
            seed=self.config.model.seed,
            create_quantized_weights=create_quantized_weights,
        ))
        if facts.impl().impl == "transformers":
            check_fallback_attention_layers(model, facts, self.num_kv_heads)
        if quantization is not None:
            converted = quantize_model(model, quantization)
            source = self.quantization.checkpoint_format or "float"
            logger.info("quantization %s (%s checkpoint): %d linear, %d MoE and %d attention layers converted",
                        self.quantization.name, source, converted.linear, converted.moe, converted.attention)
        # NOTE: after quantization (the slots read the layers' final shapes),
        # before the ops are bound (the slots are op layers too).
        self.lora_slots = self._attach_lora_slots(model)
        self.op_registry = build_op_registry(self.platform, quantization)
        bind_layer_ops(model, self.op_registry)
        self.platform.optimize_model(model)
        if self.config.device.compile_model:
            compile_outside_attention(model)
        self._model = model

    def _attach_lora_slots(self, model: ModelForCausalLM) -> LoRAModelSlots | None:
        """The target model's adapter slots when LoRA is enabled (a model
        drafter's layers get none: drafts come from the base model)."""
        lora = self.config.lora
        if not lora.enable_lora:
            return None
        return attach_lora_slots(model, max_loras=lora.max_loras, max_rank=lora.max_lora_rank,
                                 dtype=self.model_facts.dtype, device=self.device)

    def lora_supported_modules(self) -> dict[str, tuple[int, int]] | None:
        """The checkpoint modules an adapter may adapt on this model, with
        their full (out, in) (None: LoRA is off): what adapters must be
        checked against when registered (MoE experts, routers, embeddings
        and the LM head are in the checkpoint but get no slots)."""
        return None if self.lora_slots is None else self.lora_slots.supported_modules()

    def kv_cache_config(self) -> KVCacheConfig:
        """This model's KV cache groups (core/kv_cache/kv_cache_interface.py);
        the builder asks rank 0 for them to build the KV cache manager."""
        if self._kv_cache_config is None:
            block_size = self.config.cache.block_size
            config = get_model_kv_cache_config(self.model, block_size, enable_hybrid=True)
            reason = self._hybrid_kv_cache_off_reason()
            if reason and not config.is_plain:
                logger.info("KV cache groups: off, every layer keeps a full-length cache (%s)", reason)
                config = get_model_kv_cache_config(self.model, block_size, enable_hybrid=False)
            elif not config.is_plain:
                logger.info("KV cache groups: %s", _describe_groups(config))
            self._kv_cache_config = config
        return self._kv_cache_config

    def _hybrid_kv_cache_off_reason(self) -> str:
        """Why layers with different KV specs keep one full-length cache ('' if they need not)."""
        if self.config.cache.disable_hybrid_kv_cache_manager:
            return "cache.disable_hybrid_kv_cache_manager"
        if self.config.kv_transfer.connector is not None:
            return "a KV connector moves whole-model blocks"
        if self.drafter_cls is not None and self.drafter_cls.needs_lookahead_slots:
            return "a model drafter's KV cache shares the target's one block table"
        return ""

    def determine_num_kv_blocks(self) -> int:
        """`cache.num_kv_blocks`, else this rank's memory budget (given, or
        the platform's after a profile run) over the bytes of one block of
        every layer on this rank (its KV heads only)."""
        cache, facts = self.config.cache, self.model_facts
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        layout = facts.kv_cache_layout(self.attn_backend)
        # NOTE: in the cache's dtype: an fp8 cache fits twice the bfloat16 blocks.
        # A block id names one page in each KV tensor (one per layer, unless
        # KV cache groups share them).
        bytes_per_block = self.kv_cache_config().num_kv_tensors * layout.bytes_per_block(
            cache.block_size, self.num_kv_heads, facts.head_size, facts.kv_cache_dtype
        )
        if self.drafter_cls is not None:
            # A model drafter's cache has as many blocks as the target's, in the same dtype.
            bytes_per_block += self.drafter_cls.kv_cache_bytes_per_block(
                self.speculative, cache.block_size, facts.kv_cache_dtype
            )
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            budget = self.platform.kv_cache_budget_bytes(cache.gpu_memory_utilization, self._profile_run)
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ConfigError(
                "cache.kv_cache_memory_bytes",
                budget,
                f">= {bytes_per_block} (one block of this model per rank at tensor_parallel_size {self.world_size})",
            )
        return num_blocks

    def _profile_run(self) -> None:
        """The largest batch the scheduler may send, on a throwaway cache
        (with LoRA, every row in an adapter slot: the adapter products'
        activations count too; the slots hold zeros or adapters, the
        outputs are thrown away)."""
        scheduler, facts = self.config.scheduler, self.model_facts
        position_limit = self.config.model.max_model_len or facts.position_limit or 1 << 30
        num_tokens = min(scheduler.max_num_batched_tokens, position_limit)
        lora_state = None if self.lora_slots is None else self.lora_slots.state
        if lora_state is not None:
            import torch

            lora_state.token_slots = torch.ones(num_tokens, dtype=torch.int32, device=self.device)
        try:
            profile_run(
                self.model,
                self.attn_backend,
                num_tokens=num_tokens,
                num_logit_rows=scheduler.max_num_seqs,
                block_size=self.config.cache.block_size,
                num_kv_heads=self.num_kv_heads,
                head_size=facts.head_size,
                kv_cache_dtype=facts.kv_cache_dtype,
                device=self.device,
            )
        finally:
            if lora_state is not None:
                lora_state.token_slots = None

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate `num_blocks` KV blocks per layer (the same on every rank)
        and build what reads them: drafter, KV connector, decode graphs, and
        the ModelRunner."""
        facts = self.model_facts
        block_size = self.config.cache.block_size
        if self.drafter_cls is not None:
            self.drafter = self._build_drafter(self.drafter_cls, num_blocks, max_model_len)
        kv_caches = allocate_kv_caches(
            self.model,
            self.attn_backend,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=facts.head_size,
            dtype=facts.kv_cache_dtype,
            device=self.device,
            kv_cache_config=self.kv_cache_config(),
        )
        if self.config.kv_transfer.connector is not None:
            # NOTE: the worker side only, with every executor: the builder
            # builds the scheduler's (engine/builder.py).
            context = self.kv_connector_context(KVConnectorRole.WORKER)
            self.kv_connector = build_kv_connector(self.config, self.plugin_manager, context)
            self.kv_connector.register_kv_caches(kv_caches)
        self._model_runner = ModelRunner(
            self.model,
            self.attn_backend,
            kv_caches,
            block_size=block_size,
            device=self.device,
            vocab_size=facts.hf_config.vocab_size,
            max_model_len=max_model_len,
            max_num_reqs=self.config.scheduler.max_num_seqs,
            seed=self.config.model.seed,
            drafter=self.drafter,
            spec_policy=None if self.spec_policy_cls is None else self.spec_policy_cls(self.speculative),
            kv_connector=self.kv_connector,
            graph_runner=self._capture_decode_graphs(max_model_len),
            logits_processors=build_logits_processors(self.config, self.plugin_manager, self.device),
            num_kv_cache_groups=self.kv_cache_config().num_groups,
            lora=self.lora_slots,
        )
        # After the graph captures: the MoE layers' counts start from zero here.
        self.custom_stats = self._build_custom_stats()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        output = self.model_runner.execute_model(scheduler_output)
        if self.custom_stats is not None:
            output.custom_stats = self.custom_stats.take()
        return output

    def collective_stats(self) -> dict[str, float]:
        """Steps this rank has run, and its tensor-parallel group's collectives
        (count, wall seconds) meanwhile: what tensor parallelism costs a step;
        with expert parallelism, its group's (the MoE layers' all-to-alls
        and all-gathers) apart, as `ep_*`."""
        tp_group, ep_group = get_tp_group(), get_ep_group()
        return {
            "num_steps": self.num_steps,
            "num_collectives": tp_group.num_collectives,
            "collective_seconds": tp_group.collective_seconds,
            "ep_num_collectives": 0 if ep_group is None else ep_group.num_collectives,
            "ep_collective_seconds": 0.0 if ep_group is None else ep_group.collective_seconds,
        }

    def memory_usage(self) -> dict[str, int]:
        """What this rank holds, measured from its tensors (each storage
        once): its model's parameters and buffers, and its KV cache (the
        target's; a drafter's weights and cache are not counted). A
        platform's private copies (the CPU's prepacked GEMM weights) are not
        the model's and are not counted. `kv_cache_resident_bytes`: of a KV
        cache in host memory, the pages written so far (they grow the
        process's RSS as blocks are first used; -1 where unknown; 0 on a
        device); `pid`: the process holding them."""
        model = self.model
        kv_caches = self.model_runner.kv_caches
        return {
            "pid": os.getpid(),
            "weights_bytes": _storage_bytes([*model.parameters(), *model.buffers()]),
            "kv_cache_bytes": _storage_bytes(kv_caches),
            "kv_cache_resident_bytes": _host_resident_bytes(kv_caches),
        }

    def check_health(self) -> None:
        """Raise if this rank cannot run a step (an in-process rank lives as
        long as the engine: nothing to check)."""

    def shutdown(self) -> None:
        """Release what the rank holds for the rest of the process."""
        self._is_shut_down = True
        self._model_runner = None
        self._model = None
        self.drafter = None
        self.kv_connector = None
        self.custom_stats = None

    # ------------------------------------------------------- built parts

    def _build_drafter(self, drafter_cls: type[Drafter], num_blocks: int, max_model_len: int) -> Drafter:
        context = DrafterContext(
            target_model=self.model,
            attn_backend=self.attn_backend,
            device=self.device,
            dtype=self.model_facts.dtype,
            kv_cache_dtype=self.model_facts.kv_cache_dtype,
            vocab_size=self.model_facts.hf_config.vocab_size,
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            block_size=self.config.cache.block_size,
        )
        drafter = drafter_cls(self.speculative, context)
        from torch import nn

        # A model drafter's own layers run the same ops as the target's.
        for part in vars(drafter).values():
            if isinstance(part, nn.Module) and part is not self.model:
                bind_layer_ops(part, self.op_registry)
        if self._graphs_enabled():
            drafter.capture_graphs(self.platform, self._graph_sizes())
        logger.info(
            "speculative decoding: %s, k=%d", self.speculative.method, self.speculative.num_speculative_tokens
        )
        return drafter

    def _build_custom_stats(self) -> CustomStatsCollector | None:
        """The rank's components that report custom figures, polled after
        each of its steps (the figures go back with the step's output): its
        connector's worker side (every rank: each moves its own shard) and,
        on rank 0 only, its drafter (every rank runs the same one) and the
        expert load of an MoE model (every rank routes alike)."""
        candidates: list[tuple[str, object]] = [("kv_connector (worker side)", self.kv_connector)]
        if self.rank == 0:
            candidates.append(("drafter", self.drafter))
            if moe_layers(self.model):
                candidates.append(("expert load", ExpertLoadStats(self.model)))
        sources = [
            (owner, cast("CustomStatsSource", component))
            for owner, component in candidates if getattr(component, "custom_metrics", ())
        ]
        return CustomStatsCollector(sources) if sources else None

    def model_custom_metrics(self) -> list[MetricSpec]:
        """The custom figures this rank reports that depend on the loaded
        model, not on a component's class (the builder declares rank 0's):
        the expert load of an MoE model."""
        return list(ExpertLoadStats.custom_metrics) if self.rank == 0 and moe_layers(self.model) else []

    def kv_connector_shard(self) -> KVConnectorShard:
        """What the scheduler side of a KV connector must know of this rank's
        shard of every block (the builder asks every rank)."""
        context = self.kv_connector_context(KVConnectorRole.WORKER)
        return KVConnectorShard(context.model_fingerprint, context.num_layers, context.num_kv_heads)

    def kv_connector_context(self, side: str) -> KVConnectorContext:
        """This rank's facts for a KV connector serving `side`."""
        facts, block_size = self.model_facts, self.config.cache.block_size
        return KVConnectorContext(
            model_path=facts.path,
            model_fingerprint=model_fingerprint(
                facts.path, facts.dtype, block_size, self.num_layers, self.num_kv_heads, facts.head_size,
                tp_size=self.world_size, tp_rank=self.rank, quantization=self.quantization.name,
                kv_cache_dtype=facts.kv_cache_dtype, latent=facts.is_latent,
            ),
            block_size=block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=facts.head_size,
            dtype=facts.kv_cache_dtype,
            device=self.device,
            kv_cache_layout=facts.kv_cache_layout(self.attn_backend),
            side=side,
            tp_size=self.world_size,
            tp_rank=self.rank,
        )

    def _capture_decode_graphs(self, max_model_len: int) -> DecodeGraphRunner | None:
        """Decode graphs for the configured batch sizes, when the platform and
        the backend can capture them (after the KV caches are bound: graphs
        read them)."""
        block_size = self.config.cache.block_size
        if not self._graphs_enabled():
            return None
        runner = DecodeGraphRunner(
            self.model,
            self.attn_backend,
            self.platform,
            sizes=self._graph_sizes(),
            max_model_len=max_model_len,
            block_size=block_size,
            device=self.device,
            query_lens=self._verify_query_lens(block_size),
            num_kv_cache_groups=self.kv_cache_config().num_groups,
            lora_state=None if self.lora_slots is None else self.lora_slots.state,
        )
        try:
            runner.capture()
        except GraphCaptureError as error:
            logger.warning("decode graphs: off, every step runs eagerly (%s)", error)
            return None
        logger.info("decode graphs captured for batch sizes %s", runner.sizes)
        if runner.query_lens[1:]:
            logger.info("verify graphs of %s tokens per request: captured when first needed, at sizes up to %d",
                        runner.query_lens[1:], runner.allowed_sizes[runner.query_lens[1]][-1])
        return runner

    def _graphs_enabled(self) -> bool:
        """Whether forwards are captured as graphs here: not enforce_eager,
        and the platform and the attention backend can capture them."""
        if self.config.device.enforce_eager or not self.platform.supports_graph_capture():
            return False
        if not self.attn_backend.supports_graph_capture(self.config.cache.block_size):
            logger.info("graphs: off (attention backend %s cannot be captured)", self.attn_backend.__name__)
            return False
        return True

    def _graph_sizes(self) -> list[int]:
        return self.config.device.graph_sizes or default_graph_sizes(self.config.scheduler.max_num_seqs)

    def _verify_query_lens(self, block_size: int) -> list[int]:
        """The tokens per request of verify steps (2 .. 1 + k: a drafter may
        propose fewer than k), when a drafter runs and the backend can
        capture such steps."""
        num_drafts = self.speculative.num_speculative_tokens if self.speculative.method else 0
        if not num_drafts or not self.attn_backend.supports_uniform_query_capture(block_size):
            return []
        return list(range(2, num_drafts + 2))


def _describe_groups(config: KVCacheConfig) -> str:
    """'2 groups over 1 KV tensor per block: full_attention [1], sliding_window(4) [0]'."""
    groups = ", ".join(
        f"{_describe_spec(group.kv_cache_spec)} {list(group.layer_indices)}" for group in config.kv_cache_groups
    )
    return f"{config.num_groups} groups over {config.num_kv_tensors} KV tensors: {groups}"


def _describe_spec(spec: KVCacheSpec) -> str:
    window = getattr(spec, "sliding_window", None)
    return "full_attention" if window is None else f"sliding_window({window})"


def _host_resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Resident bytes of the host storages behind `tensors` (-1 if unknown)."""
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
                for tensor in tensors if tensor.device.type == "cpu"}
    total = 0
    for address, num_bytes in storages.items():
        resident = resident_bytes(address, num_bytes)
        if resident is None:
            return -1
        total += resident
    return total


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, a shared one (a tied weight) once."""
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(storages.values())


def _config_dtype(hf_config: PretrainedConfig) -> torch.dtype:
    import torch

    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
