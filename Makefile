# Every target works on a fresh machine: the venv is created on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install serve test lint docs demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

EXAMPLE_PLUGINS := examples/plugins/pagedllm-example-model \
	examples/plugins/pagedllm-example-attention \
	examples/plugins/pagedllm-example-platform \
	examples/plugins/pagedllm-example-grammar \
	examples/plugins/pagedllm-example-drafter \
	examples/plugins/pagedllm-example-connector \
	examples/plugins/pagedllm-example-toolparser \
	examples/plugins/pagedllm-example-logitsproc \
	examples/plugins/pagedllm-example-statlogger

# The CPU C kernels are compiled on first use (a few seconds of CPU in all);
# building them at install keeps that off the first `pagedllm serve`.
define PREBUILD_CPU_KERNELS
from pagedllm.attention_backends import cpu_decode_kernel, cpu_prefill_kernel
from pagedllm.platforms.cpu import amx_linear, fused_ops
for kernel in (fused_ops, cpu_decode_kernel, cpu_prefill_kernel, amx_linear):
    kernel.load()
endef
export PREBUILD_CPU_KERNELS

# NOTE: torch==2.13.0 first, so that no later requirement pulls a CUDA build.
# The ray extra too: CI runs the ray executor's tests.
# The example plugins are installed the way a user installs a plugin: pip
# install of their own pyproject.toml, found later through entry points only.
$(STAMP): $(PY) pyproject.toml tests/plugins/pagedllm-test-plugin/pyproject.toml \
		$(addsuffix /pyproject.toml,$(EXAMPLE_PLUGINS))
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,ray]'
	$(PIP) install -q -e tests/plugins/pagedllm-test-plugin
	$(PIP) install -q $(addprefix -e ,$(EXAMPLE_PLUGINS))
	$(PY) -c "$$PREBUILD_CPU_KERNELS"
	touch $(STAMP)

install: $(STAMP)

# The OpenAI-compatible server with the embedded default model (Ctrl-C stops it).
serve: $(STAMP)
	$(VENV)/bin/pagedllm serve --host 127.0.0.1 --port 8000

# The example plugins' own tests run too (each package's tests/ folder).
# Lint and the docs build first: a finding or a broken page fails `make test`
# (and CI) like a failing test.
# Two workers (pytest-xdist) on the two cores CI has, a file's tests on one (its
# module-scoped servers start once); TEST_WORKERS=0 runs in-process.
TEST_WORKERS ?= 2

test: lint docs
	$(PY) -m pytest --import-mode=importlib -n $(TEST_WORKERS) --dist loadfile tests $(wildcard $(addsuffix /tests/test_*.py,$(EXAMPLE_PLUGINS))) -q

# ruff over everything; mypy over the package (config in pyproject.toml). mypy must
# see this root as the package `pagedllm`, which the package-dir layout cannot
# name, so it runs from .cache/mypy-root where `pagedllm` links back here.
MYPY_ROOT := .cache/mypy-root
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	mkdir -p $(MYPY_ROOT) && ln -sfn ../.. $(MYPY_ROOT)/pagedllm
	cd $(MYPY_ROOT) && $(abspath $(VENV))/bin/mypy -p pagedllm --config-file $(CURDIR)/pyproject.toml \
		--cache-dir $(CURDIR)/.cache/mypy --python-executable $(abspath $(PY))

# The manual as a site (mkdocs-material) in .cache/site. --strict (never with
# --quiet, which hides the warnings strict counts): a broken
# link or anchor, or a page missing from the nav, fails the build. The
# reference pages are generated from the code as it builds (docs/gen_reference.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

demo: $(STAMP)
	$(VENV)/bin/pagedllm generate --prompt "def fibonacci(n):" --max-tokens 32

bench: $(STAMP)
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/scheduler_overhead.py

clean:
	rm -rf $(VENV) *.egg-info
