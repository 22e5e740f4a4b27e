"""EngineConfig: every engine knob, in sections, from arguments, env and a file.

Sources, highest first: init arguments, environment (`PAGEDLLM_` prefix, `__`
between section and key, e.g. `PAGEDLLM_CACHE__BLOCK_SIZE=32`), a YAML or TOML
file given to `EngineConfig.load`, defaults. Unknown keys and bad values are a
`ConfigError` naming the full key path and what is allowed.
"""

from __future__ import annotations

import contextvars
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from pagedllm.core.errors import ConfigError

_DTYPE_ALIASES = {
    "half": "float16",
    "fp16": "float16",
    "float": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
}
# The schema's list of accepted spellings (typed as JSON for pydantic's json_schema_extra).
_DTYPE_ALIAS_NAMES: list[JsonValue] = list(sorted(_DTYPE_ALIASES))


class _Section(BaseModel):
    # NOTE: extra="forbid" in every section: a misspelt key must fail loudly.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    # None = the embedded default model (pagedllm.model_registry.tiny).
    model: str | None = None
    # None = the model folder.
    tokenizer: str | None = None
    # A hub id's branch, tag or commit (vLLM's --revision); None = the
    # default branch. Pinned to its commit once at start-up.
    revision: str | None = None
    # The tokenizer's revision when it is a hub id; None = `revision` when
    # the tokenizer is the model's repo, else its default branch.
    tokenizer_revision: str | None = None
    # Where hub models are downloaded to (a Hugging Face cache folder);
    # None = huggingface_hub's cache (HF_HUB_CACHE, under HF_HOME).
    download_dir: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", json_schema_extra={"aliases": _DTYPE_ALIAS_NAMES}
    )
    # None = max_position_embeddings of the HF config (the engine fills it in).
    max_model_len: int | None = Field(None, ge=1)
    seed: int = 0
    # Overrides config.json's architectures[0].
    architecture: str | None = None
    # Which implementation serves the architecture (vLLM's --model-impl):
    # native = the class a plugin registers for it (the built-ins included);
    # transformers = transformers' own modeling code with paged attention
    # (the Transformers fallback), even where a native class exists; auto =
    # native when registered, else the fallback for a decoder-only
    # architecture transformers knows.
    model_impl: Literal["auto", "native", "transformers"] = "auto"
    # A registered quantization method (plugin kind `quantization_method`):
    # how the linear layers' weights are stored and multiplied. None = as loaded.
    quantization: str | None = None
    # How the weights are read (vLLM's names): auto = safetensors when the
    # folder has them, else PyTorch .bin files (a `.gguf` model path: gguf);
    # safetensors / pt = only that format; gguf = one llama.cpp GGUF file,
    # dequantized at load; dummy = random weights of the checkpoint's shapes,
    # no weight file read (benchmarks, start-up measurements).
    load_format: Literal["auto", "safetensors", "pt", "gguf", "dummy"] = "auto"
    # Registered logits processors (plugin kind `logits_processor`) every
    # worker loads, in the order they apply (vLLM's --logits-processors); a
    # request activates one by passing its arguments in extra_args / vllm_xargs.
    logits_processors: list[str] = Field(default_factory=list)
    # Import the Python files a checkpoint's auto_map names (config.json's or
    # tokenizer_config.json's) when transformers needs them (vLLM's
    # --trust-remote-code). Off: such a checkpoint is refused, nothing imported.
    trust_remote_code: bool = False
    # Where the default sampling values come from (vLLM's --generation-config):
    # auto = the model folder's generation_config.json; vllm = ignore it (the
    # engine's own defaults); else a folder holding a generation_config.json.
    # Every eos_token_id its file lists stops generation; with vllm the model
    # folder's file still names them (as in vLLM): stop tokens are the model's.
    generation_config: str = "auto"
    # Generation-config values merged over the file's, also with "vllm"
    # (vLLM's --override-generation-config), e.g. {"temperature": 0.6};
    # checked with the file before the engine core starts.
    override_generation_config: dict[str, Any] = Field(
        default_factory=dict, description="generation-config values over the model's, as JSON"
    )

    @field_validator("generation_config")
    @classmethod
    def _generation_config_source(cls, value: str) -> str:
        if value not in ("auto", "vllm") and not (Path(value) / "generation_config.json").is_file():
            raise ConfigError("generation_config", value, "'auto', 'vllm' or a folder holding a generation_config.json")
        return value

    @field_validator("logits_processors", mode="before")
    @classmethod
    def _comma_separated_names(cls, value: Any) -> Any:
        if isinstance(value, str):  # PAGEDLLM_MODEL__LOGITS_PROCESSORS=a,b
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        if isinstance(value, str):
            return _DTYPE_ALIASES.get(value.lower(), value.lower())
        return value


