"""POST /v1/chat/completions: messages through the tokenizer's chat template;
replies end at the template's end-of-turn token when the tokenizer has one."""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncGenerator, Iterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response, StreamingResponse

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.sampling_params import MAX_LOGPROBS
from pagedllm.entrypoints.openai.errors import OpenAIServingError
from pagedllm.entrypoints.openai.fast_tokenizer import decode_tokens
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogprob,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTopLogprob,
    ChatResponseMessage,
    DeltaMessage,
    usage_info,
)
from pagedllm.entrypoints.openai.reasoning import ReasoningStream, server_reasoning_parser, split_reply
from pagedllm.entrypoints.openai.response_body import (
    JSONFragmentsResponse,
    encode_each,
    encode_in_pool,
    encode_list,
    encode_model,
    stop_when,
)
from pagedllm.entrypoints.openai.response_size import CHOICE_BYTES, chat_token_bytes, check_response_size
from pagedllm.entrypoints.openai.serving_completion import MIN_LOGPROB
from pagedllm.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    OpenAIServing,
    first_and_rest,
    merge_async_iterators,
    request_body_size,
    run_until_disconnect,
    sse_lines,
)
from pagedllm.entrypoints.openai.tool_call_output import ChoiceToolCalls
from pagedllm.entrypoints.openai.tool_calls import ToolCallPlan, load_tool_parser, plan_tool_calls

