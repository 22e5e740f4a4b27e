"""benchmarks/peer/'s own logic, without vLLM: the checkpoints both engines
load, the placement that gives vLLM the same cores and KV cache as pagedllm,
and the ratio tables built from the results the children report."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

PEER_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "peer"


def _load(name: str) -> ModuleType:
    """A script of benchmarks/peer, importable the way the scripts import each other."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PEER_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up; the scripts import peer_common by name
    spec.loader.exec_module(module)
    return module


peer_common = _load("peer_common")
checkpoints = _load("checkpoints")
offline = _load("offline")
serving = _load("serving")
burst = _load("burst")


def test_cores_parse_like_vllms_thread_bind_variable() -> None:
    assert peer_common.parse_cores("0-1") == (0, 1)
    assert peer_common.parse_cores("0,2-3") == (0, 2, 3)
    for bad in ("", "a-b", "0-1,1", "1-", "3-1"):
        with pytest.raises(ValueError, match="--cores"):
            peer_common.parse_cores(bad)


def test_vllm_gets_the_same_cores_and_kv_cache_as_pagedllm(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING",
                "OMP_PROC_BIND"):
        monkeypatch.delenv(key, raising=False)
    placement = peer_common.Placement(cores=(0, 1), kv_cache_gib=2, vllm_python="/venv/bin/python",
                                      vllm_env=(("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),),
                                      pagedllm_env=(("OMP_PROC_BIND", "true"),))
    vllm_env = placement.env("vllm-2c")
    assert vllm_env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert int(vllm_env["VLLM_CPU_KVCACHE_SPACE"]) << 30 == placement.kv_cache_bytes == 2 << 30
    assert vllm_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # vLLM's default placement: the same KV cache, vLLM's own thread binding.
    default_env = placement.env("vllm")
    assert default_env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert default_env["VLLM_CPU_KVCACHE_SPACE"] == vllm_env["VLLM_CPU_KVCACHE_SPACE"]
    assert not any(key.startswith("VLLM_") for key in placement.env("pagedllm"))  # vLLM's knobs stay vLLM's
    assert placement.env("pagedllm")["OMP_PROC_BIND"] == "true" and "OMP_PROC_BIND" not in vllm_env
    assert placement.python("vllm") == placement.python("vllm-2c") == "/venv/bin/python"
    assert placement.python("pagedllm") == sys.executable
    assert serving.server_command("vllm", placement, "/m", "float32", 8001)[:3] == [
        "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    # The same pagedllm server flag carries the same bytes.
    command = serving.server_command("pagedllm", placement, "/m", "float32", 8001)
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)


def test_engine_order_alternates_between_reps_and_rotates_three() -> None:
    assert [peer_common.engine_order(rep) for rep in range(3)] == [
        ("pagedllm", "vllm-2c"), ("vllm-2c", "pagedllm"), ("pagedllm", "vllm-2c")]
    assert [peer_common.engine_order(rep, peer_common.PEERS) for rep in range(4)] == [
        ("pagedllm", "vllm-2c", "vllm"), ("vllm-2c", "vllm", "pagedllm"), ("vllm", "pagedllm", "vllm-2c"),
        ("pagedllm", "vllm-2c", "vllm")]


def test_peer_names_are_checked() -> None:
    assert peer_common.parse_peers("pagedllm, vllm") == ["pagedllm", "vllm"]
    assert [peer_common.engine_of(p) for p in peer_common.PEERS] == ["pagedllm", "vllm", "vllm"]
    for bad in ("", "vllm,vllm", "sglang"):
        with pytest.raises(ValueError, match="expected"):
            peer_common.parse_peers(bad)


def test_percentile_interpolates_between_closest_ranks_like_numpy() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert [peer_common.percentile(values, q) for q in (0, 50, 99, 100)] == [1.0, 3.0, 4.96, 5.0]
    assert peer_common.percentile([], 50) != peer_common.percentile([], 50)  # NaN


def test_offline_table_takes_medians_over_all_runs_and_counts_identical_outputs() -> None:
    result = offline.WorkloadResult(
        name="7m-float32", num_prompts=2, num_new_tokens=10,
        times={"pagedllm": [1.0, 4.0, 2.0], "vllm-2c": [5.0, 4.0, 3.0], "vllm": [8.0]},
        load_s={"pagedllm": [1.0], "vllm-2c": [9.0], "vllm": [9.0]},
        tokens={"pagedllm": [[1, 2], [3, 4]], "vllm-2c": [[1, 2], [3, 5]], "vllm": [[1, 2], [3, 4]]},
    )
    assert result.seconds("pagedllm") == 2.0 and result.tokens_per_s("pagedllm") == 10.0
    assert result.tokens_per_s("vllm-2c") == 5.0
    lines = offline.results_table([result], ["pagedllm", "vllm-2c", "vllm"]).splitlines()
    assert lines[2:] == [
        "| 7m-float32, 2 prompts x 10 | pagedllm | 2.000 | 10.0 | - | - |",
        "| 7m-float32, 2 prompts x 10 | vllm-2c | 4.000 | 5.0 | 2.00x | 1/2 |",
        "| 7m-float32, 2 prompts x 10 | vllm | 8.000 | 2.5 | 4.00x | 2/2 |",
    ]


def test_serving_table_puts_pagedllm_ahead_when_its_rate_is_higher_and_shows_the_itl_tail() -> None:
    results = serving.ServingResults()
    results.startup_s = {"pagedllm": [2.0, 4.0], "vllm-2c": [60.0], "vllm": [30.0]}
    results.levels["pagedllm"][8] = [
        {"output_throughput": 600.0, "p50_ttft_ms": 100.0, "p50_itl_ms": 5.0, "p99_itl_ms": 10.0,
         "p50_tpot_ms": 5.5, "failed": 0},
        {"output_throughput": 800.0, "p50_ttft_ms": 300.0, "p50_itl_ms": 7.0, "p99_itl_ms": 50.0,
         "p50_tpot_ms": 7.5, "failed": 1},
    ]
    results.levels["vllm-2c"][8] = [{"output_throughput": 350.0, "p50_ttft_ms": 400.0, "p50_itl_ms": 12.0,
                                     "p99_itl_ms": 36.0, "p50_tpot_ms": 13.0, "failed": 0}]
    # Chunks sent in bunches: an ITL p50 near zero, the pace only in TPOT.
    results.levels["vllm"][8] = [{"output_throughput": 175.0, "p50_ttft_ms": 800.0, "p50_itl_ms": 0.0,
                                  "p99_itl_ms": 48.0, "p50_tpot_ms": 24.0, "failed": 2}]
    lines = serving.results_table(results, [8], ["pagedllm", "vllm-2c", "vllm"]).splitlines()
    assert lines[0].startswith("| concurrency | server | out tok/s | pagedllm / this | TTFT p50 ms | ITL p50 ms |")
    assert lines[2:] == [
        "| 8 | pagedllm | 700.0 | - | 200.0 | 6.00 | 30.00 | 5.0 | 6.50 | 1 |",
        "| 8 | vllm-2c | 350.0 | 2.00x | 400.0 | 12.00 | 36.00 | 3.0 | 13.00 | 0 |",
        "| 8 | vllm | 175.0 | 4.00x | 800.0 | 0.00 | 48.00 | n/a | 24.00 | 2 |",
    ]
    startup = serving.startup_table(results, ["pagedllm", "vllm-2c", "vllm"]).splitlines()
    assert startup[2:] == ["| pagedllm | 3.00 | - |", "| vllm-2c | 60.00 | 20.00x |", "| vllm | 30.00 | 10.00x |"]


def test_a_missing_level_shows_as_not_available_instead_of_a_ratio() -> None:
    results = serving.ServingResults()
    results.levels["pagedllm"][1] = [{"output_throughput": 100.0, "p50_ttft_ms": 10.0, "p50_itl_ms": 5.0}]
    lines = serving.results_table(results, [1], ["pagedllm", "vllm-2c"]).splitlines()
    assert lines[2] == "| 1 | pagedllm | 100.0 | - | 10.0 | 5.00 | n/a | n/a | n/a | 0 |"
    assert lines[3].startswith("| 1 | vllm-2c | n/a | n/a |")


def test_burst_prompts_are_fixed_distinct_and_clear_of_the_vocabulary_ends() -> None:
    decoders, long_prompts = burst.make_prompts(0, 8192, 3, 64, 2, 2000)
    assert [len(p) for p in decoders] == [64] * 3 and [len(p) for p in long_prompts] == [2000] * 2
    assert (decoders, long_prompts) == burst.make_prompts(0, 8192, 3, 64, 2, 2000)
    assert decoders != burst.make_prompts(1000, 8192, 3, 64, 2, 2000)[0]  # the warm-up's ids differ
    assert all(1000 <= token < 8192 - 1000 for prompt in decoders + long_prompts for token in prompt)


def test_burst_gaps_split_at_the_window_from_send_to_last_completion_plus_a_second() -> None:
    # Burst sent at 10.0, done at 10.5 and 11.0: the window is [10.0, 12.0).
    load = {
        "decoders": [[9.0, 9.1, 9.2, 10.2, 11.9, 12.1, 12.2], [9.05, 9.15, 12.5]],
        "burst": [{"sent": 10.0, "first": 10.4, "done": 10.5}, {"sent": 10.0, "first": 10.9, "done": 11.0}],
        "errors": [],
    }
    metrics = burst.burst_metrics(load)
    # In the window: 9.2-10.2, 10.2-11.9, 11.9-12.1 (decoder 0) and 9.15-12.5 (decoder 1).
    assert metrics.worst_gap_ms == pytest.approx(3350.0)
    assert metrics.gap_p50_ms == pytest.approx(1350.0)
    # Outside: 9.0-9.1, 9.1-9.2, 12.1-12.2, 9.05-9.15, all 100 ms.
    assert metrics.steady_gap_p50_ms == pytest.approx(100.0)
    assert metrics.burst_ttft_p50_ms == pytest.approx(650.0) and metrics.burst_ttft_max_ms == pytest.approx(900.0)
    assert metrics.window_s == pytest.approx(2.0) and metrics.failed == 0


def test_burst_table_takes_medians_over_rounds_and_sums_failures() -> None:
    def run(worst: float, failed: int) -> object:
        return burst.BurstMetrics(worst, 10.0, 20.0, 5.0, 300.0, 400.0, 2.5, failed)

    table = burst.results_table({"pagedllm": [run(100.0, 0), run(300.0, 1)]}, ["pagedllm", "vllm"]).splitlines()
    assert table[2] == "| pagedllm | 200.0 | 10.0 | 20.0 | 5.0 | 300.0 | 400.0 | 2.50 | 1 |"
    assert table[3] == "| vllm | n/a | n/a | n/a | n/a | n/a | n/a | n/a | 0 |"


def test_child_answer_is_the_marked_line_whatever_else_the_engine_prints(capsys: pytest.CaptureFixture[str]) -> None:
    print("INFO engine chatter")
    peer_common.print_result({"times": [1.5]})
    print("shutdown chatter")
    answers = [line for line in capsys.readouterr().out.splitlines() if line.startswith(peer_common.RESULT_PREFIX)]
    assert [json.loads(line[len(peer_common.RESULT_PREFIX):]) for line in answers] == [{"times": [1.5]}]


def _live_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that are not zombies (read from /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process groups from /proc")
def test_stopping_a_child_also_stops_what_it_forked() -> None:
    # A stand-in for vLLM: a leader that forks a worker and waits on it.
    child = subprocess.Popen(["bash", "-c", "sleep 300 & wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(_live_members(child.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_live_members(child.pid)) == 2
    peer_common.stop_process_group(child, grace_s=5.0)
    assert child.returncode is not None and _live_members(child.pid) == []


def test_bfloat16_checkpoint_is_the_float32_one_rounded_and_pagedllm_loads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    float32_dir = checkpoints.checkpoint_dir("7m", "float32")
    bfloat16_dir = checkpoints.checkpoint_dir("7m", "bfloat16")
    assert checkpoints.checkpoint_dir("7m", "bfloat16") == bfloat16_dir  # built once
    float32_weights, bfloat16_weights = (load_file(d / "model.safetensors") for d in (float32_dir, bfloat16_dir))
    assert float32_weights.keys() == bfloat16_weights.keys()
    for name, weight in bfloat16_weights.items():
        assert weight.dtype == torch.bfloat16
        assert torch.equal(weight, float32_weights[name].to(torch.bfloat16)), name
    # What dtype="auto" reads, in vLLM (through transformers' config) and in pagedllm.
    assert AutoConfig.from_pretrained(bfloat16_dir).dtype == torch.bfloat16
    assert AutoConfig.from_pretrained(float32_dir).dtype == torch.float32
    assert json.loads((bfloat16_dir / "config.json").read_text())["hidden_size"] == 256

    # pagedllm serves the folder (tokenizer included): greedy tokens equal HF's on the same weights.
    prompt = "def add(a, b):"
    prompt_ids = AutoTokenizer.from_pretrained(bfloat16_dir)(prompt)["input_ids"]
    hf_model = AutoModelForCausalLM.from_pretrained(bfloat16_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False,
                                     eos_token_id=None, pad_token_id=2)[0, len(prompt_ids):].tolist()
    llm = LLM(model=str(bfloat16_dir), dtype="float32", num_kv_blocks=16)
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert list(output[0].prompt_token_ids) == prompt_ids
    assert list(output[0].outputs[0].token_ids) == expected
