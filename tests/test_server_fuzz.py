"""schemathesis against the live server's own /openapi.json: every route,
schema-valid and schema-invalid bodies, with the API key on and off.

Every answer must be a documented status (never a 5xx), carry the documented
content type, and match the documented response schema; schema-invalid
requests must be refused; with the key on, requests without it must be
refused. Not checked: that every schema-valid request succeeds (schemathesis'
positive_data_acceptance) — a schema cannot say which model is served, the
vocabulary's size or how much context a prompt leaves, so such a request is
rightly a 400 or 404. A failure prints the request that
caused it (schemathesis' reproduction: a curl command).

PAGEDLLM_FUZZ_EXAMPLES scales the examples per route (default 100, which keeps
the suite in its time budget; a run by hand may ask for thousands).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from helpers.server import ServerProcess, start_server
from helpers.tiny_models import cached_tiny_model
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

API_KEY = "fuzz-key"
MODEL_NAME = "tiny-fuzz"
# Short contexts keep every generated request cheap: max_tokens and prompts
# are bounded by the context, n by its own limit.
MAX_MODEL_LEN = 64
EXAMPLES_PER_ROUTE = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "100"))


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=21, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module", params=["open", "api-key"])
def fuzz_server(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[ServerProcess]:
    api_key = API_KEY if request.param == "api-key" else None
    with start_server(
        model_dir, "--num-kv-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name",
        MODEL_NAME, "--max-num-seqs", "64", api_key=api_key,
    ) as server:
        yield server


def fuzz_operation(operation: Any, mode: GenerationMode, server: ServerProcess) -> None:
    """`EXAMPLES_PER_ROUTE` generated requests to one route, each answer checked."""

    @settings(
        max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None, print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        case.call_and_validate(
            base_url=server.base_url, headers=server.headers, timeout=60,
            excluded_checks=[positive_data_acceptance],
        )

    check()


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_every_route_answers_as_documented_and_never_5xx(fuzz_server: ServerProcess, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json", headers=fuzz_server.headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    # The schema really lists the served routes (a fuzz run over nothing proves nothing).
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/health"}
    if mode is GenerationMode.NEGATIVE:
        # A route without a body or parameters has no invalid input to send.
        operations = [op for op in operations if op.body or op.query or op.headers or op.path_parameters]
    failures = []
    for operation in operations:
        try:
            fuzz_operation(operation, mode, fuzz_server)
        except Exception as exc:
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
    assert not failures, "\n\n".join(failures)
