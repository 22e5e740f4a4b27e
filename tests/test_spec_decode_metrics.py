"""Speculative-decoding counters: Prometheus series and the periodic log line."""

from __future__ import annotations

import msgspec

from pagedllm.core.stats import SchedulerStats, SpecDecodingStats
from pagedllm.engine.metrics import StatLoggerManager


def _stats(spec: SpecDecodingStats | None) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1, prefix_cache_queries=0,
        prefix_cache_hits=0, num_preemptions=0, spec_decoding_stats=spec,
    )


def test_observed_drafts_give_acceptance_rate_and_mean_length() -> None:
    stats = SpecDecodingStats.new(3)
    stats.observe_draft(3, 3)  # all accepted
    stats.observe_draft(3, 1)  # first accepted, second rejected
    stats.observe_draft(2, 0)  # none
    assert stats.num_drafts == 3
    assert stats.num_draft_tokens == 8
    assert stats.num_accepted_tokens == 4
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    assert stats.acceptance_rate == 0.5
    assert stats.mean_acceptance_length == 1 + 4 / 3


def test_prometheus_counters_and_log_line() -> None:
    manager = StatLoggerManager("m")
    spec = SpecDecodingStats.new(2)
    spec.observe_draft(2, 2)
    spec.observe_draft(2, 1)
    manager.record(_stats(spec), None)
    manager.interval_generation_tokens = 5  # make the line non-idle
    text = manager.render().decode()
    assert 'pagedllm:spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'pagedllm:spec_decode_num_draft_tokens_total{model_name="m"} 4.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_total{model_name="m"} 3.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    line = manager.log()
    assert "Spec decode acceptance rate: 75.0%" in line
    assert "Mean acceptance length: 2.50" in line
    assert "Per-position acceptance rate: 1.000, 0.500" in line


def test_scheduler_stats_with_spec_stats_cross_the_wire() -> None:
    spec = SpecDecodingStats.new(2)
    spec.observe_draft(2, 1)
    stats = _stats(spec)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=SchedulerStats)
    assert decoded == stats
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(_stats(None)), type=SchedulerStats).spec_decoding_stats is None


def test_per_request_counts_cross_the_wire() -> None:
    from pagedllm.core.outputs import EngineCoreOutput
    from pagedllm.engine.wire import EngineCoreOutputs

    output = EngineCoreOutput(request_id="r", new_token_ids=[1, 2, 3], spec_counts=(2, 6, 3))
    message = EngineCoreOutputs(outputs=[output], scheduler_stats=None, num_scheduled_tokens=4, timestamp=0.0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=EngineCoreOutputs)
    assert decoded.outputs == [output] and decoded.outputs[0].spec_counts == (2, 6, 3)
