# Every target works on a fresh machine: the venv is created on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install serve test demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# NOTE: torch==2.13.0 first, so that no later requirement pulls a CUDA build.
$(STAMP): $(PY) pyproject.toml tests/plugins/pagedllm-test-plugin/pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q -e tests/plugins/pagedllm-test-plugin
	touch $(STAMP)

install: $(STAMP)

# The OpenAI-compatible server with the embedded default model (Ctrl-C stops it).
serve: $(STAMP)
	$(VENV)/bin/pagedllm serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(PY) -m pytest --import-mode=importlib tests -q

demo: $(STAMP)
	$(VENV)/bin/pagedllm generate --prompt "def fibonacci(n):" --max-tokens 32

bench: $(STAMP)
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/scheduler_overhead.py

clean:
	rm -rf $(VENV) *.egg-info
