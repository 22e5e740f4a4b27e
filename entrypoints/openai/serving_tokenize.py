"""POST /tokenize and /detokenize (vLLM's extra routes).

Both run in the request pool (a 4 MB prompt takes seconds to tokenize, a
million token ids a second to decode) and answer a ready JSON body, so not
even the serialization of a long token list happens on the event loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import OpenAIServingError
from pagedllm.entrypoints.openai.fast_tokenizer import decode_tokens, encode_text
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, request_body_size

if TYPE_CHECKING:
    from fastapi import Request


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: TokenizeRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIServingError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if request.messages is None:
            for field in ("chat_template", "chat_template_kwargs"):
                if getattr(request, field) is not None:
                    raise OpenAIServingError(400, f"{field}: only allowed with messages", field)
        self.check_chat_template_allowed(request.chat_template, request.chat_template_kwargs)
        try:
            body = await self.pool.run(self._tokenize, request)
        finally:
            self.pool.note_request_size(request_body_size(raw_request))
        return Response(body, media_type="application/json")

    def _tokenize(self, request: TokenizeRequest) -> bytes:
        if request.messages is not None:
            _, token_ids = self.render_chat(
                request.messages, request.add_generation_prompt, request.chat_template, request.chat_template_kwargs
            )
        else:
            # prompt is set: tokenize() checked that exactly one of the two is.
            token_ids = encode_text(
                self.tokenizer, request.prompt or "", add_special_tokens=request.add_special_tokens,
                split_special_tokens=self.split_special_tokens,
            )
        response = TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids)
        return response.model_dump_json().encode()

    async def detokenize(self, request: DetokenizeRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        try:
            body = await self.pool.run(self._detokenize, request)
        finally:
            self.pool.note_request_size(request_body_size(raw_request))
        return Response(body, media_type="application/json")

    def _detokenize(self, request: DetokenizeRequest) -> bytes:
        tokens = request.tokens
        # min/max first: a C pass, where the list comprehension holds the GIL 4x longer.
        if tokens and (min(tokens) < 0 or max(tokens) >= self.vocab_size):
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            raise OpenAIServingError(
                400, f"tokens={bad[:5]}: token ids must be in [0, {self.vocab_size})", "tokens"
            )
        return DetokenizeResponse(prompt=decode_tokens(self.tokenizer, request.tokens)).model_dump_json().encode()