class CacheConfig(_Section):
    block_size: int = Field(16, ge=1, le=256)
    # What the KV cache stores keys and values in (vLLM's --kv-cache-dtype):
    # "auto" = the model's dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2" = one
    # byte per value with scale 1.0 (attention_backends/kv_cache_dtype.py),
    # where the platform and the attention backend support it.
    cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # Overrides the number of KV blocks computed from memory. With several
    # KV cache groups (sliding-window layers beside full ones) it is the
    # blocks of the pool they share, as vLLM's num_gpu_blocks_override.
    num_kv_blocks: int | None = Field(None, ge=1)
    # Overrides gpu_memory_utilization: bytes given to the KV cache.
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: Literal["sha256", "xxhash"] = "sha256"
    # Report the hashes the prefix cache gains and loses (core/kv_cache/
    # events.py) with every step: what a cache-aware router mirrors.
    enable_kv_events: bool = False
    # vLLM's --disable-hybrid-kv-cache-manager: every layer keeps a
    # full-length cache in one KV cache group. By default layers with
    # different KV specs (sliding-window and full attention) form groups
    # with their own block tables, and a sliding-window group returns the
    # blocks that leave its window (core/kv_cache/kv_cache_interface.py).
    disable_hybrid_kv_cache_manager: bool = False


class SchedulerConfig(_Section):
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(128, ge=1)
    # 0 = off; else a prefill chunk of a long prompt is at most this many tokens.
    long_prefill_token_threshold: int = Field(0, ge=0)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    # Latency-bounded steps (core/step_budget.py): while decodes run, prompt
    # chunks get only the tokens that keep the step within this many
    # milliseconds, as the step cost model fitted on the running steps
    # predicts. None: the automatic target (3x the decodes' own step, at
    # least 50 ms); 0: off (every step may take max_num_batched_tokens).
    # Needs enable_chunked_prefill. Offline `LLM` turns it off unless given.
    max_step_latency_ms: float | None = Field(None, ge=0.0)
    # vLLM's async scheduling: step k+1 is scheduled and launched while step
    # k's forward runs, and step k's outputs are processed after that. Steps
    # holding a request that needs its previous token first (a grammar) run
    # synchronously; with a drafter or a KV connector every step does.
    async_scheduling: bool = False
    # Share the seats (max_num_seqs) between requests while others wait: one
    # request's many sequences (prompts x n) never keep a newer request out
    # (core/fair_share.py). False: plain first-come-first-served / priority.
    fair_share: bool = True


