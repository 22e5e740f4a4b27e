"""Cold start: `pagedllm serve` (the shipped model) from spawn to its first
completion, against the 3 s target (issue 17 point 4).

Each run spawns `pagedllm serve` on 127.0.0.1 and a free port, polls
`GET /health` until it answers 200, then sends one `POST /v1/completions`
(max_tokens 1), and stops the server by its pid. The table shows spawn ->
/health 200 and spawn -> first completion (min / median / max), each over
the 3 s target, and the CPU seconds the API process and the engine core had
used by then (a busy machine stretches wall time; CPU time shows what each
process did). Trees are run interleaved (A B A B ...), so a comparison is
made under the same load:

    .venv/bin/python benchmarks/cold_start.py [--runs 5]
    .venv/bin/python benchmarks/cold_start.py --tree before=/tmp/before --tree after=.

A tree is a folder holding the package as `pagedllm/` ... or the repository
itself: it is put first on PYTHONPATH (through a link named `pagedllm`).

`--breakdown` (on by default) then prints where each process's start goes:
the API process's imports and tokenizer, and the engine core's imports and
`build_engine` (the same calls `pagedllm serve` makes, in one fresh
interpreter each, `python -X importtime` parsed: imports grouped by top
package, then the costliest pagedllm functions of the engine build).

Note: with PYTHONDONTWRITEBYTECODE=1 (this machine's default) nothing
caches the package's bytecode, so every start compiles pagedllm's sources;
`--pycache DIR` lets Python cache it there (as an installed package would).
`--nice -10` runs this client and the server above the machine's other work
(root only; also the session's autogroup, where the kernel shares the CPU
per session), which approximates an idle machine on a busy one; it takes CPU
from everything else while it runs, so keep such runs short.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

TARGET_S = 3.0
REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")

API_PATH = """
import time
start = time.perf_counter()
import pagedllm.entrypoints.cli
from pagedllm.entrypoints.openai.api_server import build_app
import uvicorn
from pagedllm.engine.async_llm import AsyncLLM
imported = time.perf_counter()
from pagedllm.model_registry.tokenizer import load_tokenizer
load_tokenizer("tiny")
done = time.perf_counter()
print(f"PHASE imports {imported - start:.3f}")
print(f"PHASE tokenizer {done - imported:.3f}")
"""

CORE_PATH = """
import cProfile, pstats, time
start = time.perf_counter()
from pagedllm.engine.core_proc import _build_engine
from pagedllm.core.config import EngineConfig
imported = time.perf_counter()
config_json = EngineConfig.from_flat(model="tiny").model_dump_json(exclude={"server"})
profile = cProfile.Profile()
profile.enable()
parts = _build_engine(config_json)
profile.disable()
done = time.perf_counter()
print(f"PHASE imports {imported - start:.3f}")
print(f"PHASE build_engine {done - imported:.3f}")
stats = pstats.Stats(profile).stats
import os, pagedllm
root = os.path.dirname(os.path.realpath(pagedllm.__file__)) + os.sep
rows = []
for (file, line, name), (_, _, _, cumulative, _) in stats.items():
    if "<" in file or "<" in name:
        continue
    file = os.path.realpath(file)
    if file.startswith(root) and ".venv" not in file:
        rows.append((cumulative, f"{file[len(root):]}:{name}"))
for cumulative, label in sorted(rows, reverse=True)[:14]:
    print(f"FUNC {cumulative:.3f} {label}")
