"""Every hook a pagedllm plugin can implement. This file is the plugin API.

A plugin is a module (or object) whose functions carry the ``@hookimpl``
marker and are named after the hooks below. Built-ins (plugins/builtin.py)
go through exactly these hooks.

Registration hooks are callback style (as in Simon Willison's ``llm``): the
hook receives a ``register`` function and calls it once per component::

    @hookimpl
    def register_attention_backends(register):
        register(
            "my_backend",
            "my_pkg.attention:MyBackend",   # imported only when selected
            device_types=["cuda"],
            min_capability=(8, 0),
            dtypes=["float16", "bfloat16"],
        )

``register(name, target, **metadata)``:

- ``name``: the key users configure (``attention_backend="my_backend"``);
  unique within its kind across every plugin, a collision is an error.
- ``target``: ``"package.module:Attr"`` (imported lazily, on first use) or a
  callable. A class is used as is; any other callable is a zero-argument
  factory called once, on first use, that returns the class. Either way the
  class must subclass the kind's interface (named in each hook below); that
  is checked once, on first load, and a PluginError names the plugin, the
  target and the interface.
- ``metadata``: facts the engine needs *before* importing the target. Each
  kind accepts a fixed set of keywords, built into a frozen dataclass when
  ``register`` is called (``Registration.info``; ``Registration.metadata``
  keeps the keywords as given). An unknown or misspelt key, or a value of the
  wrong type, leaves that one registration out and is reported like a plugin
  that failed to load (``pagedllm plugins list``, the log; an error with
  ``plugins.strict``).

Each kind is a :class:`pagedllm.plugins.kinds.PluginKind`; its registry is
``get_plugin_manager().registry(kind)``, or typed: ``.platforms``,
``.attention_backends``, ``.models``, ``.drafters``, ``.spec_policies``, ``.grammar_backends``,
``.kv_connectors``, ``.model_sources``, ``.executors``, ``.routers``,
``.quantization_methods``, ``.tool_parsers``, ``.reasoning_parsers``, ``.logits_processors``,
``.stat_loggers``, ``.lora_resolvers``.

None of these hooks is ``firstresult``: every plugin gets called, and the
return value is ignored.

A plugin module declares the plugin API range it supports (checked against
``pagedllm.plugins.API_VERSION`` before its hooks are registered; an
incompatible plugin is skipped, or fails in strict mode)::

    PAGEDLLM_API_VERSION = ">=1.0,<2"

docs/plugins.md documents every hook below with an example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    from pydantic import BaseModel

    from pagedllm.core.config import EngineConfig

PROJECT_NAME = "pagedllm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Target = str | Callable[[], Any]


class RegisterFn(Protocol):
    """The ``register`` callback passed to every ``register_*`` hook."""

    def __call__(self, name: str, target: Target, /, **metadata: Any) -> None: ...


class RegisterConfigFn(Protocol):
    """The ``register`` callback passed to ``register_plugin_config``."""

    def __call__(self, model: type[BaseModel], /) -> None: ...


@hookspec
def register_platforms(register: RegisterFn) -> None:
    """Register device platforms (kind ``platform``).

    :param register: call ``register(name, "pkg.mod:PlatformCls", device_type=...)``
        once per platform; the target must be a subclass of
        :class:`pagedllm.platforms.interface.Platform`, built with no
        arguments. Metadata (:class:`pagedllm.plugins.metadata.PlatformInfo`):
        ``device_type`` ("cpu", "cuda", ...), informational.
    :return: nothing; the return value is ignored.

    Called lazily the first time the platform registry is needed (engine
    build in engine/builder.py, ``pagedllm env``, ``pagedllm plugins list``),
    and again after plugins are registered or unregistered. ``device.platform="name"`` selects
    a platform. ``"auto"`` asks every plugin platform's ``is_available()``:
    exactly one available plugin platform wins over the built-ins, two is a
    ConfigError naming both; with none, cuda when available, else cpu. So an
    out-of-tree platform gates itself in ``is_available`` (a device probe, an
    env var).
    """


@hookspec
def register_attention_backends(register: RegisterFn) -> None:
    """Register attention backends (kind ``attention_backend``).

    :param register: call ``register(name, "pkg.mod:BackendCls", **metadata)``;
        the target must be a subclass of
        :class:`pagedllm.attention_backends.base.AttentionBackend`. The
        metadata builds an
        :class:`~pagedllm.attention_backends.base.AttentionCapabilities`, what
        the selector (attention_backends/selector.py) checks *without
        importing the backend*: ``device_types`` (list of "cpu"/"cuda"),
        ``min_capability`` / ``max_capability`` (``(major, minor)``),
        ``dtypes`` (names such as "float16"), ``head_sizes`` (explicit list)
        or ``head_size_multiple`` plus ``max_head_size``,
        ``block_size_multiple``, ``requires`` (import names of packages that
        must be installed), ``supports_sliding_window``. A missing key means
        "no restriction", except ``supports_sliding_window`` which defaults to
        False; any other key is refused.
    :return: nothing; the return value is ignored.

    Called lazily when the attention-backend registry is first needed
    (backend selection when the engine is built, ``pagedllm env``,
    ``pagedllm plugins list``).
    """


@hookspec
def register_models(register: RegisterFn) -> None:
    """Register model architectures (kind ``model``).

    :param register: call ``register(architecture, "pkg.mod:ModelCls")`` where
        ``architecture`` is the name found in a Hugging Face ``config.json``
        ``architectures`` list (e.g. ``"LlamaForCausalLM"``), or that
        ``model.architecture`` names. No metadata keywords. The class
        implements :class:`pagedllm.model_registry.interface.ModelForCausalLM`
        (``forward``, ``compute_logits``, ``load_weights``,
        ``get_attention_layers``; optionally ``packed_modules_mapping`` and
        ``is_ignored_weight``), by subclassing it or, as plugin API 1.0
        models do, by being an ``nn.Module`` that defines the four methods.
        It is built as ``ModelCls(hf_config, attn_backend, dtype=dtype)``
        on the target device (model_registry/loader.py ``load_model``).
    :return: nothing; the return value is ignored.

    Called lazily when the model registry is first needed: building the
    engine (the target model) and the ``draft_model`` drafter (its draft
    model).
    """


@hookspec
def register_drafters(register: RegisterFn) -> None:
    """Register speculative-decoding drafters (kind ``drafter``).

    :param register: call ``register(method, "pkg.mod:DrafterCls", **metadata)``;
        ``method`` is what ``speculative.method`` selects (e.g. ``"ngram"``).
        The target must be a subclass of
        :class:`pagedllm.spec_decode.interface.Drafter`, built as
        ``DrafterCls(speculative_config, drafter_context)`` (the config's
        ``model`` resolved to a folder). Metadata
        (:class:`pagedllm.plugins.metadata.DrafterInfo`): ``needs_model``
        (bool, whether ``speculative.model`` is required), informational.
    :return: nothing; the return value is ignored.

    Called lazily when the drafter registry is first needed (building an
    engine with ``speculative.method`` set, ``pagedllm plugins list``). Built-ins: ``ngram``, ``suffix``,
    ``draft_model``, ``eagle``, ``eagle3``.
    """


@hookspec
def register_spec_policies(register: RegisterFn) -> None:
    """Register speculation policies (kind ``spec_policy``, plugin API 1.10).

    :param register: call ``register(name, "pkg.mod:PolicyCls")``; ``name``
        is what ``speculative.policy`` selects. The target must be a subclass
        of :class:`pagedllm.spec_decode.policy.SpeculationPolicy`, built as
        ``PolicyCls(speculative_config)``; after every step its
        ``num_drafts(req_ids, measurements)`` says how many tokens each
        request drafts for its next step (0..``num_speculative_tokens``),
        from :class:`pagedllm.spec_decode.measurements.SpecMeasurements`
        (per-request acceptance, per-batch-size step costs). No metadata
        keywords (:class:`pagedllm.plugins.metadata.SpecPolicyInfo`).
    :return: nothing; the return value is ignored.

    Called lazily when the policy registry is first needed (building an
    engine with ``speculative.method`` set, ``pagedllm plugins list``).
    Built-ins: ``adaptive`` (default: drafts where measured acceptance pays
    for the measured cost), ``batch_size`` (vLLM's ``disable_by_batch_size``)
    and ``always``.
    """


@hookspec
def register_grammar_backends(register: RegisterFn) -> None:
    """Register structured-output grammar backends (kind ``grammar_backend``).

    :param register: call ``register(name, "pkg.mod:GrammarBackendCls", **metadata)``;
        the target must be a subclass of
        :class:`pagedllm.structured_output.interface.GrammarBackend`.
        ``name`` is what ``structured_output.backend`` (engine default) or a
        request's ``structured_outputs.backend`` selects; built as
        ``GrammarBackendCls(tokenizer, vocab_size, eos_token_id, config)``.
        Metadata (:class:`pagedllm.plugins.metadata.GrammarBackendInfo`),
        informational: ``kinds`` (spec kinds it compiles; the class's
        ``supported_kinds`` is what is checked), ``requires`` (import names
        of the packages it needs).
    :return: nothing; the return value is ignored.

    Called lazily when the grammar-backend registry is first needed: the first
    request with structured output, in the API process (validation before
    scheduling, structured_output/manager.py) and in the engine core
    (compilation). Built-in: ``xgrammar``.
    """


@hookspec
def register_kv_connectors(register: RegisterFn) -> None:
    """Register KV-cache transfer connectors (kind ``kv_connector``).

    :param register: call ``register(name, "pkg.mod:ConnectorCls", roles=[...])``;
        ``name`` is what ``kv_transfer.connector`` selects. The target must
        be a subclass of :class:`pagedllm.kv_connectors.base.KVConnectorBase`,
        built as ``ConnectorCls(kv_transfer_config, kv_connector_context)``.
        Metadata (:class:`pagedllm.plugins.metadata.KVConnectorInfo`):
        ``roles``, the ``kv_transfer.role`` values it supports (another role
        is a ConfigError when the engine is built); absent = every role.
    :return: nothing; the return value is ignored.

    Called lazily when the KV-connector registry is first needed (building an
    engine with ``kv_transfer.connector`` set, ``pagedllm plugins list``).
    Built-ins: ``shared_storage``, ``cpu_offload``.
    """


@hookspec
def register_model_sources(register: RegisterFn) -> None:
    """Register model sources (kind ``model_source``, plugin API 1.2): names
    that stand for a model folder, so ``model: <name>`` (and
    ``speculative.model``, ``model.tokenizer``) may say the name.

    :param register: call ``register(name, "pkg.mod:SourceCls")``; the class
        subclasses :class:`pagedllm.model_registry.interface.ModelSource` and
        its ``resolve(name)`` returns the folder, or None for a name it does
        not know. ``name`` labels the source in ``pagedllm plugins list``.
    :return: nothing; the return value is ignored.

    Called lazily when a model name is first resolved (engine start, the
    tokenizer). Sources are asked in registration order (builtin first: its
    source ``tiny`` knows ``tiny``, ``tiny-draft``, ``tiny-eagle`` and the
    default model); the first answer wins, and a name no source knows is used
    as a folder or hub id.
    """


@hookspec
def register_executors(register: RegisterFn) -> None:
    """Register executors (kind ``executor``, plugin API 1.3): what starts
    the workers that run the model (one per rank), and relays each step to
    them.

    :param register: call ``register(name, "pkg.mod:ExecutorCls", **metadata)``;
        ``name`` is what ``parallel.distributed_executor_backend`` selects
        (``auto`` = ``uni`` at ``tensor_parallel_size`` 1). The target must be a
        subclass of :class:`pagedllm.executors.base.Executor`, built as
        ``ExecutorCls(engine_config)``; it starts its workers
        (:class:`pagedllm.worker.worker.Worker`) and loads the model on each.
        Metadata (:class:`pagedllm.plugins.metadata.ExecutorInfo`):
        ``supports_tensor_parallel`` (whether it runs more than one rank;
        without it, ``tensor_parallel_size`` > 1 is a ConfigError),
        ``requires`` (import names of the packages it needs).
    :return: nothing; the return value is ignored.

    Called lazily when the executor registry is first needed: building an
    engine (engine/builder.py, in the process that runs the engine core),
    ``pagedllm plugins list``. Built-in: ``uni`` (one in-process worker).
    """


@hookspec
def register_routers(register: RegisterFn) -> None:
    """Register routing policies (kind ``router``, plugin API 1.4): which of
    several data-parallel engines serves a request.

    :param register: call ``register(name, "pkg.mod:PolicyCls")``; ``name`` is
        what ``parallel.routing_policy`` selects. The target must be a subclass
        of :class:`pagedllm.routers.base.RoutingPolicy`, built with no
        arguments once per front end; its ``route(request, replicas)`` picks a
        live replica. No metadata keys
        (:class:`pagedllm.plugins.metadata.RouterInfo`).
    :return: nothing; the return value is ignored.

    Called lazily when the router registry is first needed: starting a front
    end over ``data_parallel_size`` > 1 engines, ``pagedllm plugins list``.
    Built-in: ``round_robin``, ``least_loaded`` (vLLM's score) and
    ``prefix_aware`` (the default: the replica caching the longest prefix).
    """


@hookspec
def register_quantization_methods(register: RegisterFn) -> None:
    """Register quantization methods (kind ``quantization_method``, plugin API
    1.5): how a model's linear layers store and multiply their weights.

    :param register: call ``register(name, "pkg.mod:MethodCls", **metadata)``;
        ``name`` is what ``model.quantization`` (``--quantization``,
        ``LLM(quantization=...)``) selects. The target must be a subclass of
        :class:`pagedllm.quantization.base.QuantizationMethod`, built with no
        arguments once per rank after the model's weights are loaded; its
        ``quantize_linear(layer, prefix)`` converts one linear layer's
        storage, and ``register_layer_ops(register)`` offers the GEMM over
        it as the layer's "linear" op (model_registry/layers/ops.py; a
        method that sets ``layer.apply_linear`` itself still works). Since
        1.12 ``quantize_moe(layer, prefix)`` (default False) may convert a
        mixture-of-experts layer's expert weights, its computation offered
        as the "fused_moe" op. Metadata
        (:class:`pagedllm.plugins.metadata.QuantizationInfo`):
        ``device_types``, ``dtypes`` (compute dtypes it runs) and
        ``requires``; a configuration outside them is a ConfigError before
        any weight is loaded.
    :return: nothing; the return value is ignored.

    Called lazily when the registry is first needed: a worker loading a model
    with ``model.quantization`` set, ``pagedllm plugins list``. Built-in:
    ``int8`` (weight-only, per output channel, quantized at load).
    """


@hookspec
def register_tool_parsers(register: RegisterFn) -> None:
    """Register tool-call parsers (kind ``tool_parser``, plugin API 1.7): how
    a model writes function calls, for chat requests with ``tool_choice="auto"``.

    :param register: call ``register(name, "pkg.mod:ParserCls")``; ``name`` is
        what ``server.tool_call_parser`` (``--tool-call-parser``) selects. The
        target must be a subclass of
        :class:`pagedllm.tool_parsers.base.ToolParser`, built as
        ``ParserCls(tokenizer)`` once per choice of a chat request; its
        ``extract_tool_calls(model_output, request)`` splits a whole output
        into content and calls, and ``extract_tool_calls_streaming(
        previous_text, current_text, delta_text, request)`` (then
        ``finish_streaming``) does the same incrementally. No metadata keys
        (:class:`pagedllm.plugins.metadata.ToolParserInfo`).
    :return: nothing; the return value is ignored.

    Called lazily when the tool-parser registry is first needed: the API
    server starting with ``--tool-call-parser`` (an unknown name is a
    ConfigError listing the registered ones), ``pagedllm plugins list``.
    Built-in: ``hermes`` (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``).
    """


@hookspec
def register_reasoning_parsers(register: RegisterFn) -> None:
    """Register reasoning parsers (kind ``reasoning_parser``): split a
    reasoning model's reply into ``reasoning_content`` and ``content``.

    :param register: call ``register(name, "pkg.mod:ParserCls")``; ``name`` is
        what ``structured_output.reasoning_parser`` (``--reasoning-parser``,
        ``LLM(reasoning_parser=...)``) selects. The target must be a subclass
        of :class:`pagedllm.reasoning.interface.ReasoningParser`, built as
        ``ParserCls(tokenizer)`` (the HF tokenizer) once per process that
        uses it. No metadata keys
        (:class:`pagedllm.plugins.metadata.ReasoningParserInfo`).
    :return: nothing; the return value is ignored.

    Called lazily when the registry is first needed: the API server at
    start-up (chat replies are split with ``extract_reasoning_content`` and,
    streamed, ``extract_reasoning_content_streaming``), the engine core on
    its first structured-output request (``is_reasoning_end`` holds the
    grammar back until the reasoning section is over), ``pagedllm plugins
    list``. Built-in: ``think`` (``<think>...</think>``).
    """


@hookspec
def register_logits_processors(register: RegisterFn) -> None:
    """Register logits processors (kind ``logits_processor``):
    batch-level transformations of the logits before sampling, with
    per-request arguments (vLLM V1's ``LogitsProcessor``).

    :param register: call ``register(name, "pkg.mod:ProcessorCls", args=[...])``;
        ``name`` is what ``model.logits_processors`` (``--logits-processors
        name,...``, ``LLM(logits_processors=[...])``) loads. The target must
        be a subclass of
        :class:`pagedllm.logits_processors.interface.LogitsProcessor`, built
        once per worker as ``ProcessorCls(engine_config, device)``; each step
        it receives ``update_state(batch_update)`` (rows added, removed,
        moved; one row per draft position under speculative decoding) and
        then ``apply(logits)``. Metadata
        (:class:`pagedllm.plugins.metadata.LogitsProcessorInfo`): ``args``,
        the ``SamplingParams.extra_args`` keys (the server's ``vllm_xargs``)
        that activate it.
    :return: nothing; the return value is ignored.

    Called lazily when the registry is first needed: a worker building its
    model runner with ``model.logits_processors`` set, the front end
    validating a request's ``extra_args`` (``validate_params``), ``pagedllm
    plugins list``. A loaded processor applies to a request only when the
    request passes its arguments.
    """


@hookspec
def register_stat_loggers(register: RegisterFn) -> None:
    """Register stat loggers (kind ``stat_logger``, plugin API 1.7): what the
    front end does with the engine's statistics (vLLM's ``StatLoggerBase``).

    :param register: call ``register(name, "pkg.mod:LoggerCls")``; ``name`` is
        what ``server.stat_loggers`` (``--stat-loggers a,b``,
        ``LLM(stat_loggers=[...])``) selects. The target must be a subclass of
        :class:`pagedllm.stat_loggers.base.StatLoggerBase`, built as
        ``LoggerCls(context)`` (a
        :class:`~pagedllm.stat_loggers.base.StatLoggerContext`: model name,
        config, the Prometheus registry ``/metrics`` serves, the custom
        figures the engine core's components declared). After every batch of
        engine-core outputs its ``record(scheduler_stats, iteration_stats,
        num_scheduled_tokens)`` receives the scheduler's stats (with the
        custom figures plugins attached, ``scheduler_stats.custom_stats``)
        and the step's iteration stats (``finished_requests`` among them);
        ``log()`` runs every ``server.log_stats_interval_s``. No metadata
        keys (:class:`pagedllm.plugins.metadata.StatLoggerInfo`).
    :return: nothing; the return value is ignored.

    Called lazily when the stat-logger registry is first needed: starting a
    front end (AsyncLLM in the API process of ``pagedllm serve``; ``LLM``
    in the caller's process when ``stat_loggers`` is set), ``pagedllm plugins
    list``. Built-ins: ``prometheus`` (the ``/metrics`` collectors) and
    ``logging`` (the periodic throughput line), the server's default.
    """


@hookspec
def register_lora_resolvers(register: RegisterFn) -> None:
    """Register LoRA resolvers (kind ``lora_resolver``, plugin API 1.15):
    where the server finds an adapter by name on a request's first use of it
    (vLLM's ``LoRAResolver``: a folder, a hub repo).

    :param register: call ``register(name, "pkg.mod:ResolverCls")``; ``name``
        is what ``lora.lora_resolvers`` (``--lora-resolvers a,b``) selects.
        The target must be a subclass of
        :class:`pagedllm.lora.resolver.LoRAResolver`, built once per server
        as ``ResolverCls(lora_config)``; its ``resolve_lora(base_model_name,
        lora_name)`` returns the adapter's local folder or None (a plain
        function or a coroutine). The folder is then loaded and validated as
        ``POST /v1/load_lora_adapter`` loads one. No metadata keys
        (:class:`pagedllm.plugins.metadata.LoRAResolverInfo`).
    :return: nothing; the return value is ignored.

    Called lazily when the resolver registry is first needed: the API
    process of ``pagedllm serve`` starting with ``lora.lora_resolvers`` set,
    ``pagedllm plugins list``. The server asks the resolvers only with
    ``--enable-lora`` and runtime updating allowed
    (``lora.allow_runtime_lora_updating``). Built-in: ``filesystem``
    (``<lora.lora_resolver_cache_dir>/<name>/``).
    """


@hookspec
def on_engine_start(config: EngineConfig) -> None:
    """Lifecycle hook: an engine core has been built and is about to serve.

    :param config: the resolved :class:`pagedllm.core.config.EngineConfig`
        (read it; do not mutate it).
    :return: nothing; the return value is ignored.

    Called once per ``EngineCore``, in the process that runs it, by
    engine/builder.py once the model, KV cache and scheduler exist and
    before the first step. Use it for
    logging, metrics exporters or warm-up; an exception here aborts start-up.
    """


@hookspec
def register_plugin_config(register: RegisterConfigFn) -> None:
    """Declare this plugin's own options: a pydantic model of its settings.

    :param register: call ``register(MyOptions)`` once, with a subclass of
        :class:`pydantic.BaseModel` (a ``pydantic_settings.BaseSettings``
        too; it is validated with ``model_validate``, so it never reads the
        environment itself). Give every field a default: options nobody sets
        are the defaults. The same model may instead be named by the module
        attribute ``PAGEDLLM_PLUGIN_CONFIG = MyOptions``; declaring two
        different models is an error.
    :return: nothing; the return value is ignored.

    Called when the plugins load (``get_plugin_manager().load(...)`` in each
    process: the API process, the engine core, every worker rank) and again
    after plugins are registered or unregistered. The user's options for this
    plugin (``plugins.config.<plugin name>`` in the config file,
    ``PAGEDLLM_PLUGINS__CONFIG__<NAME>__<KEY>``, ``--plugin-config
    NAME='{"key": 1}'``, ``LLM(plugin_config={...})``) are validated against
    the model there: an unknown key or a bad value is a ConfigError naming
    ``plugins.config.<plugin>.<key>``, the value and what is allowed, and
    start-up fails. A component reads its plugin's options with
    ``get_plugin_manager().plugin_config(MyOptions)`` (an instance of
    ``MyOptions``), in whichever process builds it.
    """
