"""EngineCore: owns the scheduler, the KV cache manager and the model runner.

Everything variable (platform, attention backend, model architecture) comes
from the plugin registries; this module names none of them.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING

from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.core.int_limits import short_value
from pagedllm.worker.compile import compile_outside_attention
from pagedllm.worker.decode_graphs import DecodeGraphRunner, default_graph_sizes
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.worker.memory_profiler import profile_run
from pagedllm.kv_connectors.base import KVConnectorContext, model_fingerprint
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.stats import SchedulerStats
from pagedllm.model_registry.loader import get_architecture, load_hf_config, load_model
from pagedllm.model_registry.tiny import resolve_model_path
from pagedllm.attention_backends.selector import select_attention_backend
from pagedllm.platforms import resolve_platform
from pagedllm.plugins import get_plugin_manager
from pagedllm.spec_decode.interface import DrafterContext
from pagedllm.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from transformers import PretrainedConfig

    from pagedllm.core.config import EngineConfig
    from pagedllm.core.outputs import EngineCoreOutput
    from pagedllm.kv_connectors.base import KVConnectorBase
    from pagedllm.spec_decode.interface import Drafter

logger = logging.getLogger(__name__)

# Longest an idle step waits for a compiling grammar (the core's input loop
# must stay responsive to aborts).
GRAMMAR_WAIT_S = 0.01


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        plugin_manager = get_plugin_manager()
        plugin_manager.load(
            enabled=config.plugins.enabled, disabled=config.plugins.disabled, strict=config.plugins.strict
        )

        self.model_path: Path = resolve_model_path(config.model.model)
        self.hf_config: PretrainedConfig = load_hf_config(self.model_path)
        architecture = get_architecture(self.hf_config, config.model.architecture)
        model_cls = plugin_manager.registry("model").load(architecture)

        self.platform = resolve_platform(config.device.platform)
        self.device = self.platform.device()
        self.dtype = self.platform.resolve_dtype(config.model.dtype, _config_dtype(self.hf_config))
        hf = self.hf_config
        self.head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        block_size = config.cache.block_size
        self.attn_selection = select_attention_backend(
            self.platform,
            config.device.attention_backend,
            head_size=self.head_size,
            dtype=self.dtype,
            block_size=block_size,
            sliding_window=getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None,
        )
        logger.info("attention backend: %s (rejected: %s)", self.attn_selection.name, self.attn_selection.rejected)
        model = load_model(
            self.model_path,
            model_cls=model_cls,
            attn_backend=self.attn_selection.backend_cls,
            dtype=self.dtype,
            device=self.device,
            hf_config=self.hf_config,
        )
        self.platform.optimize_model(model)
        if config.device.compile_model:
            compile_outside_attention(model)

        drafter_cls = None
        if config.speculative.method is not None:
            drafter_cls = plugin_manager.registry("drafter").load(config.speculative.method)
        num_blocks = self._determine_num_blocks(model, drafter_cls)
        self.max_model_len = self._determine_max_model_len(num_blocks * block_size)
        self.vocab_size = hf.vocab_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            block_size,
            enable_caching=config.cache.enable_prefix_caching,
            hash_algo=config.cache.prefix_caching_hash_algo,
        )
        from pagedllm.engine.tokenizer import config_eos_token_id

        # The tokenizer loads only when the first structured-output request
        # needs a grammar backend (xgrammar's TokenizerInfo).
        self.structured_output_manager = StructuredOutputManager(
            config.structured_output,
            vocab_size=self.vocab_size,
            tokenizer=config.model.tokenizer or str(self.model_path),
            eos_token_id=config_eos_token_id(self.hf_config),
            max_num_rows=config.scheduler.max_num_seqs,
        )
        drafter = self._build_drafter(drafter_cls, model, num_blocks) if drafter_cls is not None else None
        num_spec_tokens = config.speculative.num_speculative_tokens if drafter is not None else 0
        self.kv_connector = self._build_kv_connector(model) if config.kv_transfer.connector else None
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache_manager,
            self.max_model_len,
            self.structured_output_manager,
            num_spec_tokens=num_spec_tokens,
            num_lookahead_tokens=num_spec_tokens if drafter is not None and drafter.needs_lookahead_slots else 0,
            kv_connector=self.kv_connector,
        )
        self.model_runner = ModelRunner(
            model,
            self.attn_selection.backend_cls,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            device=self.device,
            vocab_size=self.vocab_size,
            seed=config.model.seed,
        )
        self.model_runner.drafter = drafter
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.model_runner.kv_caches)
            self.model_runner.kv_connector = self.kv_connector
        self._maybe_capture_decode_graphs(model)
        # PAGEDLLM_DEBUG_KV=1 checks the block invariant after every step.
        self.check_kv_invariants = os.environ.get("PAGEDLLM_DEBUG_KV") == "1"
        # Tokens the last step() computed (the server's iteration_tokens_total).
        self.num_scheduled_tokens = 0
        plugin_manager.hook.on_engine_start(config=config)

    # --------------------------------------------------------------- sizing

    def _maybe_capture_decode_graphs(self, model: torch.nn.Module) -> None:
        device_config = self.config.device
        backend_cls = self.attn_selection.backend_cls
        block_size = self.config.cache.block_size
        if device_config.enforce_eager or not self.platform.supports_graph_capture():
            return
        if not backend_cls.supports_graph_capture(block_size):
            logger.info("decode graphs: off (attention backend %s cannot be captured)", self.attn_selection.name)
            return
        sizes = device_config.cuda_graph_sizes or default_graph_sizes(self.config.scheduler.max_num_seqs)
        runner = DecodeGraphRunner(
            model,
            backend_cls,
            self.platform,
            sizes=sizes,
            max_model_len=self.max_model_len,
            block_size=block_size,
            device=self.device,
        )
        runner.capture()
        self.model_runner.graph_runner = runner
        logger.info("decode graphs captured for batch sizes %s", runner.sizes)

    def _build_kv_connector(self, model: torch.nn.Module) -> KVConnectorBase:
        transfer = self.config.kv_transfer
        registry = get_plugin_manager().registry("kv_connector")
        connector_cls = registry.load(transfer.connector)  # UnknownComponentError lists the names
        roles = registry.get(transfer.connector).metadata.get("roles")
        if roles is not None and transfer.role not in roles:
            raise ConfigError("kv_transfer.role", transfer.role, f"{', '.join(roles)} for connector {transfer.connector!r}")
        num_layers = len(model.get_attention_layers())
        block_size = self.config.cache.block_size
        context = KVConnectorContext(
            model_path=str(self.model_path),
            model_fingerprint=model_fingerprint(
                str(self.model_path), self.dtype, block_size, num_layers, self.num_kv_heads, self.head_size
            ),
            block_size=block_size,
            num_layers=num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            device=self.device,
        )
        connector = connector_cls(transfer, context)
        logger.info("kv transfer: %s", connector.describe())
        return connector

    def _build_drafter(self, drafter_cls: type[Drafter], model: torch.nn.Module, num_blocks: int) -> Drafter:
        context = DrafterContext(
            target_model=model,
            attn_backend=self.attn_selection.backend_cls,
            device=self.device,
            dtype=self.dtype,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            num_blocks=num_blocks,
            block_size=self.config.cache.block_size,
        )
        drafter = drafter_cls(self.config.speculative, context)
        logger.info(
            "speculative decoding: %s, k=%d", self.config.speculative.method,
            self.config.speculative.num_speculative_tokens,
        )
        return drafter

    def _determine_num_blocks(self, model: torch.nn.Module, drafter_cls: type[Drafter] | None = None) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        num_layers = len(model.get_attention_layers())
        bytes_per_block = (
            2 * num_layers * cache.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize
        )
        if drafter_cls is not None:
            # A model drafter's cache has as many blocks as the target's.
            bytes_per_block += drafter_cls.kv_cache_bytes_per_block(self.config.speculative, cache.block_size, self.dtype)
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            scheduler = self.config.scheduler
            budget = self.platform.kv_cache_budget_bytes(
                cache.gpu_memory_utilization,
                functools.partial(
                    profile_run,
                    model,
                    self.attn_selection.backend_cls,
                    num_tokens=min(scheduler.max_num_batched_tokens, self._model_position_limit()),
                    num_logit_rows=scheduler.max_num_seqs,
                    block_size=cache.block_size,
                    num_kv_heads=self.num_kv_heads,
                    head_size=self.head_size,
                    dtype=self.dtype,
                    device=self.device,
                ),
            )
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ConfigError(
                "cache.kv_cache_memory_bytes", budget, f">= {bytes_per_block} (one block of this model)"
            )
        return num_blocks

    def _model_position_limit(self) -> int:
        return self.config.model.max_model_len or getattr(self.hf_config, "max_position_embeddings", None) or 1 << 30

    def _determine_max_model_len(self, kv_capacity_tokens: int) -> int:
        configured = self.config.model.max_model_len
        model_limit = getattr(self.hf_config, "max_position_embeddings", None)
        if configured is None:
            max_model_len = model_limit or kv_capacity_tokens
            if max_model_len > kv_capacity_tokens:
                logger.warning(
                    "max_model_len lowered from %d to %d: the KV cache holds no more tokens",
                    max_model_len,
                    kv_capacity_tokens,
                )
                max_model_len = kv_capacity_tokens
            return max_model_len
        if model_limit is not None and configured > model_limit:
            raise ConfigError("model.max_model_len", configured, f"<= {model_limit} (max_position_embeddings)")
        if configured > kv_capacity_tokens:
            raise ConfigError(
                "model.max_model_len",
                configured,
                f"<= {kv_capacity_tokens} tokens, what the KV cache holds; raise cache.num_kv_blocks "
                "or cache.kv_cache_memory_bytes",
            )
        return configured

    # ---------------------------------------------------------------- intake

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        validate_prompt(prompt_token_ids, max_model_len=self.max_model_len, vocab_size=self.vocab_size)

    def add_request(self, request: Request) -> None:
        self.validate_prompt(request.prompt_token_ids)
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", request.request_id, "a request with this id is still running")
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ loop

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens  # for iteration stats
        if scheduler_output.is_empty and not outputs:
            # Only grammars compiling: wait for one instead of spinning.
            self.structured_output_manager.wait_for_compiles(GRAMMAR_WAIT_S)
        if self.check_kv_invariants:
            self.check_invariants()
        return outputs

    def check_invariants(self) -> None:
        self.kv_cache_manager.check_invariants(self.scheduler.requests_holding_blocks())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()


def validate_prompt(prompt_token_ids: list[int], *, max_model_len: int, vocab_size: int) -> None:
    """The prompt checks of `EngineCore.add_request`; the API process runs them
    too (with the core's READY figures) so a bad prompt is a 400 before it is sent."""
    num_tokens = len(prompt_token_ids)
    if num_tokens == 0:
        raise InvalidRequestError("prompt", prompt_token_ids, "the prompt must contain at least one token")
    if num_tokens >= max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"<{num_tokens} tokens>",
            f"the prompt has {num_tokens} tokens but max_model_len is {max_model_len} "
            "and at least one token must be generated",
        )
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        # A client's id may have thousands of digits: echo it shortened.
        raise InvalidRequestError(
            "prompt_token_ids", [short_value(t, 24) for t in bad[:5]], f"token ids must be in [0, {vocab_size})"
        )


def _config_dtype(hf_config: PretrainedConfig) -> torch.dtype:
    import torch

    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
