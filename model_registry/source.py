"""The model-source interface (plugin kind ``model_source``), apart from the
model interface so that resolving a name (the API process does, before it
starts the engine core) imports no torch. ``pagedllm.model_registry.interface``
re-exports it."""

from __future__ import annotations

from abc import ABC, abstractmethod


class ModelSource(ABC):
    """Names that stand for a model folder (kind ``model_source``, plugin API
    1.2): ``model: tiny`` is the shipped model because the built-in source
    knows the name. Registered with ``register_model_sources``; the engine asks
    each source in registration order and the first answer wins; a name that
    no source knows is a folder or a hub id. Built with no arguments."""

    @abstractmethod
    def resolve(self, name: str) -> str | None:
        """The folder (or hub id) ``name`` stands for; None when this source
        does not know the name."""


__all__ = ["ModelSource"]
