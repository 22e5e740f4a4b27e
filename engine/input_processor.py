"""The front ends' one way in (vLLM's InputProcessor): `LLM` and `AsyncLLM`
both turn a prompt and its SamplingParams into engine requests here.

    processor = InputProcessor(tokenizer, client.ready, config.structured_output)
    request = processor.process("req-0", "Hello", SamplingParams(n=2))
    output_processor.add_request(request)
    client.add_requests(request.engine_requests())   # "0_req-0", "1_req-0"

`process` checks the priority and cache salt, tokenizes (and truncates, with
`truncate_prompt_tokens`), validates the prompt
and the params against the core's READY figures (max_model_len, vocab size,
and the structured-output spec, which it compiles under the time limit),
then fans `n > 1` out into child requests. Every check raises
InvalidRequestError naming the field, whichever front end called.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.core.engine import validate_prompt
from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.int_limits import check_priority
from pagedllm.core.lora import LoRARef
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine.bad_words import bad_words_token_ids
from pagedllm.engine.wire import EngineCoreRequest
from pagedllm.logits_processors.factory import LogitsProcessorArgs
from pagedllm.plugins import get_plugin_manager
from pagedllm.structured_output.manager import grammar_check
from pagedllm.structured_output.validator import GrammarCheck, GrammarValidator, GrammarVocab, get_validator

if TYPE_CHECKING:
    from pagedllm.core.config import StructuredOutputConfig
    from pagedllm.engine.wire import Ready

# A prompt: text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}
# with an optional "cache_salt".
PromptType = str | list[int] | dict[str, Any]
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def child_request_id(index: int, request_id: str) -> str:
    """Sample `index` of an `n > 1` request runs as "{index}_{request_id}" (vLLM)."""
    return f"{index}_{request_id}"


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A validated request and the engine requests it fans out into."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    # (engine request id, params) per sample: the request itself when n == 1,
    # else n children (n=1; seed + index when seeded, see SamplingParams.for_child).
    samples: list[tuple[str, SamplingParams]]
    priority: int = 0
    cache_salt: str | None = None
    eos_token_id: int | None = None
    # The validator's compiled grammar for the spec (see EngineCoreRequest).
    compiled_grammar: bytes | None = None
    # Its LoRA adapter (None: the base model), every sample's.
    lora: LoRARef | None = None

    def engine_requests(self, group_id: str | None = None) -> list[EngineCoreRequest]:
        """The samples as engine requests, in one fair-sharing group: `group_id`
        (an API request's several prompts share one), else this request's id."""
        if group_id is None and len(self.samples) > 1:
            group_id = self.request_id
        return [
            EngineCoreRequest(
                request_id=sample_id,
                prompt_token_ids=self.prompt_token_ids,
                sampling_params=sample_params,
                eos_token_id=self.eos_token_id,
                arrival_time=self.arrival_time,
                priority=self.priority,
                cache_salt=self.cache_salt,
                group_id=group_id,
                # NOTE: the first sample only: the core compiles (or loads)
                # a spec once for all requests that arrive with it.
                compiled_grammar=self.compiled_grammar if index == 0 else None,
                lora=self.lora,
            )
            for index, (sample_id, sample_params) in enumerate(self.samples)
        ]


def make_request(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    params: SamplingParams,
    arrival_time: float | None = None,
    *,
    priority: int = 0,
    cache_salt: str | None = None,
    eos_token_id: int | None = None,
    compiled_grammar: bytes | None = None,
    lora: LoRARef | None = None,
) -> ProcessedRequest:
    """Fan a request out into its samples; no checks (`InputProcessor.process` runs them first)."""
    if params.n == 1:
        samples = [(request_id, params)]
    else:
        samples = [(child_request_id(index, request_id), params.for_child(index)) for index in range(params.n)]
    return ProcessedRequest(
        request_id, prompt, list(prompt_token_ids), params, time.time() if arrival_time is None else arrival_time,
        samples, priority, cache_salt, eos_token_id, compiled_grammar, lora,
    )


class InputProcessor:
    """Validation and request building against one engine core's figures."""

    def __init__(
        self,
        tokenizer: Any,
        ready: Ready,
        structured_output: StructuredOutputConfig,
        logits_processors: Sequence[str] = (),
        enable_lora: bool = False,
    ) -> None:
        """`logits_processors`: the names the engine loads (model.logits_processors),
        whose `validate_params` check every request's extra_args. `enable_lora`:
        the engine serves LoRA adapters (lora.enable_lora), so requests may name one."""
        self.enable_lora = enable_lora
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        # config.json's EOS, else the tokenizer's.
        self.eos_token_id: int | None = (
            ready.eos_token_id if ready.eos_token_id is not None else tokenizer.eos_token_id
        )
        # The generation config's values for the fields a request leaves unset
        # (the server's default_sampling_params, LLM.get_default_sampling_params).
        self.default_sampling_params: dict[str, float | int] = dict(ready.generation.sampling)
        # Every other EOS id (config.json's list, generation_config.json's).
        self.extra_eos_token_ids = [t for t in ready.generation.extra_eos_token_ids if t != self.eos_token_id]
        self.structured_output = structured_output
        self.logits_processor_args = LogitsProcessorArgs(logits_processors, get_plugin_manager())

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams of the generation config's defaults (vLLM's LLM.get_default_sampling_params)."""
        defaults: dict[str, Any] = dict(self.default_sampling_params)
        return SamplingParams(**defaults)

    def with_eos_stops(self, params: SamplingParams) -> SamplingParams:
        """`params` with every other EOS id among its stop_token_ids, unless
        ignore_eos (vLLM's update_from_generation_config): a copy when ids are
        added, so the caller's object is never changed. Such a stop reports
        the id as its stop_reason, as vLLM does."""
        present = params.stop_token_ids or []
        missing = [token_id for token_id in self.extra_eos_token_ids if token_id not in present]
        if params.ignore_eos or not missing:
            return params
        params = params.clone()
        params.stop_token_ids = [*present, *missing]
        return params

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, the dict form's cache_salt) of a prompt."""
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt)), None
        if not isinstance(prompt, dict):
            return None, check_token_ids(prompt), None
        unknown = set(prompt) - PROMPT_KEYS
        if unknown:
            raise InvalidRequestError("prompt", sorted(unknown), "allowed keys: prompt, prompt_token_ids, cache_salt")
        text = prompt.get("prompt")
        token_ids = prompt.get("prompt_token_ids")
        if token_ids is None:
            if not isinstance(text, str):
                raise InvalidRequestError("prompt", prompt, "needs a 'prompt' string or 'prompt_token_ids'")
            token_ids = self.tokenizer.encode(text)
        return text, check_token_ids(token_ids), prompt.get("cache_salt")

    def truncate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt cut to `params.truncate_prompt_tokens` (vLLM's: the last k
        tokens, or the first k with truncation_side "right"; -1 = as many as
        leave one token to generate); the same list when nothing is cut."""
        k = params.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        if k == -1:
            k = self.max_model_len - 1
        elif k >= self.max_model_len:
            raise InvalidRequestError(
                "truncate_prompt_tokens", k,
                f"must be below max_model_len ({self.max_model_len}) so that a token can be generated",
            )
        if len(prompt_token_ids) <= k:
            return prompt_token_ids
        return prompt_token_ids[:k] if params.truncation_side == "right" else prompt_token_ids[-k:]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, *, grammar: bool = True) -> int:
        """The checks before anything reaches the core; returns the effective
        max_tokens. Blocking (a structured-output spec compiles under its time
        limit): the server runs it off the event loop, then passes `validated`.
        `grammar=False`: all but the spec's compile (the server awaits that
        in the validator lane: `grammar_check`, then `get_validator().submit`).
        Tokenizes `params.bad_words` into `params.bad_words_token_ids`."""
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words, self.vocab_size)
        validate_prompt(prompt_token_ids, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        max_tokens = params.validate_against(self.max_model_len, len(prompt_token_ids), self.vocab_size)
        if params.structured_outputs is not None and grammar:
            # A bad schema or grammar is a 400 here, never a compile failure in the core.
            self.validator.validate(self.grammar_check(params))
        self.logits_processor_args.validate(params)
        return max_tokens

    def grammar_check(self, params: SamplingParams) -> GrammarCheck:
        """The spec's cheap checks (InvalidRequestError) and what the validator lane runs."""
        assert params.structured_outputs is not None
        vocab = GrammarVocab.of(self.tokenizer, self.vocab_size, self.eos_token_id)
        return grammar_check(params.structured_outputs, self.structured_output, vocab)

    @property
    def validator(self) -> GrammarValidator:
        return get_validator(self.structured_output.validator_processes)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        prompt_text: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        validated: bool = False,
        compiled_grammar: bytes | None = None,
        lora: LoRARef | None = None,
    ) -> ProcessedRequest:
        """Check, tokenize, validate (unless the caller just ran `validate` on
        these very token ids and params, and passes the validator's
        `compiled_grammar`) and fan out one request; `lora`: its registered
        adapter (lora/registry.py)."""
        check_priority(priority)
        if lora is not None and not self.enable_lora:
            raise InvalidRequestError(
                "lora_request", lora.name, "this engine serves no LoRA adapters (start it with enable_lora=True)"
            )
        text, prompt_token_ids, prompt_salt = self.tokenize(prompt)
        prompt_token_ids = self.truncate(prompt_token_ids, params)
        cache_salt = prompt_salt if cache_salt is None else cache_salt
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt", cache_salt, "must be a string or None")
        if not validated and params.structured_outputs is not None:
            self.validate(prompt_token_ids, params, grammar=False)
            compiled_grammar = self.validator.validate(self.grammar_check(params))
        elif not validated:
            self.validate(prompt_token_ids, params)
        params = self.with_eos_stops(params)
        return make_request(
            request_id, text if prompt_text is None else prompt_text, prompt_token_ids, params,
            priority=priority, cache_salt=cache_salt, eos_token_id=self.eos_token_id,
            compiled_grammar=compiled_grammar, lora=lora,
        )


def check_token_ids(token_ids: Any) -> list[int]:
    """A prompt given as token ids: a list of ints (range checks need the vocab
    size and happen with the other prompt checks in engine.validate_prompt)."""
    if not isinstance(token_ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in token_ids
    ):
        raise InvalidRequestError("prompt_token_ids", token_ids, "must be a list of integers")
    return list(token_ids)
