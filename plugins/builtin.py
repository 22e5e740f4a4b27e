"""The built-in components, registered through the same hooks as any plugin.

NOTE: nothing here may import a target module: registration must stay cheap
and must work before (or without) the heavy packages being installed.
"""

from __future__ import annotations

import os

from pagedllm.plugins.hookspecs import RegisterFn, hookimpl

ALL_FLOAT_DTYPES = ["float32", "float16", "bfloat16"]
# fp8 KV cache storage (cache.cache_dtype fp8 / fp8_e5m2); flash_attn declares
# none: its kernel reads the cache in the compute dtype.
FP8_KV_CACHE_DTYPES = ["float8_e4m3fn", "float8_e5m2"]


def _triton_device_types() -> list[str]:
    # Under TRITON_INTERPRET=1 Triton kernels run on CPU tensors (slowly): the
    # backend can then be forced on CPU (never chosen by "auto": the CPU
    # platform does not list it), which is how CI proves the kernels.
    return ["cuda", "cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else ["cuda"]


@hookimpl
def register_platforms(register: RegisterFn) -> None:
    register("cpu", "pagedllm.platforms.cpu.platform:CpuPlatform", device_type="cpu")
    register("cuda", "pagedllm.platforms.cuda:CudaPlatform", device_type="cuda")


@hookimpl
def register_attention_backends(register: RegisterFn) -> None:
    register(
        "cpu",
        "pagedllm.attention_backends.torch_native:TorchNativeBackend",
        # Its name until it ran the CPU's C kernels; still selects it.
        aliases=["torch_native"],
        # Its torch path runs anywhere; on cuda it is the last resort in priority.
        device_types=["cpu", "cuda"],
        dtypes=ALL_FLOAT_DTYPES,
        supports_sliding_window=True,
        supports_logits_soft_cap=True,
        supports_sinks=True,
        # Latent attention (DeepSeek): torch, absorbed (attention_backends/torch_mla.py).
        supports_mla=True,
        kv_cache_dtypes=FP8_KV_CACHE_DTYPES,
    )
    register(
        "triton",
        "pagedllm.attention_backends.triton:TritonBackend",
        device_types=_triton_device_types(),
        min_capability=(7, 0),  # Volta and Turing (7.5) included
        dtypes=ALL_FLOAT_DTYPES,
        # NOTE: the kernels pad the head to a power of two (at least 16) and
        # mask: any size up to 256 (tests/test_attention_triton.py runs 32-192).
        max_head_size=256,
        block_size_multiple=16,
        requires=["triton"],
        supports_sliding_window=True,
        supports_logits_soft_cap=True,
        supports_sinks=True,
        # Latent attention (DeepSeek): absorbed Triton kernel over the latent
        # cache, fresh prefills expanded in torch (attention_backends/triton/mla.py).
        supports_mla=True,
        kv_cache_dtypes=FP8_KV_CACHE_DTYPES,
        # Triton compiles float8e4nv for Ada/Hopper (8.9) and newer only.
        kv_cache_dtype_min_capability={"float8_e4m3fn": (8, 9)},
    )
    register(
        "flash_attn",
        "pagedllm.attention_backends.flash_attn:FlashAttentionBackend",
        device_types=["cuda"],
        min_capability=(8, 0),  # FlashAttention-2 needs Ampere or newer
        dtypes=["float16", "bfloat16"],
        head_size_multiple=8,
        max_head_size=256,
        block_size_multiple=16,
        requires=["flash_attn"],
        supports_sliding_window=True,
        supports_logits_soft_cap=True,
        # flash_attn_varlen_func has no sinks (the triton backend serves GPT-OSS).
    )


@hookimpl
def register_models(register: RegisterFn) -> None:
    llama = "pagedllm.model_registry.models.llama:LlamaForCausalLM"
    register("LlamaForCausalLM", llama)
    register("MistralForCausalLM", llama)  # same graph; sliding window via config
    register("Qwen2ForCausalLM", "pagedllm.model_registry.models.qwen2:Qwen2ForCausalLM")
    register("Qwen3ForCausalLM", "pagedllm.model_registry.models.qwen3:Qwen3ForCausalLM")
    register("GptOssForCausalLM", "pagedllm.model_registry.models.gpt_oss:GptOssForCausalLM")
    register("Qwen2MoeForCausalLM", "pagedllm.model_registry.models.qwen2_moe:Qwen2MoeForCausalLM")
    register("Qwen3MoeForCausalLM", "pagedllm.model_registry.models.qwen3_moe:Qwen3MoeForCausalLM")
    register("MixtralForCausalLM", "pagedllm.model_registry.models.mixtral:MixtralForCausalLM")
    register("Phi3ForCausalLM", "pagedllm.model_registry.models.phi3:Phi3ForCausalLM")
    register("Gemma2ForCausalLM", "pagedllm.model_registry.models.gemma2:Gemma2ForCausalLM")
    register("Gemma3ForCausalLM", "pagedllm.model_registry.models.gemma3:Gemma3ForCausalLM")
    register("GraniteForCausalLM", "pagedllm.model_registry.models.granite:GraniteForCausalLM")
    register("Olmo2ForCausalLM", "pagedllm.model_registry.models.olmo2:Olmo2ForCausalLM")
    register("DeepseekV2ForCausalLM", "pagedllm.model_registry.models.deepseek_v2:DeepseekV2ForCausalLM")
    register("DeepseekV3ForCausalLM", "pagedllm.model_registry.models.deepseek_v2:DeepseekV3ForCausalLM")


@hookimpl
def register_drafters(register: RegisterFn) -> None:
    register("ngram", "pagedllm.spec_decode.ngram:NgramDrafter", needs_model=False)
    register("suffix", "pagedllm.spec_decode.suffix:SuffixDrafter", needs_model=False)
    register("draft_model", "pagedllm.spec_decode.draft_model:DraftModelDrafter", needs_model=True)
    register("eagle", "pagedllm.spec_decode.eagle:EagleDrafter", needs_model=True)
    register("eagle3", "pagedllm.spec_decode.eagle3:Eagle3Drafter", needs_model=True)


@hookimpl
def register_spec_policies(register: RegisterFn) -> None:
    # How many tokens each request drafts per step: where measured acceptance
    # pays for measured cost (default); vLLM's disable_by_batch_size; always k.
    register("adaptive", "pagedllm.spec_decode.adaptive_policy:AdaptivePolicy")
    register("batch_size", "pagedllm.spec_decode.policy:BatchSizePolicy")
    register("always", "pagedllm.spec_decode.policy:AlwaysPolicy")


@hookimpl
def register_grammar_backends(register: RegisterFn) -> None:
    register(
        "xgrammar",
        "pagedllm.structured_output.xgrammar_backend:XgrammarBackend",
        kinds=["json", "json_object", "regex", "choice", "grammar", "structural_tag"],
        requires=["xgrammar"],
    )


@hookimpl
def register_kv_connectors(register: RegisterFn) -> None:
    register("shared_storage", "pagedllm.kv_connectors.shared_storage:SharedStorageConnector",
             roles=["producer", "consumer", "both"], supports_tensor_parallel=True)
    register("cpu_offload", "pagedllm.kv_connectors.cpu_offload:CpuOffloadConnector", roles=["both"],
             supports_tensor_parallel=True)


@hookimpl
def register_model_sources(register: RegisterFn) -> None:
    # The shipped models (pagedllm-tiny and its draft and EAGLE heads) by alias.
    register("tiny", "pagedllm.model_registry.tiny:ShippedModelSource")


@hookimpl
def register_executors(register: RegisterFn) -> None:
    # One in-process worker; one process per rank on this host; one Ray actor
    # per rank on a Ray cluster (the optional extra: pip install 'pagedllm[ray]').
    register("uni", "pagedllm.executors.uni:UniProcExecutor", supports_tensor_parallel=False)
    register("mp", "pagedllm.executors.mp:MultiprocExecutor", supports_tensor_parallel=True)
    register("ray", "pagedllm.executors.ray_executor:RayExecutor", supports_tensor_parallel=True, requires=["ray"])


@hookimpl
def register_routers(register: RegisterFn) -> None:
    # Where a request goes among data-parallel engines: in turn; vLLM's load
    # score; the replica caching the longest prefix of its prompt (default).
    register("round_robin", "pagedllm.routers.round_robin:RoundRobinPolicy")
    register("least_loaded", "pagedllm.routers.least_loaded:LeastLoadedPolicy")
    register("prefix_aware", "pagedllm.routers.prefix_aware:PrefixAwarePolicy")


@hookimpl
def register_quantization_methods(register: RegisterFn) -> None:
    # Weight-only int8, per output channel, quantized from the float checkpoint at load.
    register("int8", "pagedllm.quantization.int8:Int8WeightOnlyMethod")
    # Checkpoints quantized by their writers, each chosen by config.json's quant_method:
    # GPTQ and AWQ (4-bit; GPTQ 8-bit too) and compressed-tensors (llm-compressor's INT8 / FP8 / W4A16).
    register("gptq", "pagedllm.quantization.gptq:GPTQMethod", checkpoint_formats=["gptq"], quantizes_float=False)
    register("awq", "pagedllm.quantization.awq:AWQMethod", checkpoint_formats=["awq"], quantizes_float=False)
    register("compressed-tensors", "pagedllm.quantization.compressed_tensors.method:CompressedTensorsMethod",
             checkpoint_formats=["compressed-tensors"], quantizes_float=False)
    # GGUF files (llama.cpp): Q8_0, Q6_K and Q4_K linear weights kept quantized; the rest dequantized at load.
    register("gguf", "pagedllm.quantization.gguf:GGUFMethod", checkpoint_formats=["gguf"], quantizes_float=False)


@hookimpl
def register_tool_parsers(register: RegisterFn) -> None:
    # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes 2 Pro, Qwen2.5, Qwen3).
    register("hermes", "pagedllm.tool_parsers.hermes:HermesToolParser")


@hookimpl
def register_reasoning_parsers(register: RegisterFn) -> None:
    # <think>...</think> (vLLM's deepseek_r1; Qwen3 and QwQ write the same tags).
    register("think", "pagedllm.reasoning.think:ThinkReasoningParser")


@hookimpl
def register_stat_loggers(register: RegisterFn) -> None:
    # What the API process does with the engine's stats: the /metrics
    # collectors, and the periodic throughput line (both run by default).
    register("prometheus", "pagedllm.stat_loggers.prometheus:PrometheusStatLogger")
    register("logging", "pagedllm.stat_loggers.log_line:LoggingStatLogger")


@hookimpl
def register_lora_resolvers(register: RegisterFn) -> None:
    # <lora.lora_resolver_cache_dir>/<name>/ (vLLM's VLLM_LORA_RESOLVER_CACHE_DIR).
    register("filesystem", "pagedllm.lora.resolver:FilesystemResolver")
