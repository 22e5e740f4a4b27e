"""The ``pagedllm`` command: serve, generate, bench, plugins list/new, env."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import PagedLLMError
from pagedllm.entrypoints.bench.serve import add_bench_parser
from pagedllm.entrypoints.bench.spec import add_spec_parser
from pagedllm.entrypoints.config_flags import add_plugin_config_flags

if TYPE_CHECKING:
    import torch

    from pagedllm.attention_backends.base import AttentionRequirements
    from pagedllm.attention_backends.selector import BackendSelection
    from pagedllm.core.config import EngineConfig
    from pagedllm.platforms.interface import Platform


def _print_json(payload: Any) -> None:
    print(json.dumps(payload, indent=2, default=str))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


# ---- plugins list ------------------------------------------------------


def cmd_plugins_list(args: argparse.Namespace) -> int:
    from pagedllm.core.config import EngineConfig
    from pagedllm.entrypoints.config_flags import engine_config_overrides
    from pagedllm.plugins import API_VERSION, KINDS, get_plugin_manager
    from pagedllm.plugins.manager import BUILTIN_PLUGIN_NAME

    pm = get_plugin_manager()
    # The options as `serve` would build them: flags, env, the config file.
    config = EngineConfig.load(args.config, **engine_config_overrides(args))
    pm.load(config=config.plugins.config)
    components = {
        kind: [
            {
                "name": reg.name,
                "target": reg.target_str,
                "source": reg.source,
                "metadata": _jsonable(reg.metadata),
            }
            for reg in pm.registry(kind).registrations()
        ]
        for kind in KINDS
    }
    plugins = []
    for plugin in pm.plugins():
        is_builtin = plugin.name == BUILTIN_PLUGIN_NAME
        plugins.append(
            {
                "name": plugin.name,
                "source": plugin.source,
                "distribution": plugin.distribution,
                "version": plugin.version,
                # builtins are the API itself; a loaded plugin is compatible by construction
                "api_range": f"=={API_VERSION}" if is_builtin else plugin.api_range,
                "api_compatible": True,
                "api": f"{API_VERSION} (core)" if is_builtin else pm.api_compatibility(plugin.name).label,
                **_plugin_options(pm, plugin.name),
            }
        )
    load_errors = [
        {"plugin": e.plugin, "distribution": e.distribution, "error": e.error, "api_range": e.api_range}
        for e in pm.load_errors
    ]
    payload = {"api_version": API_VERSION, "plugins": plugins, "components": components, "load_errors": load_errors}
    if args.json:
        _print_json(payload)
        return 0
    print(f"pagedllm plugin API {API_VERSION}")
    print("plugins:")
    print(f"  {'NAME':<28} {'SOURCE':<36} API")
    for row in plugins:
        print(f"  {row['name']:<28} {row['source']:<36} {row['api']}")
        if row["config_model"] is not None:
            print(f"  {'':<28} options: {json.dumps(row['options'])}")
    for kind, regs in components.items():
        print(f"{kind}:")
        if not regs:
            print("  (none)")
        for reg in regs:
            print(f"  {reg['name']:<28} {reg['source']:<36} {reg['target']}")
    print("load errors:" if load_errors else "load errors: none")
    for err in load_errors:
        print(f"  {err['plugin']} ({err['distribution']}): {err['error']}")
    return 0


def _plugin_options(pm: Any, name: str) -> dict[str, Any]:
    """A plugin's config model and its effective options (or why they are invalid)."""
    from pagedllm.plugins.plugin_config import model_label, options_as_json

    model = pm.plugin_config_model(name)
    if model is None:
        return {"config_model": None, "options": None}
    try:
        options: Any = options_as_json(pm.plugin_config(name))
    except PagedLLMError as exc:
        options = {"error": str(exc)}
    return {"config_model": model_label(model), "options": options}


