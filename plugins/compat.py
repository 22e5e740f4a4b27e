"""The plugin API version, and the check of the range a plugin declares.

A plugin module (the object its entry point names) declares the plugin API
versions it was written for as a PEP 440 specifier string::

    PAGEDLLM_API_VERSION = ">=1.0,<2"

``pagedllm.plugins.API_VERSION`` is checked against it when the entry point is
loaded, before any hook is registered. A plugin that declares nothing is
loaded (and shown as "undeclared" by ``pagedllm plugins list``); one whose
range excludes this version is skipped and recorded as a load error (an
error in strict mode). docs/plugins.md ("Compatibility") says what a major,
minor and patch bump of API_VERSION may change.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

# Semantic version of the plugin API (hookspecs, the register() contract, the
# base classes plugins subclass). Bump rules: docs/plugins.md "Compatibility".
# 1.1: grammar backends whose validate/compile name `max_whitespace` get it.
# 1.2: `KVCacheLayout` and `AttentionBackend.get_kv_cache_layout` (the default
#      `get_kv_cache_shape` follows it); `KVConnectorContext.kv_cache_layout`
#      and block_io's `layout` argument. Typed kinds: `PluginKind`, the typed
#      registries (`pm.models`, ...), `AttentionCapabilities` and the other
#      kinds' metadata types (unknown keys are refused at register), the
#      `ModelForCausalLM` interface (1.0 duck-typed models still load); the
#      model-source kind (`register_model_sources`, `ModelSource`).
# 1.3: the executor kind (`register_executors`, `Executor`, `ExecutorInfo`,
#      `pm.executors`) and the `parallel` config section.
#      Platforms name their process groups' backend (`Platform.dist_backend`)
#      and may bring their own collectives (`Platform.get_device_communicator`,
#      `DeviceCommunicator`); 1.0 platforms get gloo and torch.distributed's.
#      `Platform.init_rank` places a rank of a multi-rank executor (default:
#      its share of the CPU cores).
#      Models declare `ModelForCausalLM.supports_tensor_parallel` (default
#      False: 1.0 and 1.2 models run at tensor_parallel_size 1 only).
# 1.4: KV connectors at tensor_parallel_size > 1: `KVConnectorInfo.
#      supports_tensor_parallel`, `KVConnectorContext.side` / `tp_size` /
#      `tp_rank` / `rank_fingerprints`, `KVConnectorBase.metadata_cls`,
#      `KVConnectorOutput`; `get_finished` runs on the worker side after every
#      step and names each finished request once (1.3 connectors that keep
#      blocks until a save finishes track the ids they are given).
#      The router kind (`register_routers`, `RoutingPolicy`, `RouterInfo`,
#      `pm.routers`) and the prefix cache's KV events (`core.kv_cache.events`).
# 1.5: the quantization-method kind (`register_quantization_methods`,
#      `QuantizationMethod`, `QuantizationInfo`, `pm.quantization_methods`,
#      `model.quantization`).
# 1.6: fp8 KV cache storage (`cache.cache_dtype`): `AttentionCapabilities.
#      kv_cache_dtypes` / `kv_cache_dtype_min_capability` (a backend that
#      declares none is not chosen for an fp8 cache), `AttentionImpl.k_scale`
#      / `v_scale`, `DrafterContext.kv_cache_dtype`, `Platform.
#      supports_kv_cache_dtype` / `resolve_kv_cache_dtype`; `KVConnectorContext.
#      dtype` and `Drafter.kv_cache_bytes_per_block`'s dtype are the cache's.
# 1.7: the stat-logger kind (`register_stat_loggers`, `StatLoggerBase`,
#      `StatLoggerInfo`, `pm.stat_loggers`, `server.stat_loggers`) and custom
#      figures (`core.custom_stats`: `MetricSpec`, a component's
#      `custom_metrics` + `get_custom_stats()`, `SchedulerStats.custom_stats`);
#      the tool-call parser kind (`register_tool_parsers`, `ToolParser`,
#      `ToolParserInfo`, `pm.tool_parsers`, `server.tool_call_parser`); the
#      reasoning-parser kind (`register_reasoning_parsers`, `ReasoningParser`,
#      `ReasoningParserInfo`, `pm.reasoning_parsers`) and the logits-processor
#      kind (`register_logits_processors`), added beside it; per-plugin
#      options (`register_plugin_config` or `PAGEDLLM_PLUGIN_CONFIG`,
#      `plugins.config`, `pm.plugin_config(Model)`); the conformance kit
#      (`pagedllm.testing`).
# 1.8: `GrammarBackend.serialize` / `deserialize` (optional, with defaults):
#      the API side's compile of a slow spec is loaded by the engine core.
# 1.9: one op registry (`model_registry/layers/ops.py`): platforms and
#      quantization methods offer kernels through `Platform.register_layer_ops`
#      / `QuantizationMethod.register_layer_ops` (the 1.x
#      `op_kernels.register_op_kernel` still works); registrations may name
#      `aliases` (the `torch_native` backend is now `cpu`, its old name an
#      alias). KV connectors get their role (`KVConnectorRole`) and are built
#      once per side under every executor (`uni` no longer shares one
#      instance between the scheduler and the rank), the scheduler side from
#      the ranks' `KVConnectorShard`s. `SamplingParams` is a msgspec Struct
#      (same fields and constructor).
# 1.10: `Drafter.finish_requests` (default no-op): the model runner names the
#      requests that finished or were aborted, so a stateful drafter (suffix)
#      frees what it keeps per request. `Drafter.capture_graphs(platform,
#      sizes)` (default: nothing): a drafter captures its forwards as graphs
#      (the model drafters their single-token draft steps).
#      The speculation-policy kind (`register_spec_policies`,
#      `SpeculationPolicy`, `SpecPolicyInfo`, `pm.spec_policies`,
#      `speculative.policy`, `speculative.disable_by_batch_size`) and the
#      measurements it reads (`spec_decode.measurements.SpecMeasurements`);
#      `SpeculationPolicy.keep_drafts` (default: keep) sees the drafts the
#      drafter found and may drop them all for a plain step.
# 1.11: attention capabilities a model may need: `AttentionCapabilities.
#      supports_logits_soft_cap` / `supports_sinks` (default False: a backend
#      that does not declare them is not chosen for such a model);
#      `AttentionRequirements` (every layer's head size, window, soft cap,
#      sinks), which `ModelForCausalLM.attention_requirements(hf_config)`
#      returns and the selector checks (`requirements=`); `AttentionImpl`
#      takes `sinks` (a [num_heads] tensor, passed only when the model has them).
# 1.12: `QuantizationMethod.quantize_moe(layer, prefix)` (default: False, the
#      experts stay as loaded): a method may convert MoE layers' expert
#      weights and offer their "fused_moe" op.
# 1.13: latent attention (MLA): `AttentionCapabilities.supports_mla` (default
#      False: a backend that does not declare it is not chosen for a latent
#      model), `AttentionRequirements.latent_kv_size`,
#      `AttentionBackend.get_mla_impl_cls` / `get_mla_kv_cache_layout`
#      (attention_backends/mla.py: `MLAAttentionImpl`, `MLAKVCacheLayout`),
#      `KVCacheLayout.block_shape`, the `MLAAttentionSpec` KV cache spec.
# 1.14: quantized checkpoints: `QuantizationInfo.checkpoint_formats` /
#      `quantizes_float`, `QuantizationMethod.from_checkpoint_config` /
#      `create_weights` / `create_moe_weights` / `create_attention_weights` /
#      `quantize_attention`, `UnsupportedCheckpointError` (defaults: the method
#      reads no checkpoint format; 1.13 methods are unchanged).
# 1.15: the LoRA-resolver kind (`register_lora_resolvers`, `LoRAResolver`,
#      `LoRAResolverInfo`, `pm.lora_resolvers`, `lora.lora_resolvers`).
API_VERSION = "1.15.0"
# The module attribute a plugin declares its supported range in.
API_VERSION_ATTR = "PAGEDLLM_API_VERSION"


@dataclass(frozen=True)
class ApiCompatibility:
    """What a plugin declared and whether this pagedllm satisfies it."""

    declared: str | None  # the specifier as written; None = undeclared
    compatible: bool
    reason: str | None = None  # why not, naming both versions

    @property
    def label(self) -> str:
        """``">=1.0,<2 (compatible)"``, ``"undeclared"``: for ``plugins list``."""
        if self.declared is None:
            return "undeclared"
        return f"{self.declared} ({'compatible' if self.compatible else 'incompatible'})"


def check_api_compatibility(plugin: object, api_version: str = API_VERSION) -> ApiCompatibility:
    """Read ``plugin.PAGEDLLM_API_VERSION`` and test ``api_version`` against it."""
    declared = getattr(plugin, API_VERSION_ATTR, None)
    if declared is None:
        return ApiCompatibility(None, True)
    if not isinstance(declared, str):
        return ApiCompatibility(
            repr(declared),
            False,
            f"{API_VERSION_ATTR} = {declared!r} is not a version specifier string such as '>=1.0,<2'",
        )
    try:
        specifier = SpecifierSet(declared)
    except InvalidSpecifier as exc:
        return ApiCompatibility(declared, False, f"{API_VERSION_ATTR} = {declared!r} is not a valid specifier: {exc}")
    if specifier.contains(Version(api_version), prereleases=True):
        return ApiCompatibility(declared, True)
    return ApiCompatibility(
        declared,
        False,
        f"the plugin supports pagedllm plugin API {declared!r}, this pagedllm provides plugin API {api_version}",
    )


__all__ = ["API_VERSION", "API_VERSION_ATTR", "ApiCompatibility", "check_api_compatibility"]