class DeviceConfig(_Section):
    # Registered names of the `platform` / `attention_backend` plugin kinds.
    platform: str = "auto"
    attention_backend: str = "auto"
    # No graph capture (vLLM's enforce_eager): every step runs eagerly.
    enforce_eager: bool = False
    # Decode batch sizes captured as graphs (CUDA graphs, CPU graphs) where
    # the platform and backend allow; None: 1, 2, 4, 8, ... up to
    # scheduler.max_num_seqs. `cuda_graph_sizes` (vLLM's name, and this
    # field's before it sized CPU graphs too) is accepted as an alias.
    graph_sizes: list[int] | None = Field(
        None, validation_alias=AliasChoices("graph_sizes", "cuda_graph_sizes")
    )
    # torch.compile the model outside attention (attention stays eager).
    compile_model: bool = False

    @field_validator("graph_sizes", mode="before")
    @classmethod
    def _graph_sizes(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [int(size) for size in value.split(",") if size.strip()]
        if value is not None and (not value or any(int(size) < 1 for size in value)):
            raise ValueError("graph_sizes must be positive batch sizes")
        return value

    @property
    def cuda_graph_sizes(self) -> list[int] | None:
        """`graph_sizes` under its old name."""
        return self.graph_sizes

    @cuda_graph_sizes.setter
    def cuda_graph_sizes(self, value: list[int] | None) -> None:
        self.graph_sizes = value


class PluginsConfig(_Section):
    # None = every discovered plugin (like an unset VLLM_PLUGINS).
    enabled: list[str] | None = None
    disabled: list[str] = Field(default_factory=list)
    strict: bool = False
    # Each plugin's own options, by plugin (entry point) name: validated
    # against the config model the plugin declares when the plugins load
    # (plugins/plugin_config.py). Env: PAGEDLLM_PLUGINS__CONFIG__<NAME>__<KEY>.
    config: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="one plugin's options, repeatable: --plugin-config NAME='{\"key\": 1}'",
    )

    @field_validator("enabled", "disabled", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        # Env users write PAGEDLLM_PLUGINS__ENABLED=a,b as with VLLM_PLUGINS.
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value


class StructuredOutputConfig(_Section):
    """Grammar-constrained decoding (SamplingParams.structured_outputs)."""

    # A registered `grammar_backend` name; a request may name another (its
    # structured_outputs.backend).
    backend: str = "xgrammar"
    # Engine-core threads compiling grammars; a request waits for its grammar
    # (WAITING_FOR_FSM) while the rest of the batch runs.
    num_compile_threads: int = Field(2, ge=1, le=64)
    # JSON without free whitespace for every request (vLLM's option of the
    # same name); a request may also ask with structured_outputs.disable_any_whitespace.
    disable_any_whitespace: bool = False
    # Compiled grammars kept, least recently used dropped first; keyed by
    # (backend, kind, spec, whitespace). 0 = no cache.
    cache_size: int = Field(128, ge=0)
    # Longest whitespace run a JSON grammar (json, json_object) allows between
    # two tokens, so a weak model cannot spend max_tokens on spaces; 0 = none
    # at all (as disable_any_whitespace), None = unbounded (xgrammar's default).
    # 4 still admits "\n" plus a 3-space indent or a 2-space indent one level
    # deep. A request may override it (structured_outputs.max_whitespace).
    max_whitespace: int | None = Field(4, ge=0, le=64)
    # Limits on a request's spec, checked before any parser or compiler runs
    # (API side and engine core); past one, the request is a 400 naming it.
    # Bytes of the spec (UTF-8; a choice list: all choices together). Large
    # real schemas (dozens of tools, OpenAPI-derived) stay well under 64 KiB.
    max_spec_bytes: int = Field(128 * 1024, ge=1, le=16 * 1024 * 1024)
    # Nesting of the JSON document of a schema or structural tag ({} and []
    # levels). One object level of data is two levels ("properties" and the
    # property), so 64 is ~30 levels of data; schemas with $defs stay far
    # below. xgrammar's conversion grows ~ depth^3 (measured 0.8 s at 400
    # levels, so ~6 s at 800) and Python's recursive code stops near 1000:
    # hence le=512.
    max_schema_depth: int = Field(64, ge=1, le=512)
    # Entries of a choice list (each is an alternative of one grammar rule).
    max_choices: int = Field(4096, ge=1)
    # Wall-clock seconds one spec may take to validate and compile: the API
    # side compiles it in a child process that is killed past this; the
    # engine core fails the request whose compile runs longer. Typical specs
    # compile in milliseconds; the largest real ones in about a second.
    compile_timeout_s: float = Field(10.0, gt=0, le=600)
    # The API side's grammar lane (its own threads and child processes, never
    # the request workers). Child processes checking specs, ~300 MB each; all
    # but one may run costly specs, so a cheap spec always finds one free.
    validator_processes: int = Field(2, ge=2, le=16)
    # A spec still compiling after this many seconds is costly (remembered by
    # its key); so is one with a repetition bound >= 500 or of 16 K characters.
    # Costly specs wait in their client's own queue (clients: by address).
    cheap_compile_s: float = Field(1.0, gt=0, le=600)
    # Costly specs of one client compiling at once ...
    max_costly_compiles_per_client: int = Field(1, ge=1, le=64)
    # ... and waiting; past this a request is refused with HTTP 429.
    max_queued_compiles_per_client: int = Field(8, ge=0, le=4096)
    # A registered `reasoning_parser` name (`think`, or a plugin's), vLLM's
    # --reasoning-parser: chat replies carry `reasoning_content`, and a
    # request's grammar applies only once its reasoning section has ended.
    # None = replies are all content, grammars apply from the first token.
    reasoning_parser: str | None = None


class SpeculativeConfig(_Section):
    """Speculative decoding (vLLM's `speculative_config`); off while `method` is None."""

    # A registered `drafter` name: ngram, suffix, draft_model, eagle, eagle3, or a plugin's.
    method: str | None = None
    # Draft tokens proposed per request per step (k).
    num_speculative_tokens: int = Field(3, ge=1, le=32)
    # The drafter's model (draft_model, eagle, eagle3): a folder, hub id or shipped alias.
    model: str | None = None
    # n-gram (prompt lookup): the shortest and longest suffix n-gram matched.
    prompt_lookup_min: int = Field(1, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)
    # suffix decoding: the suffix trees keep windows of up to this many tokens
    # (a match is at most max_tree_depth - 1 long, match + draft at most this).
    suffix_decoding_max_tree_depth: int = Field(24, ge=2)
    # Finished requests whose outputs the global suffix tree keeps (oldest
    # evicted first; 0 = no global tree, each request matches only itself).
    suffix_decoding_max_cached_requests: int = Field(1000, ge=0)
    # Draft at most int(match length * factor + offset) tokens (and at most
    # num_speculative_tokens): a longer match earns a longer draft.
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0)
    suffix_decoding_max_spec_offset: float = 0.0
    # Stop the draft where the continuation's estimated probability (product of
    # child count / parent count along the path) falls below this.
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1)
    # A registered `spec_policy` name: how many tokens each request drafts per
    # step, 0 included. adaptive: where its measured acceptance pays for the
    # measured draft + verify cost at this batch size; batch_size: vLLM's
    # disable_by_batch_size alone; always: k every step; or a plugin's.
    policy: str = "adaptive"
    # vLLM's disable_by_batch_size: no drafts in steps of at least this many
    # requests (adaptive and batch_size policies). None = no such limit.
    disable_by_batch_size: int | None = Field(None, ge=1)

    @field_validator("prompt_lookup_max")
    @classmethod
    def _max_at_least_min(cls, value: int, info: Any) -> int:
        low = info.data.get("prompt_lookup_min")
        if low is not None and value < low:
            raise ValueError(f"must be >= prompt_lookup_min ({low})")
        return value