def cmd_plugins_new(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.plugin_template import create_plugin_package

    package_dir = create_plugin_package(args.name, args.kind, args.dir)
    print(f"created {package_dir}")
    print(f"  pip install -e {package_dir}")
    print(f"  cd {package_dir} && python -m pytest -q")
    return 0


# ---- env ---------------------------------------------------------------


def _env_dtype(platform: Platform, requested: str) -> tuple[torch.dtype, str]:
    """The dtype a typical (bfloat16) checkpoint would run in here, and why."""
    import torch

    return platform.resolve_dtype(requested, torch.bfloat16), platform.explain_dtype(requested, torch.bfloat16)


def _env_requirements(args: argparse.Namespace) -> AttentionRequirements:
    """What the attention backend is checked for: `--model`'s layers (its
    model class reads its config.json), else the flags."""
    from pagedllm.attention_backends.base import AttentionRequirements

    if args.model is None:
        return AttentionRequirements((args.head_size,), args.sliding_window, args.logits_soft_cap, args.sinks)
    from pagedllm.model_registry.interface import attention_requirements_of
    from pagedllm.model_registry.loader import get_architecture, load_hf_config
    from pagedllm.model_registry.model_impl import resolve_model_impl
    from pagedllm.model_registry.model_source import resolve_config_folder
    from pagedllm.plugins import get_plugin_manager
    from pagedllm.worker.worker import load_model_class

    manager = get_plugin_manager()
    hf_config = load_hf_config(resolve_config_folder(args.model, manager), args.trust_remote_code)
    choice = resolve_model_impl(get_architecture(hf_config), args.model_impl, manager.models)
    return attention_requirements_of(load_model_class(choice, manager), hf_config)


def _env_features(requirements: AttentionRequirements) -> str:
    """What the model's layers ask besides the head size, as `checked for` prints it."""
    features = [f"sliding_window={requirements.sliding_window}"] if requirements.sliding_window is not None else []
    if requirements.logits_soft_cap is not None:
        features.append(f"logits_soft_cap={requirements.logits_soft_cap:g}")
    features += ["sinks"] if requirements.sinks else []
    return "".join(f" {feature}" for feature in features)


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    from pagedllm.attention_backends.selector import check_backend, select_attention_backend
    from pagedllm.platforms import resolve_platform
    from pagedllm.platforms.interface import dtype_name
    from pagedllm.plugins import get_plugin_manager

    platform = resolve_platform(args.platform)
    dtype, dtype_reason = _env_dtype(platform, args.dtype)
    kv_cache_dtype = platform.resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    # What a model's attention layers ask (GPT-OSS: --sinks --sliding-window 128, or --model PATH).
    requirements = _env_requirements(args)
    checks: dict[str, Any] = dict(
        head_size=requirements.head_sizes[0], dtype=dtype, block_size=args.block_size, kv_cache_dtype=kv_cache_dtype,
        requirements=requirements,
    )
    selection = select_attention_backend(platform, args.attention_backend, load=False, **checks)
    registry = get_plugin_manager().attention_backends
    capability = platform.get_device_capability()
    # every registered backend's verdict here, not only those "auto" reached
    backends = {name: check_backend(registry.get(name), platform, **checks) for name in registry.names()}
    payload = {
        "platform": platform.name,
        "device": platform.get_device_name(),
        "device_capability": list(capability) if capability is not None else None,
        "attention_backend": selection.name,
        "rejected": selection.rejected,
        "backends": backends,
        "dtype": dtype_name(dtype),
        "dtype_reason": dtype_reason,
        "kv_cache_dtype": dtype_name(kv_cache_dtype),
        "model": args.model,
        "head_size": requirements.head_sizes[0],
        "head_sizes": list(requirements.head_sizes),
        "block_size": args.block_size,
        "sliding_window": requirements.sliding_window,
        "logits_soft_cap": requirements.logits_soft_cap,
        "sinks": requirements.sinks,
        "torch": torch.__version__,
        **_env_executor(args, platform),
        **_env_model_impl(args),
        "step_cost": _env_step_cost(),
    }
    if args.json:
        _print_json(payload)
        return 0
    cap = "n/a" if capability is None else f"{capability[0]}.{capability[1]}"
    rows = [
        ("platform", payload["platform"]),
        ("device", payload["device"]),
        ("compute capability", cap),
        ("torch", payload["torch"]),
        ("dtype", f"{payload['dtype']} ({dtype_reason})"),
        ("kv cache dtype", f"{payload['kv_cache_dtype']} (cache_dtype {args.kv_cache_dtype})"),
        ("checked for", f"dtype={payload['dtype']} kv_cache_dtype={payload['kv_cache_dtype']} "
                        f"head_size={','.join(map(str, requirements.head_sizes))} block_size={args.block_size}"
                        f"{_env_features(requirements)}"),
        ("attention backend", selection.name),
        ("executor", payload["executor"]),
        ("world size", payload["world_size"]),
        ("communicator", payload["communicator"]),
        ("step cost model", payload["step_cost"]["summary"]),
    ]
    if "model_impl" in payload:
        rows.append(("model", f"{payload['architecture']}: {payload['model_impl']} ({payload['model_impl_reason']})"))
    for label, value in rows:
        print(f"{label + ':':<20}{value}")
    print("rejected:" if selection.rejected else f"{'rejected:':<20}none")
    for name, reasons in selection.rejected.items():
        print(f"  {name}: {'; '.join(reasons)}")
    _print_other_backends(platform, selection, backends)
    return 0


def _env_step_cost() -> dict[str, Any]:
    """The step cost model the scheduler bounds steps with (core/step_cost.py):
    its terms and the default target; its fit is the running server's
    (/metrics `pagedllm:step_cost_*`)."""
    from pagedllm.core.step_budget import (
        AUTO_DECODE_FACTOR,
        AUTO_MIN_STEP_S,
        BACKLOG_HORIZON_STEPS,
        MIN_PREFILL_TOKENS,
    )
    from pagedllm.core.step_cost import TERMS

    return {
        "terms": list(TERMS),
        "auto_target": {"decode_factor": AUTO_DECODE_FACTOR, "min_step_s": AUTO_MIN_STEP_S},
        "min_prefill_tokens": MIN_PREFILL_TOKENS,
        "backlog_horizon_steps": BACKLOG_HORIZON_STEPS,
        "summary": f"seconds = {' + '.join(TERMS)} terms, fitted on the running steps (/metrics "
                   f"pagedllm:step_cost_*); target max({AUTO_MIN_STEP_S * 1000:g} ms, "
                   f"{AUTO_DECODE_FACTOR:g}x decodes) unless --max-step-latency-ms",
    }


def _env_executor(args: argparse.Namespace, platform: Platform) -> dict[str, Any]:
    """The executor `-tp N` with `--distributed-executor-backend` would run,
    its world size and the collectives its ranks would use (or why it cannot run)."""
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.errors import PagedLLMError
    from pagedllm.engine.builder import executor_name, select_executor
    from pagedllm.plugins import get_plugin_manager

    config = EngineConfig.from_flat(
        tensor_parallel_size=args.tensor_parallel_size, distributed_executor_backend=args.distributed_executor_backend
    )
    name = executor_name(config)
    try:
        select_executor(config, get_plugin_manager())
    except PagedLLMError as exc:
        name = f"{name} (cannot run: {exc})"
    world_size = config.parallel.tensor_parallel_size
    communicator = platform.describe_communicator() if world_size > 1 else "none (one rank)"
    return {"executor": name, "world_size": world_size, "communicator": communicator}


def _env_model_impl(args: argparse.Namespace) -> dict[str, Any]:
    """Which implementation would serve `--model` under `--model-impl`, and
    why (nothing without `--model`)."""
    if args.model is None:
        return {}
    from pagedllm.model_registry.loader import get_architecture, load_hf_config
    from pagedllm.model_registry.model_impl import resolve_model_impl
    from pagedllm.model_registry.model_source import resolve_config_folder
    from pagedllm.plugins import get_plugin_manager

    plugin_manager = get_plugin_manager()
    model_path = resolve_config_folder(args.model, plugin_manager)
    architecture = get_architecture(load_hf_config(model_path, args.trust_remote_code))
    choice = resolve_model_impl(architecture, args.model_impl, plugin_manager.models)
    return {"architecture": architecture, "model_impl": choice.impl, "model_impl_reason": choice.reason}


def _print_other_backends(platform: Platform, selection: BackendSelection, backends: dict[str, list[str]]) -> None:
    """Backends "auto" never reached (after the chosen one, or not in the
    platform's priority list): still say why each could or could not run."""
    others = {name: reasons for name, reasons in backends.items()
              if name != selection.name and name not in selection.rejected}
    if others:
        print("other backends:")
    priority = platform.get_attention_backend_priority()
    for name, reasons in others.items():
        if reasons:
            verdict = "; ".join(reasons)
        elif name in priority:
            verdict = "usable here, lower in the platform's priority"
        else:
            verdict = f"usable here when selected by name (not in {platform.name}'s priority list)"
        print(f"  {name}: {verdict}")


# ---- generate ----------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.engine.llm import LLM

    llm = LLM(model=args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    outputs = llm.generate([args.prompt], params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


# ---- serve -------------------------------------------------------------


def serve_config(args: argparse.Namespace) -> EngineConfig:
    """Flags, then env (PAGEDLLM_...; PAGEDLLM_API_KEY for the key), then the
    config file, then defaults."""
    from pagedllm.core.config import EngineConfig
    from pagedllm.entrypoints.config_flags import engine_config_overrides

    overrides = engine_config_overrides(args)
    model = args.model if args.model is not None else args.model_flag
    if model is not None:
        overrides.setdefault("model", {})["model"] = model
    server = overrides.setdefault("server", {})
    api_key = os.environ.get("PAGEDLLM_API_KEY")
    if "api_key" not in server and api_key and "PAGEDLLM_SERVER__API_KEY" not in os.environ:
        server["api_key"] = api_key  # env beats the file: pass it at the flags' level
    return EngineConfig.load(args.config, **overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedllm.engine.core_start import start_async_engine_core
    from pagedllm.engine.metrics import stat_logger_names
    from pagedllm.entrypoints.openai.lora_models import load_lora_resolvers, parse_lora_modules
    from pagedllm.model_registry.chat_template import load_chat_template
    from pagedllm.model_registry.model_source import resolve_hub_models

    config = serve_config(args)
    stat_logger_names(config)  # an unknown stat logger fails before the engine core starts
    parse_lora_modules(config.lora)  # so does a malformed --lora-modules, or one without --enable-lora
    load_lora_resolvers(config.lora)  # and an unknown --lora-resolvers name
    load_chat_template(config.server.chat_template)  # so does a --chat-template path that is not there
    # Downloaded here, once: the engine core and the API process get folders.
    config = resolve_hub_models(config)
    if "PAGEDLLM_LOG_LEVEL" not in os.environ:
        # The periodic stats line and the startup banner are INFO.
        logging.getLogger("pagedllm").setLevel(logging.INFO)
    # NOTE: the engine core starts first, before the HTTP stack is imported:
    # it imports torch and loads the model while this process imports fastapi
    # and uvicorn and loads the tokenizer (two cores, one start).
    engine_core = start_async_engine_core(config)
    try:
        from pagedllm.entrypoints.openai.api_server import run_server
    except BaseException:
        engine_core.shutdown()
        raise
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled
        run_server(config, engine_core)
    return 0


def add_serve_parser(sub: Any) -> None:
    from pagedllm.entrypoints.config_flags import add_engine_config_flags

    serve = sub.add_parser(
        "serve", allow_abbrev=False,
        help="OpenAI-compatible HTTP server",
        description="Serve MODEL (default: the embedded tiny model) over an OpenAI-compatible HTTP API. "
        "Every engine setting has a flag; precedence: flags, env (PAGEDLLM_<SECTION>__<KEY>), "
        "--config file (YAML or TOML), defaults.",
    )
    serve.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="model folder, hub id, or a shipped model: tiny (default), tiny-draft")
    serve.add_argument("--model", dest="model_flag", default=None, help="same as MODEL (vLLM's api_server flag)")
    serve.add_argument("--config", default=None, metavar="FILE", help="engine config file (.yaml, .yml, .toml)")
    add_engine_config_flags(serve, skip=frozenset({("model", "model")}))
    serve.set_defaults(func=cmd_serve)


def cmd_disagg_proxy(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.disagg_proxy import run_proxy

    with contextlib.suppress(KeyboardInterrupt):
        run_proxy(args.prefill, args.decode, args.host, args.port)
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.router.app import run_router

    with contextlib.suppress(KeyboardInterrupt):
        run_router(args.backend, policy=args.policy, host=args.host, port=args.port,
                   api_key=args.api_key or os.environ.get("PAGEDLLM_ROUTER_API_KEY"),
                   backend_api_key=args.backend_api_key, max_body_bytes=args.max_body_bytes)
    return 0


# ---- parser ------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="pagedllm", description="pagedllm LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)

    gen = sub.add_parser("generate", allow_abbrev=False, help="generate text for one prompt")
    gen.add_argument("--model", default=None,
                     help="model folder, hub id, or a shipped model: tiny (default), tiny-draft")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    plugins = sub.add_parser("plugins", allow_abbrev=False, help="inspect plugins")
    plugins_sub = plugins.add_subparsers(dest="plugins_command", required=True)
    plugins_list = plugins_sub.add_parser("list", allow_abbrev=False, help="every kind, name, source and load error")
    plugins_list.add_argument("--json", action="store_true")
    add_plugin_config_flags(plugins_list)
    plugins_list.set_defaults(func=cmd_plugins_list)
    plugins_new = plugins_sub.add_parser(
        "new", allow_abbrev=False,
        help="generate a plugin package skeleton (pyproject entry point, hooks, README, a test)",
        description="Write DIR/NAME: a pip-installable package that registers one component of KIND "
        "through the pagedllm.plugins entry point, with a test that passes once it is installed.",
    )
    plugins_new.add_argument("name", metavar="NAME", help="distribution name, e.g. pagedllm-my-backend")
    plugins_new.add_argument("--kind", required=True, choices=["attention", "model", "platform"])
    plugins_new.add_argument("--dir", default=".", metavar="DIR", help="parent folder (default: .)")
    plugins_new.set_defaults(func=cmd_plugins_new)

    env = sub.add_parser("env", allow_abbrev=False, help="platform, device and attention backend decision")
    env.add_argument("--json", action="store_true")
    env.add_argument("--platform", default="auto")
    env.add_argument("--attention-backend", default="auto")
    env.add_argument("--dtype", default="auto")
    env.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                     help="the KV cache's storage dtype to check the backends for")
    env.add_argument("--head-size", type=int, default=128)
    env.add_argument("--block-size", type=int, default=16)
    env.add_argument("--sliding-window", type=int, default=None, metavar="N",
                     help="check the backends for a model with a sliding window of N tokens")
    env.add_argument("--logits-soft-cap", type=float, default=None, metavar="CAP",
                     help="check the backends for a model that soft-caps attention logits (Gemma 2)")
    env.add_argument("--sinks", action="store_true",
                     help="check the backends for a model with attention sinks (GPT-OSS)")
    env.add_argument("--model", default=None, metavar="PATH",
                     help="check the backends for this model's attention layers (its config.json; "
                          "overrides --head-size and the three flags above)")
    env.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    env.add_argument("--distributed-executor-backend", default="auto", metavar="NAME")
    env.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                     help="which implementation serves --model (as serve's --model-impl): env says which and why")
    env.add_argument("--trust-remote-code", action="store_true",
                     help="let --model's config.json import the Python code its auto_map names (as serve's flag)")
    env.set_defaults(func=cmd_env)

    proxy = sub.add_parser(
        "disagg-proxy", allow_abbrev=False,
        help="disaggregated prefill: prefill server first (max_tokens 1), then the decode server",
    )
    proxy.add_argument("--prefill", required=True, metavar="URL", help="the prefill (producer) server")
    proxy.add_argument("--decode", required=True, metavar="URL", help="the decode (consumer) server")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.set_defaults(func=cmd_disagg_proxy)

    router = sub.add_parser(
        "router", allow_abbrev=False,
        help="an OpenAI-compatible front door over several `pagedllm serve` backends, cache-aware",
    )
    router.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="a `pagedllm serve` backend (repeat the flag for each; run them with --enable-kv-events)")
    router.add_argument("--policy", default="prefix_aware", metavar="NAME",
                        help="a registered routing policy: prefix_aware (default), least_loaded, round_robin, ...")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--api-key", default=None, help="the key clients of the router must send "
                        "(also PAGEDLLM_ROUTER_API_KEY)")
    router.add_argument("--backend-api-key", default=None, help="the key the backends require, if any")
    router.add_argument("--max-body-bytes", type=int, default=4 << 20,
                        help="larger request bodies are refused (413) before any parsing")
    router.set_defaults(func=cmd_router)
    add_bench_parser(sub)
    add_spec_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("PAGEDLLM_LOG_LEVEL", "WARNING").upper())
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except PagedLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a model path that does not exist, a file we cannot read
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
