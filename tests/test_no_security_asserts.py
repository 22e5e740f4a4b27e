"""No `assert` in the package guards user input, a path, a size, auth or a
limit (python -O strips them, and a user error must be a typed 400): the
asserts left are internal invariants that narrow a type for mypy, listed
here with their count. A new one is reviewed by adding it to the list (or,
when it checks anything a user controls, replaced by a typed error)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Not part of the installed package.
NOT_PACKAGE = frozenset({"tests", "training", "benchmarks", "examples", "docs"})
# (file, the asserted expression) -> how many times; each narrows a value the
# code itself produced (an Optional set earlier, a message type it sent).
INTERNAL_INVARIANTS: dict[tuple[str, str], int] = {
    ("attention_backends/torch_native.py", "group.token_rows is not None"): 1,
    ("attention_backends/torch_native.py", "query_len is not None"): 1,
    ("core/custom_stats.py", "isinstance(observations, list)"): 1,
    ("core/custom_stats.py", "isinstance(previous, float)"): 2,
    ("core/custom_stats.py", "isinstance(value, float)"): 2,
    ("core/custom_stats.py", "isinstance(value, list)"): 1,
    ("core/kv_cache/block_pool.py", "block_hash is not None"): 1,
    ("core/kv_cache/block_pool.py", "last is not None"): 1,
    ("core/kv_cache/block_pool.py", "prev_block is not None and next_block is not None"): 1,
    ("engine/input_processor.py", "params.structured_outputs is not None"): 1,
    ("engine/output_processor.py", "detokenizer is not None"): 1,
    ("engine/output_processor.py", "state.finish_reason is not None"): 1,
    ("kv_connectors/cpu_offload.py", "isinstance(metadata, CpuOffloadMetadata)"): 1,
    ("kv_connectors/shared_storage.py", "isinstance(metadata, SharedStorageMetadata)"): 1,
    ("model_registry/batch_graphs.py", "shape is not None"): 1,
    ("platforms/cpu/graph.py", "self.output is not None"): 1,
    ("platforms/cpu/grouped_linear.py", "weight is not None"): 1,
    ("platforms/cpu/linear.py", "isinstance(layer, nn.Linear)"): 1,
    ("platforms/cpu/platform.py", "graph.output is not None"): 1,
    ("platforms/cuda_grouped_linear.py", "weight.offsets is not None"): 1,
    ("plugins/manager.py", "plugin_name is not None"): 1,
    ("quantization/compressed_tensors/method.py", "codes is not None and scale is not None"): 1,
    ("quantization/compressed_tensors/method.py", "codes is not None"): 1,
    ("quantization/compressed_tensors/method.py", "values is not None"): 1,
    ("quantization/gptq.py", "self.config is not None"): 2,
    ("quantization/wna16.py", "config is not None"): 1,
    ("quantization/wna16.py", "weight is not None"): 2,
    ("spec_decode/eagle.py", "hidden_states is not None"): 1,
    ("spec_decode/eagle.py", "self.lm_head is not None"): 2,
    ("spec_decode/model_drafter.py", "start.outputs is not None"): 1,
    ("structured_output/manager.py", "self.job is not None"): 2,
    ("structured_output/validator_child.py", "isinstance(reply, dict)"): 1,
    ("structured_output/validator_child.py", "self._conn is not None"): 1,
    ("structured_output/xgrammar_backend.py", "isinstance(grammar, XgrammarGrammar)"): 1,
}


def _package_asserts() -> Counter[tuple[str, str]]:
    found: Counter[tuple[str, str]] = Counter()
    for path in sorted(REPO_ROOT.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).parts
        if parts[0] in NOT_PACKAGE or any(part.startswith(".") for part in parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assert):
                found[("/".join(parts), ast.unparse(node.test))] += 1
    return found


def test_package_asserts_are_only_the_listed_internal_invariants() -> None:
    found = _package_asserts()
    assert len(found) > 10  # the walk saw the package
    assert {key: count for key, count in found.items() if INTERNAL_INVARIANTS.get(key) != count} == {}
    assert [key for key in INTERNAL_INVARIANTS if key not in found] == []  # a removed one leaves the list too
