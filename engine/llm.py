"""The offline API: `LLM.generate` and `LLM.chat`, as in vLLM."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.stats import IterationStats
from pagedllm.engine.core_client import EngineCoreClient, InprocClient, SyncMPClient
from pagedllm.engine.dp_client import SyncDPClient
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.metrics import StatLoggerManager, stat_logger_names
from pagedllm.engine.output_processor import OutputProcessor, ProcessedOutputs
from pagedllm.lora.registry import LoRARegistry
from pagedllm.model_registry.chat_template import MissingChatTemplateError, has_own_chat_template, load_chat_template
from pagedllm.model_registry.generation_config import generation_sampling_defaults, log_generation_defaults
from pagedllm.model_registry.model_source import model_display_name, resolve_hub_models, resolve_model_path
from pagedllm.model_registry.tokenizer import load_tokenizer
from pagedllm.plugins import get_plugin_manager

if TYPE_CHECKING:
    from pagedllm.core.lora import LoRARef
    from pagedllm.core.stats import SchedulerStats
    from pagedllm.engine.outputs import RequestOutput
    from pagedllm.lora.request import LoRARequest

ChatMessages = list[dict[str, Any]]


def unbounded_steps_unless_asked(config: EngineConfig) -> EngineConfig:
    """Offline generation is judged by throughput, not by a stream's
    inter-token gaps: its steps are latency-bounded only when asked."""
    if "max_step_latency_ms" not in config.scheduler.model_fields_set:
        config.scheduler.max_step_latency_ms = 0.0
    return config


class LLM:
    """Generate offline over an engine core: in this process by default, in
    its own process with `multiprocess=True` (the server's client, ZMQ).

    Accepts vLLM's flat keyword names (`block_size`, `max_num_seqs`,
    `enable_prefix_caching`, ...), a `config_file` (YAML or TOML), and the
    `PAGEDLLM_` environment; arguments win over env, env over the file.
    `stat_loggers=["name", ...]` runs those stat loggers in this process
    (none by default), fed after every engine step.
    """

    def __init__(
        self, model: str | None = None, *, config_file: str | None = None, multiprocess: bool = False, **kwargs: Any
    ) -> None:
        if model is not None:  # not given: the config file's (or env's) model, else the default one
            kwargs["model"] = model
        self.config = unbounded_steps_unless_asked(EngineConfig.from_flat(config_file=config_file, **kwargs))
        # Read before the engine starts: a template path that is not there fails at once.
        self.chat_template = load_chat_template(self.config.server.chat_template, field="chat_template")
        plugins = self.config.plugins
        # As `serve`'s API process: this process's plugin code (grammar
        # backends validating requests) gets the same options as the engine
        # core's, and a bad option fails here before a process is started.
        get_plugin_manager().load(
            enabled=plugins.enabled, disabled=plugins.disabled, strict=plugins.strict, config=plugins.config
        )
        # Hub ids download here, once: the engine core and its ranks get folders.
        self.config = resolve_hub_models(self.config)
        # Checked before the engine starts: an unknown name fails at once.
        has_stat_loggers = bool(stat_logger_names(self.config, default=()))
        generation_sampling_defaults(resolve_model_path(self.config.model.model), self.config.model)
        self.engine_core: EngineCoreClient
        if self.config.parallel.data_parallel_size > 1:  # one engine-core process per replica
            self.engine_core = SyncDPClient(self.config)
        else:
            self.engine_core = SyncMPClient(self.config) if multiprocess else InprocClient(self.config)
        ready = self.engine_core.ready
        self.tokenizer = load_tokenizer(
            self.config.model.tokenizer or ready.model_path, self.config.model.trust_remote_code
        )
        self.input_processor = InputProcessor(
            self.tokenizer, ready, self.config.structured_output, self.config.model.logits_processors,
            enable_lora=self.config.lora.enable_lora,
        )
        # Adapters are registered (loaded, checked, hashed) here on first use.
        lora = self.config.lora
        self.lora_registry = LoRARegistry(ready.model_path, lora, ready.lora_modules) if lora.enable_lora else None
        self._lora_requests: dict[str, LoRARequest] = {}
        log_generation_defaults(self.config.model, self.input_processor.default_sampling_params)
        self.eos_token_id = self.input_processor.eos_token_id
        self.max_model_len = ready.max_model_len
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        self.stat_logger: StatLoggerManager | None = None
        if has_stat_loggers:
            try:
                self.stat_logger = StatLoggerManager(
                    (self.config.server.served_model_name or [model_display_name(ready.model_path)])[0],
                    self.config,
                    num_kv_blocks=ready.num_kv_blocks,
                    max_model_len=ready.max_model_len,
                    world_size=ready.world_size,
                    default_loggers=(),
                    custom_metrics=ready.custom_metrics,
                )
            except BaseException:
                self.engine_core.shutdown()
                raise

    # ----------------------------------------------------------------- API

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`, each finished; `lora_request`:
        the adapter of every prompt, or one per prompt (None: the base model)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise InvalidRequestError("priority", len(priority), f"one value per prompt ({len(prompt_list)})")
        lora_list = self._loras_per_prompt(lora_request, len(prompt_list))
        request_ids = []
        try:
            for index, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                request_ids.append(
                    self._add_request(prompt, params, priority[index] if priority else 0, lora_list[index])
                )
        except Exception:
            self._abort(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with `chat_template` (else LLM's
        `chat_template`, else the tokenizer's), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = load_chat_template(chat_template, field="chat_template") or self.chat_template
        if template is None and not has_own_chat_template(self.tokenizer):
            raise MissingChatTemplateError("LLM(chat_template=...) or LLM.chat(..., chat_template=...)")
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
            # The template already holds every special token it wants.
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams holding the generation config's defaults (engine
        defaults for the rest): what `generate` and `chat` use when given none."""
        return self.input_processor.get_default_sampling_params()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats | None:
        return self.engine_core.get_stats()

    def shutdown(self) -> None:
        """Stop a multiprocess core now (it also stops when the LLM is collected)."""
        self.engine_core.shutdown()
        if self.stat_logger is not None:
            self.stat_logger.shutdown()

    # ------------------------------------------------------------ internals

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:  # the generation config's defaults (vLLM's)
            return [self.get_default_sampling_params()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params_list = list(sampling_params)
        if len(params_list) != num_prompts:
            raise InvalidRequestError(
                "sampling_params", f"<{len(params_list)} items>", f"one per prompt ({num_prompts})"
            )
        return params_list

    def _loras_per_prompt(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[tuple[LoRARequest, LoRARef] | None]:
        """Each prompt's adapter and its registration (LoRAAdapterError, before anything
        reaches the core, for an adapter that is not valid for this model)."""
        if lora_request is None or not isinstance(lora_request, Sequence):
            requests: list[LoRARequest | None] = [lora_request] * num_prompts
        else:
            requests = list(lora_request)
            if len(requests) != num_prompts:
                raise InvalidRequestError("lora_request", f"<{len(requests)} items>", f"one per prompt ({num_prompts})")
        refs: dict[int, LoRARef] = {}  # one registration per LoRARequest object
        for request in requests:
            if request is not None and id(request) not in refs:
                refs[id(request)] = self._register_lora(request)
        return [None if request is None else (request, refs[id(request)]) for request in requests]

    def _register_lora(self, lora_request: LoRARequest) -> LoRARef:
        if self.lora_registry is None:
            raise InvalidRequestError(
                "lora_request", lora_request.lora_name,
                "this LLM serves no LoRA adapters (create it with enable_lora=True)",
            )
        return self.lora_registry.ref_for(lora_request)

    def _add_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        priority: int,
        lora: tuple[LoRARequest, LoRARef] | None = None,
    ) -> str:
        request_id = str(next(self._request_counter))
        request = self.input_processor.process(
            request_id, prompt, params, priority=priority, lora=None if lora is None else lora[1]
        )
        if lora is not None:
            self._lora_requests[request_id] = lora[0]
        self.output_processor.add_request(request)
        try:
            self.engine_core.add_requests(request.engine_requests())
        except BaseException:
            self._abort([request_id])
            raise
        return request_id

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.output_processor.has_unfinished_requests():
                processed = self._process_step()
                self.engine_core.abort_requests(processed.reqs_to_abort)
                for request_output in processed.request_outputs:
                    if request_output.finished:
                        request_output.lora_request = self._lora_requests.pop(request_output.request_id, None)
                        finished[request_output.request_id] = request_output
                        if progress is not None:
                            progress.update(1)
            # Every request has its output; let the core release what it still holds.
            self.engine_core.drain()
        except BaseException:
            # Interrupted (Ctrl-C) or failed: leave the engine clean for the next call.
            self._abort(request_ids)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in request_ids]

    def _process_step(self) -> ProcessedOutputs:
        """One engine step's outputs, recorded by the stat loggers if any."""
        if self.stat_logger is None:
            return self.output_processor.process_outputs(self.engine_core.get_output())
        message = self.engine_core.next_outputs()
        now = time.time()
        iteration_stats = IterationStats(iteration_timestamp=now) if message.outputs else None
        processed = self.output_processor.process_outputs(message.outputs, now, iteration_stats)
        self.stat_logger.record(message.scheduler_stats, iteration_stats, message.num_scheduled_tokens)
        self.stat_logger.maybe_log()
        return processed

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._lora_requests.pop(request_id, None)
        iteration_stats = IterationStats() if self.stat_logger is not None else None
        engine_request_ids = self.output_processor.abort_requests(request_ids, iteration_stats)
        if self.stat_logger is not None and iteration_stats is not None and iteration_stats.finished_requests:
            self.stat_logger.record(None, iteration_stats)
        self.engine_core.abort_requests(engine_request_ids)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompt_list: list[Any] = list(prompts)
    if prompt_list and isinstance(prompt_list[0], int):
        return [prompt_list]  # one prompt given as token ids
    return prompt_list