class KVTransferConfig(_Section):
    """KV blocks moving between engines or memory tiers (vLLM's
    `kv_transfer_config`); off while `connector` is None."""

    # A registered `kv_connector` name: shared_storage, cpu_offload, or a plugin's.
    connector: str | None = None
    # producer: saves the blocks it computes; consumer: loads blocks others
    # saved instead of computing them; both.
    role: Literal["producer", "consumer", "both"] = "both"
    # The connector's own settings (shared_storage: {"path": DIR};
    # cpu_offload: {"cpu_bytes": N}).
    extra: dict[str, Any] = Field(default_factory=dict)
    # A stored block that cannot be loaded (missing, truncated, corrupted):
    # recompute it, or fail the request with a clear error.
    load_failure_policy: Literal["fail", "recompute"] = "recompute"


class ParallelConfig(_Section):
    """How many ranks run the model and how they are launched (vLLM's
    `ParallelConfig`). At size 1 the in-process `uni` executor runs it."""

    # Ranks the model's layers are split over (vLLM's `-tp`).
    tensor_parallel_size: int = Field(1, ge=1)
    # Mixture-of-experts layers place whole experts on the tensor-parallel
    # ranks (expert parallelism, tokens exchanged all-to-all) instead of
    # slicing every expert; attention and dense layers stay tensor parallel.
    # No effect at tensor_parallel_size 1 or on a model without experts.
    enable_expert_parallel: bool = False
    # A registered `executor` name (uni, or a plugin's); auto = uni at size 1.
    distributed_executor_backend: str = "auto"
    # A Ray cluster to attach to (ray executors); None = RAY_ADDRESS or a local one.
    ray_address: str | None = None
    # How a Ray placement group spreads the ranks' bundles over nodes.
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD"] = "PACK"
    # torch.distributed rendezvous of the ranks on one host (mp executors).
    master_addr: str = "127.0.0.1"
    # None = a free port, chosen when the ranks start.
    master_port: int | None = Field(None, ge=1, le=65535)
    # Engine copies behind one front end (vLLM's `-dp`), each with its own
    # executor and tensor_parallel_size ranks; requests go where the router says.
    data_parallel_size: int = Field(1, ge=1)
    # This engine's index among them (set by the front end for each copy).
    data_parallel_rank: int = Field(0, ge=0)
    # A registered `router` name: where each request goes at data_parallel_size > 1.
    routing_policy: str = "prefix_aware"

    @field_validator("data_parallel_rank")
    @classmethod
    def _rank_below_size(cls, value: int, info: Any) -> int:
        size = info.data.get("data_parallel_size")
        if size is not None and value >= size:
            raise ValueError(f"must be < data_parallel_size ({size})")
        return value


