"""An engine stand-in for tests of the HTTP layer alone: every request is
answered at once, each of its n samples `max_tokens` copies of one token
with `logprobs` alternatives, so a test can get a response of any size
without generating it.

    python tests/helpers/fake_engine.py PORT [--body-read-timeout-s S] [--max-response-bytes N]
    # serves build_app(FakeEngine) on 127.0.0.1:PORT until SIGTERM

Its /metrics says how many requests reached generate() (`fake_generate_calls N`).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

from pagedllm.core.config import EngineConfig
from pagedllm.engine.outputs import CompletionOutput, Logprob, RequestOutput

# The token every sample repeats; its alternatives are the next ids.
TOKEN_ID = 300


class FakeEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        from pagedllm.model_registry.tiny import get_tokenizer_dir

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(str(get_tokenizer_dir()))
        self.model_name = "fake"
        self.max_model_len = 2048
        self.vocab_size = len(self.tokenizer)
        self.engine_pid = None
        self.engine_pids: list[int] = []
        self.kv_event_log = None
        # What the HTTP layer asks of an input processor (no grammar, nothing cut).
        self.input_processor = SimpleNamespace(
            validate=lambda prompt_token_ids, params, grammar=True: None,
            truncate=lambda prompt_token_ids, params: prompt_token_ids,
            default_sampling_params={},
        )
        self.num_generate_calls = 0
        self.stat_logger = SimpleNamespace(render=lambda: f"fake_generate_calls {self.num_generate_calls}\n".encode())

    def admit(self, num_prompts: int, n: int) -> None:
        return None

    async def generate(self, prompt_token_ids: list[int], params: Any, request_id: str,
                       **_: Any) -> AsyncGenerator[RequestOutput, None]:
        self.num_generate_calls += 1
        num_tokens = params.max_tokens
        logprobs = None
        if params.logprobs is not None:
            entry = {token_id: Logprob(-0.5 * (rank + 1), rank + 1, self.tokenizer.decode([token_id]))
                     for rank, token_id in enumerate(range(TOKEN_ID, TOKEN_ID + params.logprobs + 1))}
            logprobs = [entry] * num_tokens
        text = self.tokenizer.decode([TOKEN_ID]) * num_tokens
        completions = [
            CompletionOutput(index=index, text=text, token_ids=[TOKEN_ID] * num_tokens, cumulative_logprob=None,
                             logprobs=None if logprobs is None else list(logprobs), finish_reason="length")
            for index in range(params.n)
        ]
        yield RequestOutput(request_id, None, prompt_token_ids, None, completions, finished=True)

    async def check_health(self) -> None:
        return None

    async def memory_usage(self) -> list[dict[str, int]]:
        return [{"pid": 0, "weights_bytes": 0, "kv_cache_bytes": 0, "kv_cache_resident_bytes": 0}]

    def replica_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def main() -> None:
    import uvicorn

    from pagedllm.core.startup_heap import freeze_startup_heap
    from pagedllm.entrypoints.openai.api_server import build_app

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("port", type=int)
    parser.add_argument("--body-read-timeout-s", type=float, default=30.0)
    parser.add_argument("--max-response-bytes", type=int, default=256 << 20)
    args = parser.parse_args()
    config = EngineConfig.load(server={"body_read_timeout_s": args.body_read_timeout_s,
                                       "max_response_bytes": args.max_response_bytes})
    app = build_app(FakeEngine(config), config)  # type: ignore[arg-type]
    freeze_startup_heap()  # as serve() does
    asyncio.run(uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning")).serve())


if __name__ == "__main__":
    main()
