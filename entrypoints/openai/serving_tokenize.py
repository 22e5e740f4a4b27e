"""POST /tokenize and /detokenize (vLLM's extra routes)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.errors import OpenAIServingError
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIServingError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if request.messages is not None:
            _, token_ids = self.render_chat(request.messages, request.add_generation_prompt)
        else:
            token_ids = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIServingError(
                400, f"tokens={bad[:5]}: token ids must be in [0, {self.vocab_size})", "tokens"
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
