"""The error every checkpoint reader raises (its own module, so the readers
of each format and the loader that picks one can all raise it)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pagedllm.core.errors import PagedLLMError


class ModelLoadError(PagedLLMError):
    """The checkpoint does not fit the model: missing, unexpected or misshaped weights."""

    def __init__(
        self,
        model_path: str | Path,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        detail: str | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        parts = []
        if self.missing:
            parts.append(f"missing weights ({len(self.missing)}): {', '.join(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected weights ({len(self.unexpected)}): {', '.join(self.unexpected)}")
        if detail:
            parts.append(detail)
        super().__init__(f"cannot load {self.model_path}: " + "; ".join(parts))
