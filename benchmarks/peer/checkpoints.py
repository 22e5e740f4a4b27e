"""The random Llama checkpoints both engines load from the same folder.

- `7m`: the throughput benchmark's Llama (hidden 256, 4 layers, 4/2 heads,
  7.1M parameters), `pagedllm.model_registry.tiny.get_benchmark_model_dir`'s
  shape and weights;
- `100m`: the ~100M Llama of issue 17 (hidden 768, 12 layers, GQA 12/4, 88M
  parameters, LLAMA_100M).

Both with the shipped BPE tokenizer (8,192 tokens), weights from a fixed seed
(benchmark_model.SEED) drawn in float32 and, for `bfloat16`, rounded to it,
so the two dtypes hold the same model. config.json's `torch_dtype` says the
dtype, which is what `dtype="auto"` reads in both engines. Each folder is
built once into `$PAGEDLLM_CACHE_DIR` (default ~/.cache/pagedllm).

    .venv/bin/python benchmarks/peer/checkpoints.py --model 100m --dtype bfloat16   # prints the folder
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODELS = ("7m", "100m")
DTYPES = ("float32", "bfloat16")
CACHE_VERSION = "v1"  # bump whenever what a folder contains changes


def checkpoint_dir(model: str, dtype: str) -> Path:
    """The folder of `model` in `dtype`, built on first use."""
    from pagedllm.model_registry.tiny import get_tokenizer_dir
    from pagedllm.model_registry.tiny.cache import build_once

    if model not in MODELS or dtype not in DTYPES:
        raise ValueError(f"model={model!r}, dtype={dtype!r}: expected one of {MODELS} and one of {DTYPES}")
    tokenizer_dir = get_tokenizer_dir()
    return build_once(f"peer-llama-{model}-{dtype}-{CACHE_VERSION}",
                      lambda out_dir: write_checkpoint(out_dir, tokenizer_dir, model, dtype))


def write_checkpoint(out_dir: Path, tokenizer_dir: Path, model: str, dtype: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from pagedllm.model_registry.tiny.benchmark_model import LLAMA_100M, build_benchmark_model

    build_benchmark_model(out_dir, tokenizer_dir, LLAMA_100M if model == "100m" else None)
    if dtype == "float32":
        return
    weights_path = out_dir / "model.safetensors"
    weights = {name: tensor.to(getattr(torch, dtype)) for name, tensor in load_file(weights_path).items()}
    save_file(weights, str(weights_path), metadata={"format": "pt"})
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["torch_dtype"] = dtype
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", choices=MODELS, default="7m")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    args = parser.parse_args()
    print(checkpoint_dir(args.model, args.dtype))


if __name__ == "__main__":
    main()
