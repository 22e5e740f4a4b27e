"""The adapters this server serves: name -> ServedLoRA (vLLM's OpenAIServingModels).

Adapters come from `--lora-modules` at start-up, from `POST
/v1/load_lora_adapter` when the operator allows runtime updates, and from
the LoRA resolver plugins on a request's first use of an unknown name. Each
is loaded once here (`load_lora_adapter`: validated against the base
checkpoint, its digest computed) in a worker thread, never on the event
loop; requests then name it to the engine (`lora_request`), whose front
end turns it into the `LoRARef` the engine core gets (the same digest, the
same loader; the engine core loads the files again and checks it).

NOTE: a name maps to one digest while it is registered; unloading and
loading different files under it gives a new digest, so a new KV identity.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.core.lora import LoRARef
from pagedllm.entrypoints.openai.errors import OpenAIServingError, echo

if TYPE_CHECKING:
    from pagedllm.core.config import LoRAConfig
    from pagedllm.lora.request import LoRARequest
    from pagedllm.lora.resolver import LoRAResolver

logger = logging.getLogger(__name__)

# Runs a blocking function off the event loop (the request worker pool's `run`).
RunInThread = Callable[..., Awaitable[Any]]
# vLLM's switch for the runtime routes, and pagedllm's plain-env spelling of it.
RUNTIME_UPDATING_ENV_VARS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING")
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` item (vLLM's LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class ServedLoRA:
    """A registered adapter: what requests carry and what /v1/models lists."""

    ref: LoRARef
    # The model /v1/models names as its parent (base_model_name, else the served model).
    parent: str
    # vLLM's positive adapter id, one per registration (identity is `ref.digest`).
    lora_int_id: int = 1

    @property
    def lora_request(self) -> LoRARequest:
        """What `engine.generate(lora_request=...)` takes for this adapter."""
        from pagedllm.lora.request import LoRARequest

        return LoRARequest(self.ref.name, self.lora_int_id, self.ref.path, self.parent)


def runtime_updating_allowed(lora: LoRAConfig) -> bool:
    """`lora.allow_runtime_lora_updating`, or vLLM's env var set to 1/true."""
    return lora.allow_runtime_lora_updating or any(
        os.environ.get(var, "").strip().lower() in TRUE_WORDS for var in RUNTIME_UPDATING_ENV_VARS
    )


def load_lora_resolvers(lora: LoRAConfig) -> list[LoRAResolver]:
    """The resolvers `lora.lora_resolvers` names, built, in order
    (UnknownComponentError lists the registered names)."""
    if not lora.lora_resolvers:
        return []
    from pagedllm.plugins import get_plugin_manager

    registry = get_plugin_manager().lora_resolvers
    return [registry.load(name)(lora) for name in lora.lora_resolvers]


def parse_lora_modules(lora: LoRAConfig) -> list[LoRAModulePath]:
    """`lora.lora_modules` as (name, path, base_model_name); ConfigError
    naming the item for a malformed one, a repeated name, or adapters
    without `--enable-lora`."""
    if lora.lora_modules and not lora.enable_lora:
        raise ConfigError("lora.lora_modules", lora.lora_modules, "adapters need --enable-lora")
    modules = [_parse_lora_module(item) for item in lora.lora_modules]
    names = [module.name for module in modules]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError("lora.lora_modules", repeated, "each adapter name once")
    return modules


def _parse_lora_module(item: str) -> LoRAModulePath:
    field = "lora.lora_modules"
    if item.lstrip().startswith("{"):
        try:
            spec = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ConfigError(field, item, f'NAME=PATH or JSON {{"name", "path", "base_model_name"}} ({exc})') from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise ConfigError(field, item, 'JSON items need string "name" and "path"')
        unknown = set(spec) - {"name", "path", "base_model_name"}
        base = spec.get("base_model_name")
        if unknown or not (base is None or isinstance(base, str)):
            raise ConfigError(field, item, 'keys "name", "path" and an optional string "base_model_name"')
        name, path = spec["name"], spec["path"]
    else:
        name, sep, path = item.partition("=")
        base = None
        if not sep:
            raise ConfigError(field, item, "NAME=PATH (or vLLM's JSON form)")
    if not name or not path:
        raise ConfigError(field, item, "a non-empty name and path")
    return LoRAModulePath(name, path, base)