class ServerConfig(_Section):
    """The OpenAI-compatible HTTP front end (`pagedllm serve`); the engine core ignores it."""

    # NOTE: loopback by default; exposing the server is an explicit choice.
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Bearer token every route but /health requires; also PAGEDLLM_API_KEY.
    api_key: str | None = None
    # /metrics without the key (for a Prometheus scraper without credentials).
    allow_unauthenticated_metrics: bool = False
    # Request bodies above this are refused with 413.
    max_body_bytes: int = Field(4 << 20, ge=1024)
    # Seconds a request's whole body may take to arrive after its headers;
    # past it the server answers 408 and closes the connection.
    body_read_timeout_s: float = Field(30.0, gt=0.0)
    # Largest non-streaming response body a request may ask for, estimated
    # before generation (n x max_tokens x logprobs at the vocabulary's
    # longest token); above it a 400. Streamed responses are not bounded.
    max_response_bytes: int = Field(256 << 20, ge=1024)
    # Engine sequences (prompts x n) admitted but not finished. A request that
    # would pass it gets 503 (retry later); one that alone exceeds it gets 400.
    # NOTE: the name predates counting sequences; kept for compatibility.
    max_pending_requests: int = Field(1024, ge=1)
    # The share of max_pending_requests one request's sequences count for at
    # most: past it, its other sequences are accepted but queue in the
    # scheduler uncounted, so one request at the limit leaves room for others
    # (the engine then holds at most max_pending_requests / this sequences).
    max_pending_share: float = Field(0.5, gt=0.0, le=1.0)
    # /health fails (503) when the engine core does not answer a ping this fast.
    health_timeout_s: float = Field(5.0, gt=0.0)
    # On SIGTERM / SIGINT: how long in-flight requests may still finish; the
    # rest then end with a 503 (or an error chunk and [DONE] when streaming).
    drain_timeout_s: float = Field(30.0, ge=0.0)
    # When the engine core dies: False = the API process ends its requests with
    # 503 and exits non-zero (a supervisor restarts it, as vLLM); True = it stays
    # up answering 503 (a liveness probe on /health decides).
    keep_alive_on_engine_death: bool = False
    # The model ids clients may send (vLLM's --served-model-name A B ...): the
    # first is the `model` of every response, /v1/models lists them all;
    # None = the model path's name. One string is one name.
    served_model_name: list[str] | None = Field(None, min_length=1)
    # The chat template chat requests and LLM.chat render with, instead of the
    # tokenizer's (vLLM's --chat-template): a file, or the Jinja text itself.
    chat_template: str | None = None
    # Seconds between the periodic throughput log line; 0 = off.
    log_stats_interval_s: float = Field(10.0, ge=0.0)
    # The stat loggers (plugin kind stat_logger) to run, by name; None = the
    # front end's default (serve: prometheus and logging; LLM: none).
    stat_loggers: list[str] | None = Field(
        None, description="stat loggers to run, by name (serve's default: prometheus,logging)"
    )
    # Threads that tokenize, detokenize, render chat templates and validate
    # requests off the event loop; a request waits for a free one. Fast
    # tokenizers release the GIL, so more threads use more cores; templates
    # hold it, so many would slow the event loop down.
    request_worker_threads: int = Field(4, ge=1, le=64)
    # Accept `chat_template` / `chat_template_kwargs` in requests. Off: a 400
    # naming the field (a request template is code the server runs).
    trust_request_chat_template: bool = False
    # Special-token strings (`<|im_end|>`) a client writes in a prompt, a
    # message, a tool call or result are text unless this is on: otherwise a
    # user message could close its turn and open a system one. The chat
    # template's own special tokens are special either way; on = vLLM's behaviour.
    parse_special_tokens_in_user_text: bool = False
    # Longest a chat template may render (the model's own template included);
    # past it the render is stopped and the request gets a 400.
    chat_template_timeout_s: float = Field(5.0, gt=0.0, le=600.0)
    # The registered tool-call parser (kind tool_parser, e.g. "hermes") that
    # reads calls out of the model's text for chat tool_choice="auto"; with
    # enable_auto_tool_choice (vLLM's two flags). Without them "auto" is a 400;
    # "required" and named functions need neither (the grammar backend forces them).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _one_name_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class LoRAConfig(_Section):
    """Multi-LoRA serving (vLLM's --enable-lora family): adapters over the
    base model, batched together; off unless `enable_lora`."""

    enable_lora: bool = False
    # Distinct adapters in one step (the adapter slots the layers hold);
    # requests of other adapters wait, they are not preempted.
    max_loras: int = Field(1, ge=1, le=256)
    # The largest adapter rank accepted (the slots are this wide).
    max_lora_rank: int = Field(16, ge=1, le=512)
    # Adapters kept loaded in host memory (least recently used evicted);
    # None = max_loras. At least max_loras.
    max_cpu_loras: int | None = Field(None, ge=1)
    # Adapters served from start-up: NAME=PATH, or vLLM's JSON form
    # {"name": ..., "path": ..., "base_model_name": ...}; one word per item.
    lora_modules: list[str] = Field(default_factory=list)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 turns this on too).
    allow_runtime_lora_updating: bool = False
    # An adapter's files (adapter_config.json + safetensors) may hold at most this many bytes.
    max_lora_bytes: int = Field(1 << 30, ge=1)
    # LoRA resolver plugins asked, in order, for an unknown adapter name a
    # request uses (needs runtime updating allowed); built-in: filesystem.
    lora_resolvers: list[str] = Field(default_factory=list)
    # The filesystem resolver's folder (<dir>/<name>/adapter_config.json);
    # None = VLLM_LORA_RESOLVER_CACHE_DIR.
    lora_resolver_cache_dir: str | None = None

    @field_validator("max_cpu_loras")
    @classmethod
    def _cpu_loras_hold_a_batch(cls, value: int | None, info: Any) -> int | None:
        max_loras = info.data.get("max_loras")
        if value is not None and max_loras is not None and value < max_loras:
            raise ValueError(f"must be >= max_loras ({max_loras})")
        return value


