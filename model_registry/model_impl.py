"""Which implementation serves a model: vLLM's ``--model-impl``.

- ``native``: the class a plugin registered for the architecture (the
  built-ins are model_registry/models/); an unregistered one is an error.
- ``transformers``: the Transformers fallback
  (model_registry/transformers_fallback/): transformers' own modeling code
  with paged attention, even where a native class exists.
- ``auto`` (default): native when registered, else the fallback for a
  decoder-only architecture transformers knows.

`resolve_model_impl` decides from names alone (no model is built) and says
why, for the start-up log and ``pagedllm env``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pagedllm.core.errors import ConfigError, UnknownComponentError

if TYPE_CHECKING:
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.plugins.metadata import ModelInfo
    from pagedllm.plugins.registry import Registry

ModelImpl = Literal["auto", "native", "transformers"]


class UnsupportedArchitectureError(UnknownComponentError, ConfigError):
    """No implementation can serve the architecture: no plugin registers it
    and transformers does not know it as a decoder-only causal LM. Both a
    ConfigError (key ``model.architecture``, the name, what is allowed) and
    the unknown-model error an unregistered architecture always raised."""

    def __init__(self, architecture: str, registered: list[str], model_impl: str) -> None:
        self.kind, self.name, self.known = "model", architecture, registered  # UnknownComponentError's
        self.key, self.value = "model.architecture", architecture  # ConfigError's
        self.allowed = (
            f"a registered architecture ({', '.join(sorted(registered)) or 'none'})"
            + ("" if model_impl == "native" else ", or a decoder-only causal LM that transformers knows")
        )
        # NOTE: neither base's __init__ (each builds its own message).
        Exception.__init__(
            self, f"{self.key}={architecture!r} is invalid; allowed: {self.allowed} (model.model_impl={model_impl!r})"
        )


@dataclass(frozen=True)
class ModelImplChoice:
    """The implementation that serves `architecture`, and why."""

    architecture: str
    impl: Literal["native", "transformers"]
    reason: str

    def describe(self) -> str:
        return f"{self.impl} ({self.reason})"


def resolve_model_impl(
    architecture: str, model_impl: str, models: Registry[ModelForCausalLM, ModelInfo]
) -> ModelImplChoice:
    """The implementation `model_impl` picks for `architecture`; a typed
    error when there is none."""
    registered = models.names()
    is_registered = models.canonical(architecture) in registered
    if model_impl == "native" or (model_impl == "auto" and is_registered):
        if not is_registered:
            raise ConfigError(
                "model.model_impl",
                model_impl,
                f"'auto' or 'transformers' for architecture {architecture}, which no plugin registers "
                f"(registered: {', '.join(sorted(registered)) or 'none'})",
            )
        reason = "registered architecture" if model_impl == "auto" else "model_impl='native'"
        return ModelImplChoice(architecture, "native", reason)
    if model_impl not in ("auto", "transformers"):
        raise ConfigError("model.model_impl", model_impl, "'auto', 'native' or 'transformers'")
    from pagedllm.model_registry.transformers_fallback.config import causal_lm_class

    if causal_lm_class(architecture) is None:
        raise UnsupportedArchitectureError(architecture, registered, model_impl)
    if model_impl == "transformers":
        reason = "forced by model_impl='transformers'" + (" over the registered native class" if is_registered else "")
    else:
        reason = "fallback: no plugin registers the architecture"
    return ModelImplChoice(architecture, "transformers", reason)
