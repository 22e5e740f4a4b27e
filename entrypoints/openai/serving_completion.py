"""POST /v1/completions: one engine request per prompt (each with n samples);
choice index = prompt index * n + sample index, as in vLLM."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response, StreamingResponse

from pagedllm.entrypoints.openai.errors import OpenAIServingError
from pagedllm.entrypoints.openai.fast_tokenizer import decode_tokens, encode_text
from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    usage_info,
)
from pagedllm.entrypoints.openai.response_body import (
    JSONFragmentsResponse,
    encode_each,
    encode_in_pool,
    encode_list,
    encode_model,
    stop_when,
)
from pagedllm.entrypoints.openai.response_size import (
    CHOICE_BYTES,
    check_response_size,
    completion_token_bytes,
)
from pagedllm.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    OpenAIServing,
    first_and_rest,
    merge_async_iterators,
    request_body_size,
    run_until_disconnect,
    sse_lines,
)

if TYPE_CHECKING:
    from fastapi import Request

    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.engine.outputs import PromptLogprobs, RequestOutput, SampleLogprobs
    from pagedllm.structured_output.validator import GrammarCheck

# vLLM clamps -inf logprobs so the JSON stays finite.
MIN_LOGPROB = -9999.0


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        lora = await self.model_lora(request.model)
        self.check_stream_options(request.stream, request.stream_options)
        # All prompts x n at once, or a 400 / 503, before any prompt is tokenized.
        # NOTE: the schema makes prompt non-empty; its first item says its form.
        prompt = request.prompt
        num_prompts = 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)
        admission = self.engine.admit(num_prompts, request.n)
        try:
            prompts, params, grammar = await self.pool.run(self._prepare, request)
        finally:
            self.pool.note_request_size(request_body_size(raw_request))
        try:
            compiled_grammar = await self.check_grammar(grammar, raw_request, request)
        except ClientDisconnected:
            return Response(status_code=499)

        request_id = f"cmpl-{uuid.uuid4().hex}"
        generators = [
            self.engine.generate(
                token_ids, params, f"{request_id}-{index}", prompt_text=text, priority=request.priority,
                cache_salt=request.cache_salt, output_kind=request.output_kind(), admission=admission,
                validated=True, compiled_grammar=compiled_grammar, **self.lora_kwargs(lora),
            )
            for index, (text, token_ids) in enumerate(prompts)
        ]
        merged = merge_async_iterators(*generators)
        if request.stream:
            first, rest = await first_and_rest(merged)
            return StreamingResponse(
                sse_lines(self._stream(request, request_id, prompts, first, rest)), media_type="text/event-stream"
            )
        response = await run_until_disconnect(raw_request, self._collect(request, request_id, prompts, merged))
        if response is None:
            return Response(status_code=499)
        return JSONFragmentsResponse(response)

    def _prepare(
        self, request: CompletionRequest
    ) -> tuple[list[tuple[str | None, list[int]]], SamplingParams, GrammarCheck | None]:
        """Tokenize, build the sampling parameters, validate every prompt, and
        the grammar check to await. Blocking (a long prompt): runs in the pool."""
        prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        defaults = self.default_sampling_params
        params = request.sampling_params(
            request.requested_max_tokens(defaults), request.logprobs, prompt_logprobs or request.prompt_logprobs,
            defaults=defaults,
        )
        prompts = [self._truncate(text, token_ids, params) for text, token_ids in self._tokenize_prompts(request)]
        for _, token_ids in prompts:
            self.validate_prompt(token_ids, params, request)
        grammar = self.grammar_check(params, request)
        if request.echo:  # the echoed text of token-id prompts, decoded here rather than on the loop
            prompts = [(self._prompt_text(text, token_ids), token_ids) for text, token_ids in prompts]
        if not request.stream:
            self._check_response_size(request, prompts, params)
        return prompts, params, grammar

    def _check_response_size(
        self, request: CompletionRequest, prompts: list[tuple[str | None, list[int]]], params: SamplingParams
    ) -> None:
        """400 when the body could exceed server.max_response_bytes (response_size.py)."""
        token_bytes = self.max_token_bytes
        per_token = completion_token_bytes(token_bytes, request.logprobs)
        estimate = most_tokens = 0
        for text, token_ids in prompts:
            max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
            most_tokens = max(most_tokens, max_tokens)
            choice_bytes = CHOICE_BYTES + max_tokens * per_token
            if request.echo:  # the prompt's text, and its tokens' logprob entries
                choice_bytes += len(json.dumps(text, ensure_ascii=False).encode())
                choice_bytes += len(token_ids) * (per_token - token_bytes)
            estimate += request.n * choice_bytes
        detail = (
            f"{len(prompts)} prompt(s) x n={request.n} choices of up to max_tokens={most_tokens} tokens, "
            f"{per_token} bytes per token with logprobs={request.logprobs}"
            f"{' and echo' if request.echo else ''}; the longest token is {token_bytes} bytes"
        )
        check_response_size(estimate, self.max_response_bytes, detail, "max_tokens")

    def _tokenize_prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt_list: list[Any] = [prompt]
        elif prompt and all(isinstance(item, int) for item in prompt):
            prompt_list = [prompt]  # one prompt given as token ids
        else:
            prompt_list = list(prompt)
        if not prompt_list:
            raise OpenAIServingError(400, "prompt: at least one prompt is required", "prompt")
        # A prompt to truncate may be longer than the context.
        max_num_tokens = None if request.truncate_prompt_tokens is not None else self.max_model_len - 1
        return [
            (item, encode_text(
                self.tokenizer, item, request.add_special_tokens, max_num_tokens,
                split_special_tokens=self.split_special_tokens,
            ))
            if isinstance(item, str) else (None, list(item))
            for item in prompt_list
        ]

    def _truncate(
        self, text: str | None, token_ids: list[int], params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """truncate_prompt_tokens applied; a cut prompt's text is what is left
        (decoded when echoed), as vLLM echoes it."""
        truncated = self.engine.input_processor.truncate(token_ids, params)
        return (text, token_ids) if truncated is token_ids else (None, truncated)

    def _prompt_text(self, text: str | None, token_ids: list[int]) -> str:
        return text if text is not None else decode_tokens(self.tokenizer, token_ids)

    async def _collect(
        self, request: CompletionRequest, request_id: str, prompts: list[tuple[str | None, list[int]]],
        merged: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> list[bytes]:
        finals: dict[int, RequestOutput] = {}
        async for prompt_index, output in merged:
            finals[prompt_index] = output  # FINAL_ONLY: one output per prompt
        # NOTE: built and encoded in the pool, never on the event loop (response_body.py).
        return await encode_in_pool(self.pool, self._encode_response, request, request_id, prompts, finals)

    def _encode_response(
        self, request: CompletionRequest, request_id: str, prompts: list[tuple[str | None, list[int]]],
        finals: dict[int, RequestOutput], cancelled: threading.Event,
    ) -> list[bytes]:
        """The CompletionResponse as JSON fragments. Blocking: runs in the pool."""
        num_generated = sum(len(c.token_ids) for output in finals.values() for c in output.outputs)
        usage = usage_info(sum(len(token_ids) for _, token_ids in prompts), num_generated,
                           sum(output.num_cached_tokens for output in finals.values()))
        envelope = CompletionResponse(id=request_id, model=self.response_model(request.model), choices=[], usage=usage)
        choices = stop_when(cancelled, self._choices(request, prompts, finals))
        out: list[bytes] = []
        encode_model(envelope, out, {"choices": lambda _, out: encode_each(choices, out, _encode_choice)})
        return out

    def _choices(
        self, request: CompletionRequest, prompts: list[tuple[str | None, list[int]]],
        finals: dict[int, RequestOutput],
    ) -> Iterator[CompletionResponseChoice]:
        """The choices in order, made one at a time; each output's logprobs
        are let go of once its choice is encoded."""
        for prompt_index, (text, token_ids) in enumerate(prompts):
            output = finals.pop(prompt_index)
            for completion in sorted(output.outputs, key=lambda c: c.index):
                logprobs = None
                if request.num_top_logprobs() is not None:
                    echo_ids = token_ids if request.echo else []
                    logprobs = self._logprobs(
                        request, echo_ids, output.prompt_logprobs, completion.token_ids, completion.logprobs, 0
                    )
                yield CompletionResponseChoice(
                    index=prompt_index * request.n + completion.index,
                    text=(self._prompt_text(text, token_ids) if request.echo else "") + completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
                completion.logprobs = None

    async def _stream(
        self, request: CompletionRequest, request_id: str, prompts: list[tuple[str | None, list[int]]],
        first: tuple[int, RequestOutput] | None, rest: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncGenerator[str, None]:
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        num_choices = len(prompts) * request.n
        echoed = [False] * num_choices
        # Where the next token's text starts in the choice's text (logprobs.text_offset).
        text_offsets = [0] * num_choices
        num_generated = [0] * num_choices
        num_cached = [0] * len(prompts)

        async def outputs() -> AsyncGenerator[tuple[int, RequestOutput], None]:
            if first is not None:
                yield first
            async for item in rest:
                yield item

        async for prompt_index, output in outputs():
            text, prompt_token_ids = prompts[prompt_index]
            num_cached[prompt_index] = max(num_cached[prompt_index], output.num_cached_tokens)
            for completion in output.outputs:
                index = prompt_index * request.n + completion.index
                delta_text = completion.text
                token_ids: Sequence[int] = completion.token_ids
                top_logprobs: Sequence[Any] | None = completion.logprobs
                echo_ids: list[int] = []
                echo_logprobs: PromptLogprobs | None = None
                if request.echo and not echoed[index]:
                    echoed[index] = True
                    delta_text = self._prompt_text(text, prompt_token_ids) + delta_text
                    echo_ids, echo_logprobs = prompt_token_ids, output.prompt_logprobs
                num_generated[index] += len(completion.token_ids)
                # A token whose text is held back (a partial character, a
                # possible stop string) makes a chunk only to carry its logprobs.
                if not delta_text and completion.finish_reason is None and not (
                    request.num_top_logprobs() is not None and token_ids
                ):
                    continue
                logprobs = None
                if request.num_top_logprobs() is not None:
                    logprobs = self._logprobs(
                        request, echo_ids, echo_logprobs, list(token_ids), top_logprobs, text_offsets[index]
                    )
                    if logprobs.tokens:
                        text_offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                chunk = CompletionStreamResponse(
                    id=request_id, model=self.response_model(request.model),
                    choices=[CompletionResponseChoice(
                        index=index, text=delta_text, logprobs=logprobs,
                        finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                    )],
                )
                yield f"data: {chunk.model_dump_json()}\n\n"
        if include_usage:
            num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
            usage_chunk = CompletionStreamResponse(
                id=request_id, model=self.response_model(request.model), choices=[],
                usage=usage_info(num_prompt_tokens, sum(num_generated), sum(num_cached)),
            )
            yield f"data: {usage_chunk.model_dump_json()}\n\n"

    def _logprobs(
        self, request: CompletionRequest, prompt_token_ids: list[int], prompt_logprobs: PromptLogprobs | None,
        token_ids: list[int], logprobs: SampleLogprobs | None, initial_text_offset: int,
    ) -> CompletionLogProbs:
        """Echoed prompt positions first (the first one's logprob is null), then
        the generated ones; each top_logprobs dict holds the chosen token and
        the top `logprobs`, or the logprob_token_ids (vLLM's layout)."""
        num_top = request.num_top_logprobs() or 0
        all_ids = list(prompt_token_ids) + list(token_ids)
        prompt_entries: list[Any] = list(prompt_logprobs or [None] * len(prompt_token_ids))
        prompt_entries += [None] * (len(prompt_token_ids) - len(prompt_entries))
        sample_entries: list[Any] = list(logprobs) if logprobs else [None] * len(token_ids)
        entries = prompt_entries[: len(prompt_token_ids)] + sample_entries
        result = CompletionLogProbs()
        offset = initial_text_offset
        for token_id, entry in zip(all_ids, entries, strict=False):
            if entry is None or token_id not in entry:
                token = self.tokenizer.decode([token_id])
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                chosen = entry[token_id]
                token = _token_text(chosen.decoded_token, token_id, self.tokenizer)
                result.token_logprobs.append(max(chosen.logprob, MIN_LOGPROB))
                top: dict[str, float] = {}
                for rank_index, (top_id, top_logprob) in enumerate(entry.items()):
                    if rank_index > num_top:
                        break
                    top[_token_text(top_logprob.decoded_token, top_id, self.tokenizer)] = max(
                        top_logprob.logprob, MIN_LOGPROB
                    )
                result.top_logprobs.append(top)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
        return result


def _token_text(decoded: str | None, token_id: int, tokenizer: Any) -> str:
    return decoded if decoded is not None else tokenizer.decode([token_id])


def _encode_choice(choice: CompletionResponseChoice, out: list[bytes]) -> None:
    encode_model(choice, out, {"logprobs": _encode_logprobs})


def _encode_logprobs(logprobs: CompletionLogProbs, out: list[bytes]) -> None:
    # All four fields are per-token lists: each in slices.
    encode_model(logprobs, out, dict.fromkeys(CompletionLogProbs.model_fields, encode_list))
