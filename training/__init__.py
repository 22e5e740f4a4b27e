"""Training, evaluation and model-card code for the shipped models.

Not installed: `pyproject.toml` leaves this folder out of the distribution,
as it does tests/ and benchmarks/. Run it from a checkout with the editable
install (`make install`), where the repository root is the package
`pagedllm`:

    python -m pagedllm.training.tiny.train --which target --steps N --seed 0 --out DIR
    python -m pagedllm.training.tiny.evaluate [--write-cards]
    python -m pagedllm.training.train_eagle --target tiny --minutes 12 --out DIR

The weights it produced, their tokenizer and their model cards ship in
`model_registry/tiny/weights/`, where the engine loads them from.
"""
