"""What the completion, chat and tokenize handlers share (vLLM's OpenAIServing):
model-name check, prompt validation before anything reaches the engine,
merging the outputs of several prompts, and aborting when the client leaves.

NOTE: the blocking steps here (tokenizing, rendering a chat template,
validating a request) are plain functions that the handlers run in
`self.pool`, never on the event loop."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from pagedllm.core.config import ServerConfig
from pagedllm.core.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from pagedllm.entrypoints.openai.chat_template import check_chat_template_kwargs, render_chat_template
from pagedllm.entrypoints.openai.errors import (
    OpenAIServingError,
    echo,
    error_body,
    internal_error_message,
    invalid_request_message,
)
from pagedllm.entrypoints.openai.fast_tokenizer import encode_text
from pagedllm.entrypoints.openai.guided_decoding import guided_alias_of
from pagedllm.entrypoints.openai.protocol import ChatMessage, SamplingFields
from pagedllm.entrypoints.openai.request_pool import RequestWorkerPool, shared_request_pool
from pagedllm.entrypoints.openai.response_size import max_token_json_bytes
from pagedllm.entrypoints.openai.tool_calls import check_tool_messages, template_message
from pagedllm.entrypoints.openai.user_text import UserTextSpecials
from pagedllm.model_registry.chat_template import MissingChatTemplateError, has_own_chat_template, load_chat_template
from pagedllm.structured_output.validator import CompileQueueFullError

if TYPE_CHECKING:
    from fastapi import Request

    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.lora_models import LoRAModels, ServedLoRA
    from pagedllm.structured_output.validator import GrammarCheck

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The ChatML end-of-turn token: when the tokenizer has it, chat replies stop there.
END_OF_TURN_TOKEN = "<|im_end|>"
# Slack a chat template may add beyond twice the body: headers per message,
# a default system prompt.
RENDERED_PROMPT_SLACK_CHARS = 1 << 20


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, pool: RequestWorkerPool | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        # Every name a request may send (--served-model-name A B ...); the first is model_name.
        self.served_model_names: list[str] = [self.model_name]
        self.max_model_len: int = engine.max_model_len
        # The served adapters (build_app sets them; None: no LoRA).
        self.lora_models: LoRAModels | None = None
        self.vocab_size: int = engine.vocab_size
        engine_config = getattr(engine, "config", None)
        self.server_config: ServerConfig = engine_config.server if engine_config is not None else ServerConfig()
        aliases = self.server_config.served_model_name or []
        self.served_model_names += [name for name in aliases if name != self.model_name]
        # One pool per engine, shared by the completion, chat and tokenize handlers.
        self.pool = pool or shared_request_pool(engine, self.server_config.request_worker_threads)
        # A rendered prompt is the body's messages plus the template's markup:
        # far more than that is a template manufacturing text, and stopped.
        self.max_rendered_chars = 2 * self.server_config.max_body_bytes + RENDERED_PROMPT_SLACK_CHARS
        self.max_response_bytes = self.server_config.max_response_bytes
        # The operator's template (--chat-template) over the tokenizer's.
        self.chat_template = load_chat_template(self.server_config.chat_template)
        # get_vocab() builds the whole dict: once, not per request.
        end_of_turn = self.tokenizer.get_vocab().get(END_OF_TURN_TOKEN)
        self._end_of_turn_token_ids = [] if end_of_turn is None else [end_of_turn]
        # Special-token strings in what a client writes are text (user_text.py)
        # unless the operator lets them act as special tokens.
        self.split_special_tokens = not self.server_config.parse_special_tokens_in_user_text
        self.user_text_specials = UserTextSpecials.of(self.tokenizer) if self.split_special_tokens else None

    @property
    def default_sampling_params(self) -> dict[str, float | int]:
        """The generation config's values for the fields a request leaves unset (vLLM's name)."""
        defaults: dict[str, float | int] = self.engine.input_processor.default_sampling_params
        return defaults

    @property
    def max_token_bytes(self) -> int:
        """The longest JSON text one token decodes to (the response-size
        estimate's unit). Blocking the first time: call it in the pool."""
        return max_token_json_bytes(self.tokenizer)

    def check_model(self, model: str | None) -> None:
        # NOTE: an omitted model means the served one (vLLM does the same).
        lora_models = self.lora_models
        if model is not None and model not in self.served_model_names and (
            lora_models is None or lora_models.get(model) is None
        ):
            served = ", ".join(f"`{name}`" for name in self.served_model_names)
            raise OpenAIServingError(404, f"The model `{echo(model)}` does not exist; this server serves "
                                     f"{served}.", "model")

    async def model_lora(self, model: str | None) -> ServedLoRA | None:
        """The adapter a request's `model` names (None: the base model),
        asking the LoRA resolvers for a name not yet loaded; 404 when the
        name is neither served nor found."""
        lora_models = self.lora_models
        if model is None or model in self.served_model_names or lora_models is None:
            self.check_model(model)
            return None
        served = await lora_models.resolve(model)
        if served is None:
            self.check_model(model)
        return served

    @staticmethod
    def lora_kwargs(lora: ServedLoRA | None) -> dict[str, Any]:
        """What `engine.generate` takes for an adapter (nothing for the base model)."""
        return {} if lora is None else {"lora_request": lora.lora_request}

    def response_model(self, model: str | None) -> str:
        """The `model` a response names, given the request's (checked already):
        an adapter's name, else the served model's (vLLM does the same)."""
        return self.model_name if model is None or model in self.served_model_names else model

    @staticmethod
    def check_stream_options(stream: bool, stream_options: Any) -> None:
        if stream_options is not None and not stream:
            raise OpenAIServingError(400, "stream_options: only allowed when stream is true", "stream_options")

    def validate_prompt(
        self, prompt_token_ids: list[int], params: SamplingParams, request: SamplingFields | None = None
    ) -> None:
        """The checks the engine would make, done here so a bad request is a
        400 before any of its prompts is scheduled; all but the grammar's
        compile (`grammar_check`, then `await check_grammar`)."""
        try:
            self.engine.input_processor.validate(prompt_token_ids, params, grammar=False)
        except InvalidRequestError as exc:
            raise client_field_error(exc, request) from None

    def grammar_check(self, params: SamplingParams, request: SamplingFields | None = None) -> GrammarCheck | None:
        """The spec's cheap checks (size, depth, backend) and what the validator
        lane will run; None without structured output. Blocking: in the pool."""
        if params.structured_outputs is None:
            return None
        try:
            return self.engine.input_processor.grammar_check(params)
        except InvalidRequestError as exc:
            raise client_field_error(exc, request) from None

    async def check_grammar(
        self, check: GrammarCheck | None, raw_request: Request, request: SamplingFields | None = None,
        field: str | None = None,
    ) -> bytes | None:
        """Await the spec's validation and compile in the validator lane (its
        own threads and processes: no request worker waits on it); returns
        the compiled grammar for the engine core. A refusal is a 400 naming
        the client's field (`field` if given); a client with too many costly
        specs waiting gets a 429. ClientDisconnected if the client leaves
        first (its spec then leaves the lane's queue)."""
        if check is None:
            return None
        try:
            future = self.engine.input_processor.validator.submit(check, client_address(raw_request))
            outcome = await _until_disconnect(raw_request, asyncio.wrap_future(future))
            return outcome.raise_refusal()
        except InvalidRequestError as exc:
            renamed = client_field_error(exc, request)
            raise renamed if field is None else InvalidRequestError(field, exc.value, exc.limit) from None
        except CompileQueueFullError as exc:
            param = field or client_field_error(InvalidRequestError(exc.field, None, ""), request).field
            raise OpenAIServingError(429, str(exc), param) from None

    def check_chat_template_allowed(
        self, chat_template: str | None, chat_template_kwargs: dict[str, Any] | None
    ) -> None:
        """A request's own template is code the server would run: refused
        unless the operator trusts requests (vLLM's --trust-request-chat-template)."""
        if not self.server_config.trust_request_chat_template:
            for field, value in (("chat_template", chat_template), ("chat_template_kwargs", chat_template_kwargs)):
                if value is not None:
                    raise InvalidRequestError(
                        field, f"<{len(value)} {'characters' if isinstance(value, str) else 'keys'}>",
                        "request-supplied chat templates are disabled on this server "
                        "(the operator can enable them with --trust-request-chat-template)",
                    )
        if chat_template_kwargs is not None:
            check_chat_template_kwargs(chat_template_kwargs)

    def render_chat(
        self, messages: list[ChatMessage], add_generation_prompt: bool, chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None, max_num_tokens: int | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """The rendered prompt and its token ids (at most `max_num_tokens` of
        them, else a 400). Blocking: run it in `self.pool` (after
        check_chat_template_allowed)."""
        if not messages:
            raise OpenAIServingError(400, "messages: at least one message is required", "messages")
        check_tool_messages(messages)
        if chat_template is None:
            chat_template = self.chat_template
        if chat_template is None and not has_own_chat_template(self.tokenizer):
            raise MissingChatTemplateError("--chat-template FILE when the server starts")
        conversation = [template_message(m) for m in messages]
        specials = self.user_text_specials
        escaped = specials.escape(conversation, tools, chat_template_kwargs) if specials is not None else None
        if escaped is not None:  # the client wrote special-token strings: render markers in their place
            conversation, tools, chat_template_kwargs = escaped.conversation, escaped.tools, escaped.template_kwargs
        try:
            text = render_chat_template(
                self.tokenizer, conversation, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, template_kwargs=chat_template_kwargs,
                timeout_s=self.server_config.chat_template_timeout_s, max_chars=self.max_rendered_chars,
                tools=tools,
            )
        except InvalidRequestError:
            raise  # a limit, named
        except Exception as exc:  # jinja errors, a tokenizer without a template
            field = "messages" if chat_template is None else "chat_template"
            raise OpenAIServingError(400, f"{field}: the chat template failed: {exc}", field) from None
        if escaped is not None and specials is not None:
            return specials.encode_rendered(self.tokenizer, text, escaped.originals, max_num_tokens)
        # The template already holds every special token it wants.
        return text, encode_text(self.tokenizer, text, False, max_num_tokens)

    def end_of_turn_token_ids(self) -> list[int]:
        return list(self._end_of_turn_token_ids)


class ClientDisconnected(Exception):
    """The client left while its request waited (the handler answers 499)."""


async def _until_disconnect(raw_request: Request, waiting: asyncio.Future[T]) -> T:
    """`waiting`'s result, or ClientDisconnected (and `waiting` cancelled) if
    the client leaves first."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    pending: set[asyncio.Future[Any]] = {waiting, watcher}
    try:
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not waiting.done():
            waiting.cancel()
    if waiting.cancelled():
        raise ClientDisconnected
    return waiting.result()


def client_field_error(exc: InvalidRequestError, request: SamplingFields | None) -> InvalidRequestError:
    """`exc` naming the field the client sent (response_format or guided_*
    rather than structured_outputs, messages rather than prompt, vllm_xargs
    rather than extra_args)."""
    if request is None:
        return exc
    uses_response_format = request.response_format is not None and request.structured_outputs is None
    if uses_response_format and exc.field == "structured_outputs.json":
        return InvalidRequestError("response_format.json_schema.schema", exc.value, exc.limit)
    guided_alias = guided_alias_of(exc.field, request)
    if guided_alias is not None:
        return InvalidRequestError(guided_alias, exc.value, exc.limit)
    if exc.field in ("prompt", "prompt_token_ids"):
        return InvalidRequestError("messages" if hasattr(request, "messages") else "prompt", exc.value, exc.limit)
    if exc.field.startswith("extra_args.") and request.vllm_xargs is not None:
        return InvalidRequestError("vllm_xargs" + exc.field.removeprefix("extra_args"), exc.value, exc.limit)
    return exc


def client_address(raw_request: Request) -> str:
    """Who a request is from, for per-client limits: the peer's address.

    NOTE: not the API key: a server checks one key, shared by all its
    clients, and a key it does not check is a name a client can change on
    every request. Behind a proxy, uvicorn's --forwarded-allow-ips makes this
    the forwarded address."""
    return raw_request.client.host if raw_request.client is not None else ""


def request_body_size(raw_request: Request) -> int:
    """The request's declared body size (0 when not declared)."""
    declared = raw_request.headers.get("content-length", "")
    return int(declared) if declared.isdigit() else 0


async def first_and_rest(iterator: AsyncGenerator[T, None]) -> tuple[T | None, AsyncGenerator[T, None]]:
    """Pull the first item now (so validation, overload and a dead engine are
    an HTTP status, not a stream error), and return it with the iterator."""
    try:
        first = await iterator.__anext__()
    except StopAsyncIteration:
        return None, iterator
    except BaseException:
        await iterator.aclose()
        raise
    return first, iterator


async def merge_async_iterators(*iterators: AsyncGenerator[T, None]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several generators as they come, tagged with the generator's
    index. Closing (or cancelling) this closes every one of them, which aborts
    their requests in the engine."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()
        return
    pending: dict[asyncio.Future[T], int] = {
        asyncio.ensure_future(anext(it)): index for index, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                yield index, item
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
    finally:
        for future in pending:
            future.cancel()
        # Cancelled anext() calls must settle before the generators can close.
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()


async def run_until_disconnect(raw_request: Request, handler: Awaitable[T]) -> T | None:
    """Run a non-streaming handler; if the client disconnects first, cancel
    it (its generators abort their requests) and return None."""
    handler_task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({handler_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        handler_task.cancel()
        watcher.cancel()
        raise
    if handler_task in done:
        watcher.cancel()
        return handler_task.result()
    handler_task.cancel()
    await asyncio.gather(handler_task, return_exceptions=True)
    logger.info("client disconnected from %s; request aborted", raw_request.url.path)
    return None


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


def stream_error_chunk(exc: BaseException) -> str:
    """The `data:` line of an error that happened after the stream started."""
    if isinstance(exc, OpenAIServingError):
        body = error_body(exc.status, exc.message, exc.param)
    elif isinstance(exc, InvalidRequestError):
        body = error_body(400, invalid_request_message(exc), exc.field)
    elif isinstance(exc, (EngineDeadError, EngineOverloadedError)):
        body = error_body(503, str(exc) or type(exc).__name__)
    else:
        body = error_body(500, internal_error_message(exc, "while streaming"))
    return f"data: {json.dumps(body)}\n\n"


DONE_CHUNK = "data: [DONE]\n\n"


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncGenerator[str, None]:
    """Wrap a chunk generator: an error becomes an error chunk, then [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        yield stream_error_chunk(exc)
    yield DONE_CHUNK