parts.executor.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tree_env(tree: Path | None, pycache: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PAGEDLLM_LOG_LEVEL", None)
    if tree is not None:
        env["PYTHONPATH"] = str(_package_parent(tree)) + os.pathsep + env.get("PYTHONPATH", "")
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def _package_parent(tree: Path) -> Path:
    """A folder whose `pagedllm` is `tree` (the repository root is the package)."""
    if (tree / "pagedllm" / "__init__.py").is_file():
        return tree
    parent = Path(tempfile.gettempdir()) / f"pagedllm-cold-start-{abs(hash(str(tree.resolve())))}"
    parent.mkdir(exist_ok=True)
    link = parent / "pagedllm"
    if not link.exists():
        link.symlink_to(tree.resolve())
    return parent


def _cpu_seconds(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def one_start(env: dict[str, str], serve_args: list[str], timeout_s: float) -> dict[str, float]:
    """Spawn -> /health 200 and spawn -> first completion, in seconds, and the
    CPU seconds of the API process and the engine core by then."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    script = Path(sys.executable).with_name("pagedllm")
    launcher = [sys.executable, str(script)] if script.is_file() else [sys.executable, "-m", "pagedllm.entrypoints.cli"]
    command = [*launcher, "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port),
               "--log-stats-interval-s", "0"]
    with tempfile.TemporaryFile() as log, httpx.Client(timeout=timeout_s) as client:
        start = time.monotonic()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                if process.poll() is not None or time.monotonic() - start > timeout_s:
                    log.seek(0)
                    raise RuntimeError(f"the server did not start:\n{log.read().decode()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url + "/health").status_code == 200:
                        break
                time.sleep(0.01)
            healthy = time.monotonic() - start
            model = client.get(url + "/v1/models").json()["data"][0]["id"]
            response = client.post(url + "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 1})
            first = time.monotonic() - start
            response.raise_for_status()
            core = _children(process.pid)
            return {
                "health_s": healthy,
                "first_s": first,
                "api_cpu_s": _cpu_seconds(process.pid),
                "core_cpu_s": sum(_cpu_seconds(pid) for pid in core),
            }
        finally:
            _stop(process)


def _fmt(values: list[float]) -> str:
    return f"{min(values):5.2f} {statistics.median(values):6.2f} {max(values):5.2f}"


def print_table(results: dict[str, list[dict[str, float]]]) -> None:
    print(f"{'tree':<10} {'runs':>4} | {'health min  med   max':>21} | {'first min  med   max':>21} | "
          f"{'med/3s':>6} | {'API cpu':>7} {'core cpu':>8}")
    for label, rows in results.items():
        health = [row["health_s"] for row in rows]
        first = [row["first_s"] for row in rows]
        api_cpu = statistics.median(row["api_cpu_s"] for row in rows)
        core_cpu = statistics.median(row["core_cpu_s"] for row in rows)
        print(f"{label:<10} {len(rows):>4} | {_fmt(health):>21} | {_fmt(first):>21} | "
              f"{statistics.median(first) / TARGET_S:6.2f} | {api_cpu:7.2f} {core_cpu:8.2f}")


# ---------------------------------------------------------------- breakdown


def _parse_importtime(stderr: str) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """(self seconds by top-level package, the costliest first-level imports
    by cumulative seconds) from `-X importtime` output."""
    by_package: dict[str, float] = defaultdict(float)
    top_level: list[tuple[float, str]] = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cumulative_us, name = line[len("import time:") :].split("|")
        module = name.strip()
        by_package[module.split(".")[0]] += int(self_us) / 1e6
        if len(name) - len(name.lstrip()) == 1:  # one space: imported by the script itself
            top_level.append((int(cumulative_us) / 1e6, module))
    return dict(by_package), sorted(top_level, reverse=True)


def breakdown(label: str, code: str, env: dict[str, str]) -> None:
    completed = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                               env=env, timeout=300, check=False)
    if completed.returncode != 0:
        print(f"{label}: failed\n{completed.stderr[-2000:]}")
        return
    by_package, top_level = _parse_importtime(completed.stderr)
    phases = [line.split()[1:] for line in completed.stdout.splitlines() if line.startswith("PHASE")]
    print(f"\n{label}: " + ", ".join(f"{name} {float(seconds):.2f} s" for name, seconds in phases))
    total = sum(by_package.values())
    print(f"  imports, self time by top package (total {total:.2f} s):")
    for package, seconds in sorted(by_package.items(), key=lambda item: -item[1])[:10]:
        print(f"    {package:<28} {seconds:6.2f} s  {seconds / total:5.1%}")
    print("  costliest imports (cumulative, first level):")
    for seconds, module in top_level[:10]:
        print(f"    {module:<50} {seconds:6.2f} s")
    functions = [line.split(maxsplit=2)[1:] for line in completed.stdout.splitlines() if line.startswith("FUNC")]
    if functions:
        print("  engine build, pagedllm functions by cumulative time (imports included):")
        for seconds, name in functions:
            print(f"    {name:<60} {float(seconds):6.2f} s")


def _raise_priority(increment: int) -> None:
    """Niceness for this process and what it starts; with the kernel's
    autogroups (each session shares the CPU equally whatever its niceness)
    the session's autogroup gets it too."""
    os.nice(increment)
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(str(os.nice(0)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--runs", type=int, default=5, help="starts per tree")
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                        help="a pagedllm source tree to start (repeatable; default: the installed package)")
    parser.add_argument("--serve-args", default="", help="extra `pagedllm serve` arguments, e.g. '--dtype float32'")
    parser.add_argument("--pycache", default=None, metavar="DIR", help="let Python cache bytecode in DIR")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--nice", type=int, default=0, help="niceness increment for this client and the server")
    args = parser.parse_args()
    if args.nice:
        _raise_priority(args.nice)
    trees: dict[str, Path | None] = {"this": None}
    if args.tree:
        trees = {spec.split("=", 1)[0]: Path(spec.split("=", 1)[1]) for spec in args.tree}
    envs = {label: _tree_env(tree, args.pycache) for label, tree in trees.items()}
    serve_args = args.serve_args.split()
    results: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
    for run in range(args.runs):
        for label, env in envs.items():
            row = one_start(env, serve_args, args.timeout_s)
            results[label].append(row)
            print(f"run {run + 1} {label}: /health {row['health_s']:.2f} s, first completion {row['first_s']:.2f} s",
                  flush=True)
    load = os.getloadavg()
    print(f"\ncold start, shipped model, {args.runs} runs per tree, interleaved; target {TARGET_S:.1f} s; "
          f"load average {load[0]:.1f} on {os.cpu_count()} CPUs; niceness {os.nice(0)}; "
          f"bytecode cache {'in ' + args.pycache if args.pycache else 'as the environment says'}")
    print_table(results)
    if args.breakdown:
        for label, env in envs.items():
            breakdown(f"[{label}] API process (imports, tokenizer)", API_PATH, env)
            breakdown(f"[{label}] engine core (imports, build_engine)", CORE_PATH, env)


if __name__ == "__main__":
    main()