class LoRAModels:
    """name -> ServedLoRA for one server. `run` executes blocking loads off
    the event loop; `register(name, folder)` loads and checks an adapter
    and returns its LoRARef (the engine's `LoRARegistry.register`: the
    engine front end then knows the files and does not hash them again)."""

    def __init__(
        self, lora: LoRAConfig, served_model_names: list[str], run: RunInThread,
        register: Callable[[str, str], LoRARef] | None = None, resolvers: list[LoRAResolver] | None = None,
    ) -> None:
        self.config = lora
        self.served_model_names = served_model_names
        self.run = run
        self.register = register
        self.resolvers = resolvers or []
        self.runtime_updating = runtime_updating_allowed(lora)
        self._adapters: dict[str, ServedLoRA] = {}
        self._next_int_id = itertools.count(1)
        # NOTE: one load at a time: two loads of one name cannot both register.
        self._lock = asyncio.Lock()

    def __iter__(self) -> Iterator[ServedLoRA]:
        return iter(list(self._adapters.values()))

    def get(self, name: str) -> ServedLoRA | None:
        return self._adapters.get(name)

    async def load_startup_modules(self) -> None:
        """Load every `--lora-modules` adapter; ConfigError naming the first bad one."""
        for module in parse_lora_modules(self.config):
            try:
                await self.load(module.name, module.path, module.base_model_name)
            except (InvalidRequestError, OpenAIServingError) as exc:
                raise ConfigError(f"lora.lora_modules[{module.name}]", module.path, str(exc)) from None

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> tuple[ServedLoRA, bool]:
        """Register adapter `name` from folder `path`: (it, True) when newly
        loaded, (it, False) when `name` already holds these very files.
        InvalidRequestError (a 400 naming the field) for a bad adapter or a
        name taken by other content; nothing changes then."""
        self._check_name(name)
        async with self._lock:
            served = await self.run(self._load_blocking, name, path, base_model_name)
            existing = self._adapters.get(name)
            if existing is not None:
                if existing.ref.digest == served.ref.digest:
                    return existing, False
                raise InvalidRequestError("lora_name", name, "an adapter with other content is loaded under this "
                                          "name; unload it first")
            self._adapters[name] = served = dataclasses.replace(served, lora_int_id=next(self._next_int_id))
        logger.info("LoRA adapter %s loaded from %s (digest %s)", name, path, served.ref.digest[:12])
        return served, True

    def unload(self, name: str) -> ServedLoRA:
        """Forget adapter `name` (requests already running keep their ref); 404 if unknown."""
        served = self._adapters.pop(name, None)
        if served is None:
            raise OpenAIServingError(404, f"The lora adapter `{echo(name)}` cannot be found.", "lora_name")
        logger.info("LoRA adapter %s unloaded", name)
        return served

    async def resolve(self, name: str) -> ServedLoRA | None:
        """Adapter `name`, asking the resolver plugins on first use (only with
        runtime updating allowed); None when nobody knows it."""
        served = self._adapters.get(name)
        if served is not None or not self.resolvers or not self.runtime_updating or not self.config.enable_lora:
            return served
        base = self.served_model_names[0]
        for resolver in self.resolvers:
            path = await self._ask(resolver, base, name)
            if path is not None:
                served, _ = await self.load(name, str(path))
                return served
        return None

    async def _ask(self, resolver: LoRAResolver, base_model_name: str, name: str) -> str | Path | None:
        """The resolver's folder for `name`; a resolver that raises or answers
        something else is logged and counts as not knowing the name (one
        broken plugin must not fail every unknown `model`)."""
        try:
            found = resolver.resolve_lora(base_model_name, name)
            if inspect.isawaitable(found):
                found = await found
        except Exception:
            logger.exception("LoRA resolver %s failed for %r", type(resolver).__name__, name)
            return None
        if found is not None and not isinstance(found, (str, Path)):
            logger.error("LoRA resolver %s answered %s for %r, not a folder", type(resolver).__name__,
                         type(found).__name__, name)
            return None
        return found

    def _check_name(self, name: str) -> None:
        if not self.config.enable_lora:
            raise InvalidRequestError("lora_name", name, "LoRA adapters are off on this server (--enable-lora)")
        if not name or name in self.served_model_names:
            raise InvalidRequestError("lora_name", name, "must be non-empty and differ from the base model's names")

    def _load_blocking(self, name: str, path: str, base_model_name: str | None) -> ServedLoRA:
        if self.register is None:
            raise InvalidRequestError("lora_name", name, "LoRA adapters are off on this server (--enable-lora)")
        ref = self.register(name, str(Path(path).expanduser()))
        return ServedLoRA(ref, base_model_name or self.served_model_names[0])