if TYPE_CHECKING:
    from fastapi import Request

    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs
    from pagedllm.entrypoints.openai.request_pool import RequestWorkerPool
    from pagedllm.structured_output.validator import GrammarCheck


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, pool: RequestWorkerPool | None = None) -> None:
        super().__init__(engine, pool)
        # NOTE: at start-up, so an unknown --reasoning-parser fails the server, not a request.
        self.reasoning_parser = server_reasoning_parser(engine)
        # ConfigError at start for --enable-auto-tool-choice without a known parser.
        self.tool_parser_cls = load_tool_parser(self.server_config)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        lora = await self.model_lora(request.model)
        self.check_stream_options(request.stream, request.stream_options)
        self.check_chat_template_allowed(request.chat_template, request.chat_template_kwargs)
        try:
            text, token_ids, params, tools, grammar, grammar_field = await self.pool.run(self._prepare, request)
        finally:
            self.pool.note_request_size(request_body_size(raw_request))
        try:
            compiled_grammar = await self.check_grammar(grammar, raw_request, request, grammar_field)
        except ClientDisconnected:
            return Response(status_code=499)

        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generator = self.engine.generate(
            token_ids, params, request_id, prompt_text=text, priority=request.priority,
            cache_salt=request.cache_salt, output_kind=request.output_kind(), validated=True,
            compiled_grammar=compiled_grammar, **self.lora_kwargs(lora),
        )
        if request.stream:
            first, rest = await first_and_rest(generator)
            return StreamingResponse(
                sse_lines(self._stream(request, request_id, len(token_ids), first, rest, tools)),
                media_type="text/event-stream",
            )
        response = await run_until_disconnect(raw_request, self._collect(request, request_id, generator, tools))
        if response is None:
            return Response(status_code=499)
        return JSONFragmentsResponse(response)

    def _prepare(
        self, request: ChatCompletionRequest
    ) -> tuple[str, list[int], SamplingParams, ToolCallPlan, GrammarCheck | None, str | None]:
        """Render and tokenize, build the sampling parameters, validate; the
        grammar check to await and the field that names its spec (`tools`
        when the tool calls force it). Blocking (the template, a long
        prompt): runs in the pool."""
        tools = plan_tool_calls(request, self.tool_parser_cls)
        # A prompt to truncate may be longer than the context.
        max_num_tokens = None if request.truncate_prompt_tokens is not None else self.max_model_len - 1
        text, token_ids = self.render_chat(
            request.messages, request.add_generation_prompt, request.chat_template, request.chat_template_kwargs,
            max_num_tokens=max_num_tokens, tools=tools.template_tools(),
        )
        forced = tools.structured_outputs()
        try:
            params = self.build_sampling_params(request)
            truncated = self.engine.input_processor.truncate(token_ids, params)
            if truncated is not token_ids:
                text, token_ids = decode_tokens(self.tokenizer, truncated), truncated
            if forced is not None:  # required / named: the grammar writes the calls
                params.structured_outputs = forced
            self.validate_prompt(token_ids, params, request)
            if not request.stream:
                self._check_response_size(request, params, len(token_ids))
            grammar = self.grammar_check(params, request)
        except InvalidRequestError as exc:
            # Name the field the client sent.
            if exc.field == "max_tokens" and request.max_completion_tokens is not None:
                raise InvalidRequestError("max_completion_tokens", exc.value, exc.limit) from None
            if forced is not None and exc.field.startswith("structured_outputs"):
                raise InvalidRequestError("tools", exc.value, exc.limit) from None
            raise
        return text, token_ids, params, tools, grammar, "tools" if forced is not None else None

    def _check_response_size(
        self, request: ChatCompletionRequest, params: SamplingParams, num_prompt_tokens: int
    ) -> None:
        """400 when the body could exceed server.max_response_bytes (response_size.py)."""
        token_bytes = self.max_token_bytes
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        per_token = chat_token_bytes(token_bytes, num_top)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt_tokens
        estimate = request.n * (CHOICE_BYTES + max_tokens * per_token)
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        detail = (
            f"n={request.n} choices of up to {param}={max_tokens} tokens, {per_token} bytes per token with "
            f"logprobs={request.logprobs}, top_logprobs={request.top_logprobs}; the longest token is "
            f"{token_bytes} bytes"
        )
        check_response_size(estimate, self.max_response_bytes, detail, param)

    def build_sampling_params(self, request: ChatCompletionRequest) -> SamplingParams:
        top_logprobs = request.top_logprobs
        if top_logprobs is not None:
            if not request.logprobs:
                raise OpenAIServingError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
            if not 0 <= top_logprobs <= MAX_LOGPROBS:
                raise OpenAIServingError(
                    400, f"top_logprobs={top_logprobs}: must be in [0, {MAX_LOGPROBS}]", "top_logprobs"
                )
        defaults = self.default_sampling_params
        return request.sampling_params(
            request.requested_max_tokens(defaults), (top_logprobs or 0) if request.logprobs else None, None,
            extra_stop_token_ids=self.end_of_turn_token_ids(), defaults=defaults,
        )

    async def _collect(
        self, request: ChatCompletionRequest, request_id: str, generator: AsyncGenerator[RequestOutput, None],
        tools: ToolCallPlan,
    ) -> list[bytes]:
        final: RequestOutput | None = None
        async for _, output in merge_async_iterators(generator):
            final = output  # FINAL_ONLY: one output
        if final is None:  # the engine always ends a request with an output
            raise RuntimeError(f"request {request_id} ended without an output")
        # NOTE: built and encoded in the pool, never on the event loop (response_body.py).
        return await encode_in_pool(self.pool, self._encode_response, request, request_id, final, tools)

    def _encode_response(
        self, request: ChatCompletionRequest, request_id: str, final: RequestOutput, tools: ToolCallPlan,
        cancelled: threading.Event,
    ) -> list[bytes]:
        """The ChatCompletionResponse as JSON fragments. Blocking: runs in the pool."""
        num_generated = sum(len(c.token_ids) for c in final.outputs)
        envelope = ChatCompletionResponse(
            id=request_id, model=self.response_model(request.model), choices=[],
            usage=usage_info(len(final.prompt_token_ids), num_generated, final.num_cached_tokens),
        )
        choices = stop_when(cancelled, self._choices(request, final, tools))
        out: list[bytes] = []
        encode_model(envelope, out, {"choices": lambda _, out: encode_each(choices, out, _encode_choice)})
        return out

    def _choices(
        self, request: ChatCompletionRequest, final: RequestOutput, tools: ToolCallPlan
    ) -> Iterator[ChatCompletionResponseChoice]:
        """The choices in order, made one at a time; each output's logprobs
        are let go of once its choice is encoded."""
        for completion in sorted(final.outputs, key=lambda c: c.index):
            message, finish_reason = self._message(request, tools, completion)
            yield ChatCompletionResponseChoice(
                index=completion.index,
                message=message,
                logprobs=self._logprobs(request, completion.token_ids, completion.logprobs),
                finish_reason=finish_reason,
                stop_reason=completion.stop_reason,
            )
            completion.logprobs = None

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, num_prompt_tokens: int,
        first: RequestOutput | None, rest: AsyncGenerator[RequestOutput, None], tools: ToolCallPlan,
    ) -> AsyncGenerator[str, None]:
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        model = self.response_model(request.model)
        # The role goes in the first delta of every choice, before any content.
        for index in range(request.n):
            yield self._chunk(request_id, model, ChatCompletionStreamChoice(
                index=index, delta=DeltaMessage(role="assistant", content="")
            ))
        num_generated = 0
        num_cached = 0
        choice_tools = [ChoiceToolCalls(tools, self.tokenizer) for _ in range(request.n)]
        parser = self.reasoning_parser
        reasoning = {index: ReasoningStream(parser, request) for index in range(request.n)} if parser else {}

        async def outputs() -> AsyncGenerator[RequestOutput, None]:
            if first is not None:
                yield first
            async for _, item in merge_async_iterators(rest):
                yield item

        async for output in outputs():
            num_cached = max(num_cached, output.num_cached_tokens)
            for completion in output.outputs:
                num_generated += len(completion.token_ids)
                choice_tool_calls = choice_tools[completion.index]
                deltas = _deltas(completion, reasoning.get(completion.index), choice_tool_calls)
                # A token whose text is held back (a partial character, a
                # possible stop string, possible tool-call markup) makes a
                # chunk only to carry its logprobs.
                if not deltas and completion.finish_reason is None and not (
                    request.wants_logprobs() and completion.token_ids
                ):
                    continue
                deltas = deltas or [DeltaMessage()]
                for position, delta in enumerate(deltas):
                    last = position == len(deltas) - 1
                    yield self._chunk(request_id, model, ChatCompletionStreamChoice(
                        index=completion.index,
                        delta=delta,
                        logprobs=self._logprobs(request, completion.token_ids, completion.logprobs)
                        if position == 0 else None,
                        finish_reason=choice_tool_calls.finish_reason(completion.finish_reason) if last else None,
                        stop_reason=completion.stop_reason if last else None,
                    ))
        if include_usage:
            usage_chunk = ChatCompletionStreamResponse(
                id=request_id, model=self.response_model(request.model), choices=[],
                usage=usage_info(num_prompt_tokens, num_generated, num_cached),
            )
            yield f"data: {usage_chunk.model_dump_json()}\n\n"

    def _message(
        self, request: ChatCompletionRequest, tools: ToolCallPlan, completion: CompletionOutput
    ) -> tuple[ChatResponseMessage, str | None]:
        """A finished reply: the reasoning split off first, then the content read for tool calls (as vLLM)."""
        reasoning_content, content = split_reply(self.reasoning_parser, completion.text, request)
        message, finish_reason = ChoiceToolCalls(tools, self.tokenizer).complete(
            content or "", completion.finish_reason
        )
        if content is None and message.content == "":
            message.content = None
        message.reasoning_content = reasoning_content
        return message, finish_reason

    def _chunk(self, request_id: str, model: str, choice: ChatCompletionStreamChoice) -> str:
        chunk = ChatCompletionStreamResponse(id=request_id, model=model, choices=[choice])
        # OpenAI sends only the delta keys that are set ("delta": {} at the end).
        body = chunk.model_dump_json(exclude={"choices": {0: {"delta": set(_unset_delta_keys(choice.delta))}}})
        return f"data: {body}\n\n"

    def _logprobs(
        self, request: ChatCompletionRequest, token_ids: list[int], logprobs: SampleLogprobs | None
    ) -> ChatCompletionLogProbs | None:
        if not request.wants_logprobs() or logprobs is None:
            return None
        num_top = request.top_logprobs or 0
        content = []
        for token_id, entry in zip(token_ids, logprobs, strict=False):
            chosen = entry[token_id]
            if request.logprob_token_ids:  # exactly these, in the order asked
                ranked = [(top_id, entry[top_id]) for top_id in request.logprob_token_ids]
            else:
                ranked = sorted(entry.items(), key=lambda item: item[1].logprob, reverse=True)[:num_top]
            content.append(ChatCompletionLogprob(
                **self._top_logprob(token_id, chosen).model_dump(),
                top_logprobs=[self._top_logprob(top_id, top) for top_id, top in ranked],
            ))
        return ChatCompletionLogProbs(content=content)

    def _top_logprob(self, token_id: int, logprob: Logprob) -> ChatCompletionTopLogprob:
        token = logprob.decoded_token if logprob.decoded_token is not None else self.tokenizer.decode([token_id])
        return ChatCompletionTopLogprob(
            token=token, logprob=max(logprob.logprob, MIN_LOGPROB), bytes=list(token.encode("utf-8"))
        )


