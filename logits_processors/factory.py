"""Loading the configured logits processors, and checking a request's
arguments against them in the front end (before the request is scheduled)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedllm.core.errors import ConfigError, InvalidRequestError, UnknownComponentError

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import EngineConfig
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.logits_processors.interface import LogitsProcessor
    from pagedllm.plugins.manager import PluginManager


def load_logits_processor_classes(
    names: Sequence[str], plugin_manager: PluginManager
) -> list[type[LogitsProcessor]]:
    """The classes `model.logits_processors` names, in order; an unknown or
    repeated name is a ConfigError listing the registered ones."""
    registry = plugin_manager.logits_processors
    if len(set(names)) != len(names):
        raise ConfigError("model.logits_processors", list(names), "each registered name at most once")
    classes = []
    for name in names:
        try:
            classes.append(registry.load(name))
        except UnknownComponentError as exc:
            raise ConfigError(
                "model.logits_processors", name, f"registered logits processors: {', '.join(exc.known) or '(none)'}"
            ) from None
    return classes


def build_logits_processors(
    config: EngineConfig, plugin_manager: PluginManager, device: torch.device
) -> list[LogitsProcessor]:
    """One instance of every configured processor, for one worker."""
    classes = load_logits_processor_classes(config.model.logits_processors, plugin_manager)
    return [cls(config, device) for cls in classes]


class LogitsProcessorArgs:
    """The front end's check of a request's ``extra_args`` against the
    loaded processors (their ``validate_params``) and the registered ones
    that this engine does not load (their declared ``args``)."""

    def __init__(self, names: Sequence[str], plugin_manager: PluginManager) -> None:
        self.classes = dict(zip(names, load_logits_processor_classes(names, plugin_manager), strict=True))
        registry = plugin_manager.logits_processors
        # extra_args key -> a registered processor that reads it but is not loaded.
        self.not_loaded: dict[str, str] = {}
        for registration in registry.registrations():
            if registration.name not in names:
                for key in registration.info.args:
                    self.not_loaded.setdefault(key, registration.name)

    def validate(self, params: SamplingParams) -> None:
        if not params.extra_args:
            return
        for key in params.extra_args:
            name = self.not_loaded.get(key)
            if name is not None:
                raise InvalidRequestError(
                    f"extra_args.{key}", params.extra_args[key],
                    f"it is an argument of logits processor {name!r}, which this engine does not load "
                    "(model.logits_processors, --logits-processors)",
                )
        for name, cls in self.classes.items():
            try:
                cls.validate_params(params)
            except InvalidRequestError:
                raise
            except (TypeError, ValueError) as exc:  # a plugin's own error type: still the client's fault
                raise InvalidRequestError(
                    "extra_args", sorted(params.extra_args), f"refused by logits processor {name!r}: {exc}"
                ) from exc