# vLLM's flat keyword names (LLM(model=..., block_size=...)) -> (section, key).
# key None means the flat name takes the whole section (a dict or the model),
# e.g. a later `speculative_config` -> ("speculative", None).
FLAT_KEYS: dict[str, tuple[str, str | None]] = {
    "model": ("model", "model"),
    "tokenizer": ("model", "tokenizer"),
    "revision": ("model", "revision"),
    "tokenizer_revision": ("model", "tokenizer_revision"),
    "download_dir": ("model", "download_dir"),
    "dtype": ("model", "dtype"),
    "max_model_len": ("model", "max_model_len"),
    "seed": ("model", "seed"),
    "architecture": ("model", "architecture"),
    "model_impl": ("model", "model_impl"),
    "quantization": ("model", "quantization"),
    "load_format": ("model", "load_format"),
    "logits_processors": ("model", "logits_processors"),
    "generation_config": ("model", "generation_config"),
    "override_generation_config": ("model", "override_generation_config"),
    "block_size": ("cache", "block_size"),
    "kv_cache_dtype": ("cache", "cache_dtype"),
    "num_kv_blocks": ("cache", "num_kv_blocks"),
    "num_gpu_blocks_override": ("cache", "num_kv_blocks"),
    "kv_cache_memory_bytes": ("cache", "kv_cache_memory_bytes"),
    "gpu_memory_utilization": ("cache", "gpu_memory_utilization"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "prefix_caching_hash_algo": ("cache", "prefix_caching_hash_algo"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_step_latency_ms": ("scheduler", "max_step_latency_ms"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "long_prefill_token_threshold": ("scheduler", "long_prefill_token_threshold"),
    "scheduling_policy": ("scheduler", "scheduling_policy"),
    "enable_chunked_prefill": ("scheduler", "enable_chunked_prefill"),
    "async_scheduling": ("scheduler", "async_scheduling"),
    "platform": ("device", "platform"),
    "attention_backend": ("device", "attention_backend"),
    "enforce_eager": ("device", "enforce_eager"),
    "graph_sizes": ("device", "graph_sizes"),
    "cuda_graph_sizes": ("device", "graph_sizes"),
    "compile_model": ("device", "compile_model"),
    "enabled_plugins": ("plugins", "enabled"),
    "disabled_plugins": ("plugins", "disabled"),
    "strict_plugins": ("plugins", "strict"),
    "plugin_config": ("plugins", "config"),
    "structured_outputs_config": ("structured_output", None),
    "reasoning_parser": ("structured_output", "reasoning_parser"),
    "speculative_config": ("speculative", None),
    "speculative_method": ("speculative", "method"),
    "speculative_model": ("speculative", "model"),
    "num_speculative_tokens": ("speculative", "num_speculative_tokens"),
    "speculative_policy": ("speculative", "policy"),
    "speculative_disable_by_batch_size": ("speculative", "disable_by_batch_size"),
    "kv_transfer_config": ("kv_transfer", None),
    "kv_connector": ("kv_transfer", "connector"),
    "kv_role": ("kv_transfer", "role"),
    "kv_connector_extra_config": ("kv_transfer", "extra"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "enable_expert_parallel": ("parallel", "enable_expert_parallel"),
    "distributed_executor_backend": ("parallel", "distributed_executor_backend"),
    "ray_address": ("parallel", "ray_address"),
    "placement_strategy": ("parallel", "placement_strategy"),
    "master_addr": ("parallel", "master_addr"),
    "master_port": ("parallel", "master_port"),
    "data_parallel_size": ("parallel", "data_parallel_size"),
    "data_parallel_rank": ("parallel", "data_parallel_rank"),
    "routing_policy": ("parallel", "routing_policy"),
    "enable_kv_events": ("cache", "enable_kv_events"),
    "disable_hybrid_kv_cache_manager": ("cache", "disable_hybrid_kv_cache_manager"),
    "stat_loggers": ("server", "stat_loggers"),
    "log_stats_interval_s": ("server", "log_stats_interval_s"),
    "served_model_name": ("server", "served_model_name"),
    "chat_template": ("server", "chat_template"),
    "trust_remote_code": ("model", "trust_remote_code"),
    "enable_lora": ("lora", "enable_lora"),
    "max_loras": ("lora", "max_loras"),
    "max_lora_rank": ("lora", "max_lora_rank"),
    "max_cpu_loras": ("lora", "max_cpu_loras"),
    "lora_modules": ("lora", "lora_modules"),
}

# The parsed config file of the `EngineConfig.load` call in progress (settings
# sources are chosen in a classmethod, so the file travels in a context var).
_CONFIG_FILE_DATA: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "pagedllm_config_file_data", default=None
)


class _ConfigFileSource(PydanticBaseSettingsSource):
    """Values of a YAML or TOML file, parsed (and checked) by `_read_config_file`."""

    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


class EngineConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PAGEDLLM_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        # NOTE: no .env file, no secrets dir, no CLI parsing: only the sources below.
        env_file=None,
        cli_parse_args=False,
    )

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    plugins: PluginsConfig = Field(default_factory=PluginsConfig)
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _config_error(type(self), exc) from None
        except SettingsError as exc:
            # e.g. PAGEDLLM_CACHE='not json': a source could not be parsed at all.
            raise ConfigError(
                "environment", str(exc), "JSON for a whole section, or PAGEDLLM_<SECTION>__<KEY>=value"
            ) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        data = _CONFIG_FILE_DATA.get()
        if data is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, _ConfigFileSource(settings_cls, data))

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any) -> EngineConfig:
        """Build from `overrides` (section name -> dict or section model), env,
        `config_file` (.yaml, .yml or .toml) and defaults, in that order."""
        data = None if config_file is None else _read_config_file(Path(config_file))
        init = {name: _unset_fields_only(value) for name, value in overrides.items()}
        token = _CONFIG_FILE_DATA.set(data)
        try:
            return cls(**init)
        finally:
            _CONFIG_FILE_DATA.reset(token)

    @classmethod
    def from_flat(cls, config_file: str | Path | None = None, **kwargs: Any) -> EngineConfig:
        """Build from vLLM's flat keyword names (`FLAT_KEYS`). A None value means
        "not given" for keys that do not accept None (as in vLLM's `LLM`)."""
        sections: dict[str, Any] = {}
        origin: dict[tuple[str, str | None], str] = {}
        for flat_name, value in kwargs.items():
            target = FLAT_KEYS.get(flat_name)
            if target is None:
                raise ConfigError(flat_name, value, "one of " + ", ".join(sorted(FLAT_KEYS)))
            if target in origin:
                raise ConfigError(flat_name, value, f"only one of {origin[target]!r} and {flat_name!r}")
            origin[target] = flat_name
            section, key = target
            if key is None:
                sections[section] = value
                continue
            if value is None and cls._field_default(section, key) is not None:
                continue
            sections.setdefault(section, {})[key] = value
        return cls.load(config_file, **sections)

    @classmethod
    def _field_default(cls, section: str, key: str) -> Any:
        section_cls = typing.cast(type[BaseModel], cls.model_fields[section].annotation)
        return section_cls.model_fields[key].get_default(call_default_factory=True)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (JSON types) for logging and `pagedllm env`."""
        return self.model_dump(mode="json")


def _read_config_file(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError("config_file", str(path), "a .yaml, .yml or .toml file")
    if not path.is_file():
        raise ConfigError("config_file", str(path), "an existing file")
    try:
        if suffix == ".toml":
            with path.open("rb") as f:
                data = tomllib.load(f)
        else:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError("config_file", str(path), f"valid {suffix[1:].upper()} ({exc})") from None
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config_file", str(path), "a mapping of section name -> keys at the top level")
    return data


def _unset_fields_only(value: Any) -> Any:
    # A section model passed as an override must not pin its defaults over env
    # and file values: only the fields the caller set take precedence.
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    return value


def _config_error(config_cls: type[BaseModel], exc: ValidationError, prefix: str = "") -> ConfigError:
    errors = exc.errors()
    first = errors[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):  # a validator's own error: keep its key below the field's section
        section = ".".join(str(part) for part in first["loc"][:-1])
        return ConfigError(prefix + (f"{section}.{cause.key}" if section else cause.key), cause.value, cause.allowed)
    key, allowed = _describe(config_cls, first)
    if len(errors) > 1:
        others = ", ".join(prefix + ".".join(str(p) for p in e["loc"]) for e in errors[1:])
        allowed += f" (also invalid: {others})"
    return ConfigError(prefix + key, first.get("input"), allowed)


def config_error_from_validation(config_cls: type[BaseModel], exc: ValidationError, prefix: str = "") -> ConfigError:
    """The ConfigError of any settings model (a plugin's own options too):
    the first failing key (after `prefix`), its value, and what is allowed
    (a Literal's choices, a field's whole range)."""
    return _config_error(config_cls, exc, prefix)


def _describe(config_cls: type[BaseModel], error: Any) -> tuple[str, str]:
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc)
    # Walk the models along loc to the section that holds the failing key.
    owner: type[BaseModel] = config_cls
    field = None
    for part in loc:
        field = owner.model_fields.get(part)
        if field is None:
            break
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            owner = annotation
            field = None
    if error["type"] == "extra_forbidden":
        return key, "known keys " + ", ".join(owner.model_fields)
    if field is not None:
        choices = _literal_choices(field.annotation)
        if choices is not None:
            allowed = ", ".join(repr(c) for c in choices)
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("aliases"):
                allowed += " (aliases: " + ", ".join(typing.cast(list[str], extra["aliases"])) + ")"
            return key, allowed
        # Name the whole range (pydantic's message names only the bound crossed).
        bounds = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
        limits = [
            f"{op} {getattr(meta, name)}"
            for meta in field.metadata
            for name, op in bounds.items()
            if getattr(meta, name, None) is not None
        ]
        if limits and error["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            return key, " and ".join(limits)
    return key, error["msg"]


def _literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):  # Optional[Literal[...]]
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None
