"""The conformance kit (issue 18 point 2): every registered component of
every kind keeps its kind's suite, deliberately broken plugins fail the rule
they break (by name), and the pytest plugin's three ways in work as a plugin
author uses them (a subprocess pytest run in a fresh folder)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import broken_components

from pagedllm.plugins import get_plugin_manager
from pagedllm.plugins.kinds import KIND_SPECS
from pagedllm.testing import ConformanceError, RuleSkipped, load_suite, run_suite, suite_kinds

# (kind, name) -> the rules it is known to break, and why.
KNOWN_BROKEN: dict[tuple[str, str], tuple[set[str], str]] = {
    # pagedllm-test-plugin's backend copies each token's value instead of attending, on purpose.
    ("attention_backend", "test_echo"): (
        {"mixed-batch-matches-reference", "gqa-ratios-match-reference", "block-sizes-match-reference",
         "sliding-window-matches-reference"},
        "test_echo does no attention by design",
    ),
    # suffix decoding's global tree holds the outputs of other (and earlier)
    # requests on purpose, so an unseeded request's drafts depend on what else
    # ran; greedy tokens do not (its greedy rules hold), nor do a seeded
    # request's (it drafts from its own tree only).
    ("drafter", "suffix"): ({"batch-order"}, "suffix's global tree is shared across requests by design"),
}
if os.environ.get("TRITON_INTERPRET") == "1":
    # Triton's CPU interpreter computes bfloat16 kernels wrong (errors ~1e8 even
    # for a lone decode; float16 and float32 agree to 1e-3): a GPU run has no entry here.
    KNOWN_BROKEN[("attention_backend", "triton")] = (
        {"mixed-batch-matches-reference"}, "Triton's CPU interpreter miscomputes bfloat16"
    )


def _targets() -> list[tuple[str, str, str]]:
    manager = get_plugin_manager()
    manager.load()
    return [
        (kind, name, rule)
        for kind in suite_kinds()
        for name in manager.registry(kind).names()
        for rule in load_suite(kind).rule_names()
    ]


@pytest.fixture(autouse=True)
def _check_block_invariant_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")


@pytest.fixture(scope="module")
def _eagle3_head(tmp_path_factory: pytest.TempPathFactory) -> str:
    """No EAGLE-3 head ships for the tiny model: the drafter suite drafts
    with a random one in vLLM's layout (its drafts are rarely right, never harmful)."""
    from helpers.eagle3_heads import save_random_eagle3_head

    from pagedllm.model_registry.tiny import get_tiny_model_dir

    return str(save_random_eagle3_head(get_tiny_model_dir(), tmp_path_factory.mktemp("eagle3") / "head"))


@pytest.fixture(autouse=True)
def _drafter_models(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "eagle3" in request.node.name:
        from pagedllm.testing.suites import drafter

        monkeypatch.setitem(drafter.DRAFTER_MODELS, "eagle3", request.getfixturevalue("_eagle3_head"))


@pytest.mark.parametrize(("kind", "name", "rule"), _targets())
def test_every_registered_component_keeps_its_kinds_rules(kind: str, name: str, rule: str) -> None:
    broken, why = KNOWN_BROKEN.get((kind, name), (set(), ""))
    check = load_suite(kind).get(rule).check
    try:
        if rule in broken:
            with pytest.raises(ConformanceError) as failure:
                check(name)
            assert failure.value.rule == rule, why
        else:
            check(name)
    except RuleSkipped as skipped:
        pytest.skip(skipped.reason)


def test_every_plugin_kind_has_a_suite() -> None:
    assert {str(kind) for kind in KIND_SPECS} <= set(suite_kinds())


@pytest.fixture
def broken_plugin() -> object:
    manager = get_plugin_manager()
    plugin = broken_components.BrokenPlugin()
    manager.register(plugin, name="conformance-broken")
    yield plugin
    manager.unregister(name="conformance-broken")


@pytest.mark.parametrize(
    ("kind", "name", "rule"),
    [
        ("attention_backend", broken_components.BACKEND, "sliding-window-matches-reference"),
        ("drafter", broken_components.DRAFTER, "batch-order"),
        ("kv_connector", broken_components.CONNECTOR, "delayed-free-contract"),
    ],
    ids=["backend-ignoring-its-window", "drafter-reversing-the-batch", "connector-holding-blocks"],
)
def test_a_broken_plugin_fails_the_rule_it_breaks_by_name(
    broken_plugin: object, kind: str, name: str, rule: str
) -> None:
    with pytest.raises(ConformanceError) as failure:
        run_suite(kind, name)
    assert failure.value.rule == rule
    assert f"conformance rule {rule!r} broken" in str(failure.value)
    # Every rule before it held (run_suite stops at the first broken one).
    rules = load_suite(kind).rule_names()
    for earlier in rules[: rules.index(rule)]:
        load_suite(kind).get(earlier).check(name)


def test_an_unknown_name_is_a_conformance_error_listing_the_registered_ones() -> None:
    with pytest.raises(ConformanceError, match=r"'loads' broken: .*no_such_backend.*cpu"):
        load_suite("attention_backend").get("loads").check("no_such_backend")


def test_a_kind_without_a_suite_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no conformance suite for plugin kind 'no_such_kind'"):
        load_suite("no_such_kind")


# ------------------------------------------------- the pytest plugin, as a user runs it


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=folder, capture_output=True, text=True, timeout=300, env=env,
    )