def _deltas(
    completion: CompletionOutput, reasoning: ReasoningStream | None, tools: ChoiceToolCalls
) -> list[DeltaMessage]:
    """The deltas of one streamed output: its text split by the reasoning
    parser when there is one, then its content read for tool calls."""
    finished = completion.finish_reason is not None
    if reasoning is None:
        return tools.stream(completion.text, finished)
    piece = reasoning.delta(completion.text, completion.token_ids, finished)
    deltas = tools.stream((piece.content or "") if piece is not None else "", finished)
    if piece is not None and piece.reasoning_content:
        if deltas and deltas[0].tool_calls is None:
            deltas[0] = deltas[0].model_copy(update={"reasoning_content": piece.reasoning_content})
        else:
            deltas.insert(0, DeltaMessage(reasoning_content=piece.reasoning_content))
    return deltas


def _unset_delta_keys(delta: DeltaMessage) -> list[Any]:
    return [name for name in DeltaMessage.model_fields if getattr(delta, name) is None]


def _encode_choice(choice: ChatCompletionResponseChoice, out: list[bytes]) -> None:
    encode_model(choice, out, {"logprobs": _encode_logprobs})


def _encode_logprobs(logprobs: ChatCompletionLogProbs, out: list[bytes]) -> None:
    encode_model(logprobs, out, {"content": encode_list})
