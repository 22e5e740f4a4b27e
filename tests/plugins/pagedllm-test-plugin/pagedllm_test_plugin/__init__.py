"""pagedllm-test-plugin: the hook implementations behind its entry point.

NOTE: registration only names "module:Attr" targets; nothing heavy is
imported until pagedllm selects one of them.
"""

from __future__ import annotations

from pagedllm.plugins import RegisterFn, hookimpl
from pagedllm_test_plugin.options import TestPluginOptions

# The plugin's own options, declared as a module attribute (the
# register_plugin_config hook is the other way, tested with a fixture plugin).
PAGEDLLM_PLUGIN_CONFIG = TestPluginOptions

BACKEND_NAME = "test_echo"
ARCHITECTURE = "TestEchoForCausalLM"
# Next tokens scripted in config.json (scripted.py): what a reasoning model writes.
SCRIPTED_ARCHITECTURE = "TestScriptedForCausalLM"


@hookimpl
def register_attention_backends(register: RegisterFn) -> None:
    register(
        BACKEND_NAME,
        "pagedllm_test_plugin.backend:TestEchoBackend",
        device_types=["cpu", "cuda"],
        dtypes=["float32", "float16", "bfloat16"],
        supports_sliding_window=True,
    )


@hookimpl
def register_models(register: RegisterFn) -> None:
    register(ARCHITECTURE, "pagedllm_test_plugin.model:TestEchoForCausalLM")
    register(SCRIPTED_ARCHITECTURE, "pagedllm_test_plugin.scripted:TestScriptedForCausalLM")


@hookimpl
def register_kv_connectors(register: RegisterFn) -> None:
    register("delayed_free", "pagedllm_test_plugin.connector:DelayedFreeConnector", roles=["both"],
             supports_tensor_parallel=True)


@hookimpl
def register_logits_processors(register: RegisterFn) -> None:
    # Forbids a request's last `ban_recent_tokens` tokens (tests/test_logits_processors.py).
    register("ban_recent", "pagedllm_test_plugin.logits_processor:BanRecentTokens", args=["ban_recent_tokens"])
    # Records the SamplingParams a rank received (tests/test_params_reach_ranks.py).
    register("record_params", "pagedllm_test_plugin.params_recorder:RecordParams", args=["record_params_to"])
