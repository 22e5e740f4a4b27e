"""`pagedllm bench spec` end to end on a tiny random model (numbers unchecked:
only the report's shape and the consistency of its columns)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.tiny_models import cached_tiny_model

from pagedllm.entrypoints.bench import spec
from pagedllm.entrypoints.cli import main


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bench_spec_writes_a_table_and_json(
    async_scheduling: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[tuple[int, int, int]] = []
    timed_run = spec._run

    def recording_run(llm: object, prompts: list[list[int]], batch_size: int, output_len: int) -> object:
        runs.append((len(prompts), batch_size, output_len))
        return timed_run(llm, prompts, batch_size, output_len)

    monkeypatch.setattr(spec, "_run", recording_run)
    model = cached_tiny_model("llama", with_tokenizer=True, seed=21)
    result_file = tmp_path / "spec.json"
    rc = main([
        "bench", "spec", "--model", str(model), "--methods", "ngram,draft_model", "--draft-model", str(model),
        "--dataset", "repeat", "--num-prompts", "2", "--output-len", "8", "--batch-sizes", "1,2",
        "-k", "3", "--num-kv-blocks", "64", "--disable-tqdm", "--result-file", str(result_file),
        "--policy", "always", *(["--async-scheduling"] if async_scheduling else []),
    ])
    assert rc == 0
    table = capsys.readouterr().out
    assert "speedup" in table and "ngram" in table and "draft_model" in table
    assert ("async scheduling" in table) == async_scheduling
    assert all(column in table for column in ("draft ms", "verify ms", "rest ms", "drafted"))
    rows = json.loads(result_file.read_text())["results"]
    assert [(r["method"], r["batch_size"]) for r in rows] == [
        ("none", 1), ("none", 2), ("ngram", 1), ("ngram", 2), ("draft_model", 1), ("draft_model", 2),
    ]
    for row in rows:
        assert row["output_tokens"] == 2 * 8 and row["async_scheduling"] == async_scheduling
        if row["method"] == "none":
            assert row["acceptance_rate"] is None
            assert (row["draft_ms"], row["verify_ms"], row["rest_ms"], row["drafted_fraction"]) == (None,) * 4
        else:
            assert row["speedup"] == pytest.approx(row["output_tok_s"] / row["baseline_tok_s"])
            assert len(row["per_position_acceptance"]) == 3
            # The runner's draft and verify times are per step, within the wall
            # time per step (rest is what is left, so it cannot be negative);
            # `always` drafts every step.
            assert row["num_steps"] > 0 and row["draft_ms"] > 0 and row["verify_ms"] > 0
            per_step_ms = 1000 * row["elapsed_s"] / row["num_steps"]
            assert row["draft_ms"] + row["verify_ms"] <= per_step_ms and row["rest_ms"] >= 0
            assert row["drafted_fraction"] == 1.0
    # Each batch size is timed right after a warm-up of its first batch
    # (graphs of its shapes are captured on first use, outside the timed run).
    assert runs == [(1, 1, 8), (2, 1, 8), (2, 2, 8), (2, 2, 8)] * 3
    # The draft model is the target: every draft is accepted.
    assert all(r["acceptance_rate"] == 1.0 for r in rows if r["method"] == "draft_model")