def test_the_option_collects_one_item_per_rule_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "test_unrelated.py").write_text("def test_not_collected():\n    raise AssertionError\n")
    result = _pytest(tmp_path, "--pagedllm-conformance", "router:round_robin",
                     "--pagedllm-conformance", "model_source:tiny", "-v")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rules = [f"router:round_robin[{r}] PASSED" for r in load_suite("router").rule_names()]
    rules += [f"model_source:tiny[{r}] PASSED" for r in load_suite("model_source").rule_names()]
    for line in rules:
        assert line in result.stdout
    assert f"{len(rules)} passed" in result.stdout and "test_not_collected" not in result.stdout


def test_a_star_runs_the_suite_against_every_registered_name(tmp_path: Path) -> None:
    result = _pytest(tmp_path, "--pagedllm-conformance", "router:*", "--collect-only", "-q")
    routers = get_plugin_manager().registry("router").names()
    collected = [line for line in result.stdout.splitlines() if line.startswith("pagedllm-conformance::router:")]
    assert sorted(collected) == sorted(
        f"pagedllm-conformance::router:{name}[{rule}]" for name in routers for rule in load_suite("router").rule_names()
    )


def test_the_option_rejects_a_malformed_target_and_an_unknown_kind(tmp_path: Path) -> None:
    malformed = _pytest(tmp_path, "--pagedllm-conformance", "router")
    assert malformed.returncode == 4 and "expected KIND:NAME" in malformed.stderr
    unknown = _pytest(tmp_path, "--pagedllm-conformance", "no_such_kind:x")
    assert unknown.returncode != 0 and "no conformance suite for plugin kind 'no_such_kind'" in (
        unknown.stdout + unknown.stderr
    )


def test_a_plugin_authors_three_lines_give_one_test_per_rule(tmp_path: Path) -> None:
    (tmp_path / "test_my_router.py").write_text(textwrap.dedent("""
        from pagedllm.testing import conformance_tests

        test_my_router = conformance_tests("router", "least_loaded")
    """))
    result = _pytest(tmp_path, "-v")
    assert result.returncode == 0, result.stdout[-3000:]
    for rule in load_suite("router").rule_names():
        assert f"test_my_router.py::test_my_router[{rule}] PASSED" in result.stdout


def test_a_failing_rule_is_reported_under_its_name(tmp_path: Path) -> None:
    (tmp_path / "test_missing.py").write_text(textwrap.dedent("""
        from pagedllm.testing import conformance_tests

        test_missing = conformance_tests("router", "not_registered")
    """))
    result = _pytest(tmp_path)
    assert result.returncode == 1
    assert "conformance rule 'routes-to-a-live-replica' broken" in result.stdout


def test_the_fixture_runs_a_whole_suite(tmp_path: Path) -> None:
    (tmp_path / "test_fixture.py").write_text(textwrap.dedent("""
        def test_router(pagedllm_conformance):
            pagedllm_conformance("router", "prefix_aware")

        def test_cuda_platform_queries_skip_on_a_cpu_machine(pagedllm_conformance):
            pagedllm_conformance("executor", "ray")
    """))
    result = _pytest(tmp_path, "-rs")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 passed" in result.stdout or "1 passed, 1 skipped" in result.stdout


def test_the_pytest_plugin_is_light_to_load() -> None:
    """pytest loads it in every run of every project installed beside pagedllm."""
    code = "import sys, pagedllm.testing.pytest_plugin; print([m for m in HEAVY if m in sys.modules])"
    code = code.replace("HEAVY", "('torch', 'transformers')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr
