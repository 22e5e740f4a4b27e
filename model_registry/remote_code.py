"""A checkpoint's own Python code (the modules `auto_map` names in its
config.json or tokenizer_config.json) runs only with `--trust-remote-code`.

NOTE: every transformers `from_pretrained` in the package passes
`trust_remote_code` explicitly (never None, which would prompt or guess) and
goes through `remote_code_guard`, so transformers' refusal reads as ours,
naming the flag. vLLM's advisories GHSA-8fr4-5q9j-m8gm and GHSA-2pc9-4j83-qjmr
were code imported without the flag through a side door (a sub-config, a
tokenizer's auto_map): tests/test_trust_remote_code.py checks both doors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pagedllm.core.errors import PagedLLMError

HOW_TO_TRUST = "--trust-remote-code (LLM(trust_remote_code=True), model.trust_remote_code)"


class RemoteCodeError(PagedLLMError):
    """The checkpoint needs its own Python code, and the operator did not trust it."""

    def __init__(self, model_path: str | Path, what: str, detail: str) -> None:
        self.model_path = str(model_path)
        super().__init__(
            f"{model_path}: its {what} needs the Python code the checkpoint ships (auto_map), which pagedllm "
            f"imports only with {HOW_TO_TRUST}; pass it only for a checkpoint you trust ({detail})"
        )


@contextmanager
def remote_code_guard(model_path: str | Path, what: str, trust_remote_code: bool) -> Iterator[None]:
    """Around a transformers load with `trust_remote_code`: its refusal of
    remote code becomes a RemoteCodeError naming pagedllm's flag."""
    try:
        yield
    except ValueError as exc:
        if not trust_remote_code and "trust_remote_code" in str(exc):
            raise RemoteCodeError(model_path, what, str(exc).splitlines()[0]) from None
        raise
